"""LoRA on the tensor-parallel linear layers: choose the targets, attach, gather, merge.

`attach_lora` gives each targeted `ParallelLinear` two factor modules, `lora_A` and `lora_B`
(so the model's parameter names are the adapter format's, `MODULE.lora_A.weight`, see
`core.lora_format`), and an adapter hook that adds `(alpha / rank) * B A dropout(x)` to the
layer's local product. The factors are cut from global `(r, in)` / `(out, r)` tensors by the
one sharding rule (`sharding.shard_spec`): B split by rows on a column-parallel base, A split
by columns on a row-parallel one.

Tensor-parallel communication: none of its own, in forward or backward, per micro-batch.
- Column base (`wqkv`, `w1`): A reads the layer's input as the base does (copied in, or
  all-gathered along the sequence under sequence parallelism), so `h = A x` is the same on every
  tp rank and each rank applies its rows `B_r`. The backward of `h` on rank r is partial
  (`B_r^T dy_r`); it joins the base's partial input gradient in the all-reduce (reduce-scatter
  under SP) the layer's input does anyway. A's gradient is partial the same way: it is marked
  `sequence_parallel` so `pipeline.sync_sequence_parallel_grads` sums it over tp once per step
  (`r x in` values) instead of all-reducing `dh` (`tokens x r`) in every micro-batch's backward,
  which routing `h` through `copy_to_tp` would do, and which would also count A's share of the
  input gradient tp times once the input's own reduction added it up.
- Row base (`wo`, `w2`): A is split by columns, so `A_r x_r` is a partial sum; `B A_r x_r` is
  added to the base's partial product before the layer's all-reduce (reduce-scatter under SP),
  which sums both at once: B is linear, so this equals `B (sum_r A_r x_r)` with no extra
  collective, where reducing `A_r x_r` first would cost one `tokens x r` all-reduce per call.
  B's gradient, from the partial `A_r x_r`, is summed over tp once per step as above.
Dropout: on a column base the input is the same on every tp rank, so the mask is drawn from
the default generator (equal over tp); on a row base each rank holds other input columns, so
the mask comes from the model-parallel tracker (`tracker.fork()`, different per tp rank).

Initialization as PEFT's default: A kaiming-uniform (`a = sqrt(5)`) over the *global* `(r, in)`
tensor from a generator seeded by the run seed and the module name, B zeros; so the adapter
starts equal under every layout.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.core.config import ModelConfig
from tessera.core.lora_format import AdapterConfig, AdapterError, lora_names, merge_weight
from tessera.core.models.registry import family as model_family
from tessera.core.moe.shapes import is_moe_layer
from tessera.core.parallel.groups import ParallelGroups
from tessera.core.parallel.layers import ParallelLinear
from tessera.core.parallel.random import tracker
from tessera.core.parallel.sharding import global_param_shapes, shard_tensor, unshard_tensors

SHORT_NAMES = {"qkv": "attention.wqkv", "wo": "attention.wo", "w1": "feed_forward.w1",
               "w2": "feed_forward.w2"}
GROUP_NAMES = {"attention": ("qkv", "wo"), "mlp": ("w1", "w2"), "all": ("qkv", "wo", "w1", "w2")}
TARGETS_HELP = ("comma-separated: qkv, wo, w1, w2 (in every layer), attention (qkv,wo, and "
                "T5's cross-attention), mlp (w1,w2), all, or a regular expression matched "
                "against the whole module name "
                r"or the name after `layers.N.` (e.g. 'layers\.[01]\.attention\.wqkv')")
_LORA_PARAM = re.compile(r"\.lora_[AB]\.weight$")
_IN_LAYER = re.compile(r"^(?:\w+\.)?layers\.\d+\.")
# Multi-head latent attention's projections (`core.models.decoder.mla`), where other
# attentions have `attention.wqkv`: the short name `qkv` selects them.
MLA_PROJECTIONS = ("attention.wq", "attention.wq_a", "attention.wq_b", "attention.wkv_a",
                   "attention.wkv_b")

# An encoder-decoder's cross-attention (T5): the groups `attention` and `all` adapt it with the
# self-attention (the short names `qkv` and `wo` stay the self-attention's).
CROSS_ATTENTION = ("cross_attention.wq", "cross_attention.wkv", "cross_attention.wo")


def _block_linears(config: ModelConfig) -> list[str]:
    """The linear layers of one decoder block, in model order."""
    if config.mla is None:
        return list(SHORT_NAMES.values())
    q = ["attention.wq"] if config.mla.q_lora_rank is None else ["attention.wq_a",
                                                                 "attention.wq_b"]
    return [*q, "attention.wkv_a", "attention.wkv_b", "attention.wo", "feed_forward.w1",
            "feed_forward.w2"]


def adaptable_modules(config: ModelConfig) -> list[str]:
    """Every module LoRA may target, in model order: the family's `lora_modules` (T5: every
    linear of its encoder and decoder blocks), by default each block's qkv (multi-head latent
    attention: its q and kv projections), wo, w1 and w2 (not w1 / w2 of Mixture-of-Experts
    layers, whose experts are grouped weights, not linear layers)."""
    own = model_family(config).lora_modules
    if own is not None:
        return list(own(config))
    return [f"layers.{i}.{m}" for i in range(config.num_layers) for m in _block_linears(config)
            if not (m.startswith("feed_forward.") and is_moe_layer(config, i))]


def resolve_targets(targets: str | Sequence[str], config: ModelConfig) -> tuple[str, ...]:
    """The module names `targets` selects (syntax: `TARGETS_HELP`), in model order.

    Raises `AdapterError` for an empty list, a bad regular expression, or any item that
    matches no module (naming what can be matched).
    """
    items = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets)]
    items = [t for t in items if t]
    if not items:
        raise AdapterError("no LoRA targets: pass --lora-targets, e.g. 'qkv,wo' or 'all'")
    modules = adaptable_modules(config)
    chosen: set[str] = set()
    for item in items:
        if item in GROUP_NAMES or item in SHORT_NAMES:
            suffixes = {SHORT_NAMES[s] for s in GROUP_NAMES.get(item, (item,))}
            if SHORT_NAMES["qkv"] in suffixes:
                suffixes.update(MLA_PROJECTIONS)
            if item in ("attention", "all"):
                suffixes.update(CROSS_ATTENTION)
            matched = [m for m in modules if _in_layer(m) in suffixes]
        else:
            try:
                pattern = re.compile(item)
            except re.error as exc:
                raise AdapterError(f"LoRA target {item!r} is not a valid regular expression "
                                   f"({exc}); targets are {TARGETS_HELP}") from exc
            matched = [m for m in modules
                       if pattern.fullmatch(m) or pattern.fullmatch(_in_layer(m))]
        if not matched:
            moe = (" (the Mixture-of-Experts layers have no w1 / w2: their experts are grouped "
                   "weights LoRA does not adapt; target the attention)" if config.moe.num_experts
                   else "")
            raise AdapterError(f"LoRA target {item!r} matches no module of this model (its "
                               f"modules are {modules[0]} ... {modules[-1]}: layers.N."
                               f"{{{', '.join(dict.fromkeys(map(_in_layer, modules)))}}}){moe}; targets are "
                               f"{TARGETS_HELP}")
        chosen.update(matched)
    return tuple(m for m in modules if m in chosen)


def _in_layer(module: str) -> str:
    """The module's name inside its block: `attention.wqkv` of `layers.3.attention.wqkv` (or
    of T5's `decoder.layers.3.attention.wqkv`)."""
    return _IN_LAYER.sub("", module, count=1)


def is_lora_parameter(name: str) -> bool:
    """True for a LoRA factor's parameter name (`...lora_A.weight` / `...lora_B.weight`)."""
    return _LORA_PARAM.search(name) is not None


class LoRAFactor(nn.Module):
    """One factor (A or B) of a layer's adapter: a `weight` parameter, this rank's piece."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)


class LoRA:
    """The adapter hook of a `ParallelLinear`: `scaling * B A dropout(x)` from the layer's
    `lora_A` / `lora_B` factors (fp32 parameters; the product runs in the input's dtype).

    Dropout runs while the layer is in training mode (`set_lora_dropout`)."""

    def __init__(self, scaling: float, dropout: float):
        self.scaling, self.dropout = scaling, dropout

    def __call__(self, layer: ParallelLinear, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and layer.training:
            different_per_rank = layer.parallel == "row" and layer.tp_group is not None
            with tracker.fork() if different_per_rank else contextlib.nullcontext():
                x = F.dropout(x, self.dropout, training=True)
        a, b = layer.lora_A.weight, layer.lora_B.weight
        return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)) * self.scaling


def init_factors(module: str, rank: int, config: ModelConfig, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's default start of a module's global factors: A kaiming-uniform (`a = sqrt(5)`),
    drawn from a generator seeded by `seed` and the module name; B zeros."""
    rows, cols = global_param_shapes(config)[f"{module}.weight"]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(module.encode()))
    a = torch.empty(rank, cols)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
    return a, torch.zeros(rows, rank)


def attach_lora(stages: Sequence[nn.Module], adapter: AdapterConfig, *,
                tensors: dict[str, torch.Tensor] | None = None, seed: int = 0
                ) -> dict[str, nn.Parameter]:
    """Give every module of `adapter.modules` held by this rank's `stages` (GPTModel chunks)
    its LoRA factors: this rank's pieces of `tensors` (global A/B, e.g. from `load_adapter`) or
    of a fresh start (`init_factors`). Returns the factor parameters by global name."""
    wanted, out = set(adapter.modules), {}
    for model in stages:
        config, g = model.config, model.groups
        device = next(model.parameters()).device
        for name, layer in model.named_modules():
            if name not in wanted:
                continue
            if not isinstance(layer, ParallelLinear):
                raise AdapterError(f"{name} is not a linear layer; LoRA cannot adapt it")
            a_name, b_name = lora_names(name)
            if tensors is not None:
                full_a, full_b = tensors[a_name].float(), tensors[b_name].float()
            else:
                full_a, full_b = init_factors(name, adapter.rank, config, seed)
            a = shard_tensor(a_name, full_a, config, g.tp_rank, g.tp_size)
            b = shard_tensor(b_name, full_b, config, g.tp_rank, g.tp_size)
            layer.lora_A = LoRAFactor(a.to(device).clone().contiguous())
            layer.lora_B = LoRAFactor(b.to(device).clone().contiguous())
            # The factor whose gradient is partial over tp (module docstring): summed over tp
            # with the other tp-partial gradients by `sync_sequence_parallel_grads`.
            partial = layer.lora_A if layer.parallel == "column" else layer.lora_B
            partial.weight.sequence_parallel = True
            if getattr(layer.weight, "sequence_parallel", False):
                # A base replicated over tp whose gradient is partial (`mla`'s down-projections):
                # B's is partial too.
                layer.lora_B.weight.sequence_parallel = True
            layer.adapter = LoRA(adapter.scaling, adapter.dropout)
            out[a_name], out[b_name] = layer.lora_A.weight, layer.lora_B.weight
    return out


def lora_parameters(stages: Sequence[nn.Module]) -> dict[str, nn.Parameter]:
    """This rank's LoRA factor parameters by global name (`MODULE.lora_A.weight`, ...)."""
    return {name: p for model in stages for name, p in model.named_parameters()
            if is_lora_parameter(name)}


def mark_only_lora_as_trainable(model: nn.Module) -> None:
    """Freeze every parameter except the LoRA factors."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_parameter(name))


def set_lora_dropout(stages: Sequence[nn.Module], on: bool) -> None:
    """Turn the adapters' dropout on (training) or off (evaluation), whatever the base's mode:
    a frozen base stays in eval mode, so its own dropout never runs."""
    for model in stages:
        for layer in model.modules():
            if isinstance(layer, ParallelLinear) and isinstance(layer.adapter, LoRA):
                layer.train(on)


@contextlib.contextmanager
def lora_dropout_off(stages: Sequence[nn.Module]) -> Iterator[None]:
    """Evaluate without adapter dropout; the modes it found are restored afterwards."""
    layers = [m for model in stages for m in model.modules()
              if isinstance(m, ParallelLinear) and isinstance(m.adapter, LoRA)]
    modes = [m.training for m in layers]
    for m in layers:
        m.train(False)
    try:
        yield
    finally:
        for m, mode in zip(layers, modes, strict=True):
            m.train(mode)


def gather_global(local: dict[str, torch.Tensor], groups: ParallelGroups, config: ModelConfig
                  ) -> dict[str, torch.Tensor] | None:
    """Global tensors on global rank 0 (None elsewhere) from every rank's local LoRA pieces.

    Collective over the world when distributed. Keys are LoRA factor names, optionally with a
    `KIND/` prefix (`exp_avg/NAME`: an optimizer moment, sharded as its parameter); a 0-d
    tensor (`step/NAME`) is taken as it is. Data-parallel replicas other than dp rank 0 send
    nothing; pipeline ranks send their own modules.
    """
    mine = {n: t.detach().cpu() for n, t in local.items()} if groups.dp_rank == 0 else {}
    payloads = [(groups.tp_rank, mine)]
    if dist.is_initialized():
        rank0 = dist.get_rank() == 0
        gathered: list | None = [None] * dist.get_world_size() if rank0 else None
        dist.gather_object((groups.tp_rank, mine), gathered, dst=0)
        if not rank0:
            return None
        payloads = gathered
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for tp_rank, tensors in payloads:
        for name, t in tensors.items():
            pieces.setdefault(name, {})[tp_rank] = t
    out = {}
    for name, by_rank in pieces.items():
        if next(iter(by_rank.values())).dim() == 0:
            out[name] = by_rank[min(by_rank)]
            continue
        shards = [by_rank[r] for r in range(groups.tp_size)]
        out[name] = unshard_tensors(name.split("/")[-1], shards, config).contiguous()
    return out


@torch.no_grad()
def merge_lora_(stages: Sequence[nn.Module]) -> list[str]:
    """Fold every attached adapter into its layer's weight shard (`W_r + s B_r A` on a column
    base, `W_r + s B A_r` on a row base: each rank's shard of the merged global weight) and
    detach it. Returns the merged module names."""
    merged = []
    for model in stages:
        for name, layer in model.named_modules():
            if isinstance(layer, ParallelLinear) and isinstance(layer.adapter, LoRA):
                layer.weight.copy_(merge_weight(layer.weight, layer.lora_A.weight,
                                                layer.lora_B.weight, layer.adapter.scaling))
                del layer.lora_A, layer.lora_B
                layer.adapter = None
                merged.append(name)
    return merged
