"""The layout rules, written once: how every weight is split over tensor, pipeline and expert
ranks.

Every parameter has one *global* name and shape (what a checkpoint stores, independent of any
layout) and one `ShardSpec` (`shard_spec`). Model building, checkpoint loading under any layout,
the converters and the server all go through `shard_tensor` / `unshard_tensors` and `stage_ids` /
`stage_layers` (which stages a pipeline rank holds follows the `Layout`'s placement), and for
expert banks `expert_spec` / `shard_expert_tensor`, so the answer to "how is this weight split?"
lives here and nowhere else.

Invariants: `unshard_tensors` of the shards gives back the global tensor bit for bit, from any tp
(and any ep x etp for expert banks); vocabulary padding never reaches a checkpoint or a caller; a
kv head replicated over tp ranks is stored once (`stored_shard`); LoRA factors follow their base
weight, so rank r's factors make rank r's shard of the merged weight.

The special cases (fused QKV under grouped-query attention, kv-head replication, SwiGLU's
gate/up, vocabulary padding, LoRA factors, expert banks): docs/architecture.md, "The sharding
rules".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tessera.core.config import Layout, ModelConfig
from tessera.core.expert_config import expert_ffn_size
from tessera.core.models.registry import family as model_family


@dataclass(frozen=True)
class ShardSpec:
    """`dim` is the split dimension (None: replicated); `parts` are fused blocks along it."""

    dim: int | None
    parts: tuple[int, ...] | None = None  # sizes of fused blocks, each split on its own
    vocab: bool = False  # rows are vocabulary entries: pad to a multiple of tp first
    # Attention heads in each part: a part with fewer heads than tp ranks is not split but
    # replicated, each head on tp / heads consecutive ranks (None: split in even chunks).
    heads: tuple[int | None, ...] | None = None


_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])\.weight$")


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of `tp_size` (each rank holds an equal slice)."""
    return -(-vocab_size // tp_size) * tp_size


def global_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every global parameter name and its unsharded shape, in module order (the family's
    `param_shapes`)."""
    return model_family(config).param_shapes(config)


def num_parameters(config: ModelConfig) -> int:
    """Parameter count of the global model (tied embeddings counted once)."""
    return sum(math.prod(s) for s in global_param_shapes(config).values())


def shard_spec(name: str, config: ModelConfig) -> ShardSpec:
    """How the global parameter `name` is split over the tensor-parallel group."""
    lora = _LORA.match(name)
    if lora:
        return _lora_spec(lora["module"], lora["factor"], config)
    return model_family(config).shard_spec(name, config)


def _lora_spec(module: str, factor: str, config: ModelConfig) -> ShardSpec:
    """A LoRA factor's spec, from its base weight's (see the module docstring)."""
    base = shard_spec(f"{module}.weight", config)
    if base.vocab:
        raise ValueError(f"no LoRA rule for {module}: only the block linears take adapters")
    if base.dim == 0:  # column-parallel base: B's rows are the base's rows
        return base if factor == "B" else ShardSpec(dim=None)
    if base.dim == 1:  # row-parallel base: A's columns are the base's columns
        return ShardSpec(dim=1) if factor == "A" else ShardSpec(dim=None)
    return ShardSpec(dim=None)


def lora_global_shapes(config: ModelConfig, modules: dict[str, int]
                       ) -> dict[str, tuple[int, int]]:
    """The global shapes of the A and B factors of each `{module: rank}`: `(r, in)`, `(out, r)`."""
    shapes = global_param_shapes(config)
    out: dict[str, tuple[int, int]] = {}
    for module, rank in modules.items():
        rows, cols = shapes[f"{module}.weight"]
        out[f"{module}.lora_A.weight"] = (rank, cols)
        out[f"{module}.lora_B.weight"] = (rows, rank)
    return out


def lora_local_shape(name: str, global_shape: tuple[int, ...], config: ModelConfig,
                     tp_size: int) -> tuple[int, ...]:
    """The shape a tp rank holds of the LoRA factor `name` of global shape `global_shape` (the
    same on every rank, replicated kv heads included), as `shard_tensor` would cut it."""
    meta = torch.empty(global_shape, device="meta")
    return tuple(shard_tensor(name, meta, config, 0, tp_size).shape)


def shard_adapter(tensors: dict[str, torch.Tensor], config: ModelConfig, tp_rank: int,
                  tp_size: int) -> dict[str, torch.Tensor]:
    """Tp rank `tp_rank`'s pieces of a global adapter's A/B tensors (views where possible)."""
    return {n: shard_tensor(n, t, config, tp_rank, tp_size) for n, t in tensors.items()}


def unshard_adapter(shards: list[dict[str, torch.Tensor]], config: ModelConfig
                    ) -> dict[str, torch.Tensor]:
    """The global A/B tensors from every tp rank's pieces (local or stored form), in rank order."""
    return {n: unshard_tensors(n, [s[n] for s in shards], config) for n in shards[0]}


def kv_replicas(config: ModelConfig, tp_size: int) -> int:
    """How many tp ranks hold each kv head: `tp / num_kv_heads` when tp exceeds it, else 1."""
    return max(1, tp_size // config.num_kv_heads)


def local_kv_heads(config: ModelConfig, tp_size: int) -> int:
    """The kv heads one tp rank holds (and its KV cache stores): at least one, replicated."""
    return max(1, config.num_kv_heads // tp_size)


class KVGeometry(NamedTuple):
    """What one tp rank's KV cache stores per token and layer: `heads` heads of a
    `key_dim`-wide key and a `value_dim`-wide value."""

    heads: int
    key_dim: int
    value_dim: int

    @property
    def token_values(self) -> int:
        """Values cached per token and layer."""
        return self.heads * (self.key_dim + self.value_dim)


def kv_geometry(config: ModelConfig, tp_size: int) -> KVGeometry:
    """The KV cache entry of one tp rank: its kv heads of `head_dim` keys and values, or with
    multi-head latent attention one head holding the latent (as the key) and the shared rotary
    key (as the value), whole on every rank (`core.models.decoder.mla`)."""
    if config.mla is not None:
        return KVGeometry(1, config.mla.kv_lora_rank, config.mla.qk_rope_head_dim)
    return KVGeometry(local_kv_heads(config, tp_size), config.head_dim, config.head_dim)


def _part_bounds(size: int, heads: int | None, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """`[start, stop)` within a fused part of `size` rows that `tp_rank` holds."""
    if heads is not None and tp_size > heads:  # fewer heads than ranks: one whole head each
        per_head, head = size // heads, tp_rank // (tp_size // heads)
        return head * per_head, (head + 1) * per_head
    return _chunk_bounds(size, tp_rank, tp_size)


def _part_owned(heads: int | None, tp_rank: int, tp_size: int) -> bool:
    """Whether `tp_rank` stores its piece of a part: False for the later ranks of a replica
    group, whose piece is a copy of the first rank's."""
    return heads is None or tp_size <= heads or tp_rank % (tp_size // heads) == 0


def _pieces(spec: ShardSpec, tp_rank: int, tp_size: int) -> list[tuple[int, int, bool]]:
    """Per fused part, in order: the global `[start, stop)` rank `tp_rank` holds along
    `spec.dim`, and whether it owns (stores) them."""
    out, start = [], 0
    heads = spec.heads or (None,) * len(spec.parts)
    for size, h in zip(spec.parts, heads, strict=True):
        lo, hi = _part_bounds(size, h, tp_rank, tp_size)
        out.append((start + lo, start + hi, _part_owned(h, tp_rank, tp_size)))
        start += size
    return out


def local_shape(name: str, config: ModelConfig, tp_size: int) -> tuple[int, ...]:
    """The shape one tensor-parallel rank holds for the global parameter `name` (the same on
    every rank, replicated kv heads included)."""
    return stored_shape(name, config, 0, tp_size, stored=False)


def stored_shape(name: str, config: ModelConfig, tp_rank: int, tp_size: int,
                 stored: bool = True) -> tuple[int, ...]:
    """The shape of what tp rank `tp_rank` stores of `name` in a checkpoint: its local shape,
    less the kv rows that an earlier rank of its replica group stores (`stored_shard`).
    With `stored=False`, the local shape the model holds."""
    shape = list(global_param_shapes(config)[name])
    spec = shard_spec(name, config)
    if spec.dim is None:
        return tuple(shape)
    if spec.parts:
        shape[spec.dim] = sum(hi - lo for lo, hi, owned in _pieces(spec, tp_rank, tp_size)
                              if owned or not stored)
    else:
        size = padded_vocab_size(shape[0], tp_size) if spec.vocab else shape[spec.dim]
        shape[spec.dim] = size // tp_size
    return tuple(shape)


def shard_tensor(
    name: str, full: torch.Tensor, config: ModelConfig, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This rank's slice of the global tensor `full` (a view where possible, never a copy of all)."""
    spec = shard_spec(name, config)
    if spec.dim is None or (tp_size == 1 and not spec.vocab):
        return full
    if spec.vocab:
        rows = padded_vocab_size(full.shape[0], tp_size) // tp_size
        start, stop = tp_rank * rows, min((tp_rank + 1) * rows, full.shape[0])
        piece = full[start:stop]
        if stop - start < rows:  # the tail rank carries the zero padding
            pad = full.new_zeros((rows - max(stop - start, 0), *full.shape[1:]))
            piece = torch.cat([piece, pad]) if stop > start else pad
        return piece
    if not spec.parts:
        return full.chunk(tp_size, dim=spec.dim)[tp_rank]
    pieces = [full.narrow(spec.dim, lo, hi - lo) for lo, hi, _ in _pieces(spec, tp_rank, tp_size)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def stored_shard(name: str, local: torch.Tensor, config: ModelConfig, tp_rank: int,
                 tp_size: int) -> torch.Tensor:
    """What tp rank `tp_rank` stores of its local shard `local` (a parameter, a gradient or a
    per-channel FP8 scale of `name`): all of it, except the replicated kv rows when an earlier
    rank of its replica group stores them. So a checkpoint holds every kv head once; gradient
    norms count each once."""
    spec = shard_spec(name, config)
    if not spec.parts or local.dim() == 0:
        return local
    pieces, offset = [], 0
    for lo, hi, owned in _pieces(spec, tp_rank, tp_size):
        if owned:
            pieces.append(local.narrow(spec.dim, offset, hi - lo))
        offset += hi - lo
    if len(pieces) == len(spec.parts):
        return local
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=spec.dim)


def stored_sources(name: str, config: ModelConfig, tp_rank: int, tp_size: int
                   ) -> list[tuple[int, int, int]] | None:
    """Where rank `tp_rank`'s local shard lies in the stored shards of the same layout, as
    `(source tp rank, first row in its stored shard, rows)` per fused part along dim 0, in
    order; None when the rank's stored shard is its whole local shard. A replicated kv head is
    read from the first rank of its replica group."""
    spec = shard_spec(name, config)
    if not spec.parts or all(owned for *_, owned in _pieces(spec, tp_rank, tp_size)):
        return None
    out = []
    for p, (lo, hi, owned) in enumerate(_pieces(spec, tp_rank, tp_size)):
        src = tp_rank if owned else tp_rank - tp_rank % (tp_size // spec.heads[p])
        start = sum(b - a for a, b, keep in _pieces(spec, src, tp_size)[:p] if keep)
        out.append((src, start, hi - lo))
    return out


def replica_rows(name: str, config: ModelConfig, tp_size: int) -> list[tuple[int, int]]:
    """Local rows `[start, stop)` of `name` that are replicated kv heads (the same rows on every
    rank; empty without replication). Each replica computes a partial gradient for them, from
    its own query heads: the gradients must be summed over the replica group."""
    spec = shard_spec(name, config)
    if not spec.parts or not spec.heads:
        return []
    out, offset = [], 0
    for (lo, hi, _), h in zip(_pieces(spec, 0, tp_size), spec.heads, strict=True):
        if h is not None and tp_size > h:
            out.append((offset, offset + hi - lo))
        offset += hi - lo
    return out


def _chunk_bounds(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """`[start, stop)` of piece `tp_rank` of `torch.chunk(size, tp_size)` (empty past the end)."""
    step = -(-size // tp_size)
    return min(tp_rank * step, size), min((tp_rank + 1) * step, size)


def shard_row_ranges(name: str, config: ModelConfig, tp_rank: int, tp_size: int,
                     rows: int | None = None, stored: bool = False) -> list[tuple[int, int, int]]:
    """Which global rows this rank holds, as `(global_start, global_stop, local_start)`.

    The row-range form of `shard_tensor` (tested against it), for streaming a tensor in row
    chunks: local rows `[local_start, local_start + global_stop - global_start)` of the shard
    are global rows `[global_start, global_stop)`. A replicated or column-split (`dim=1`) tensor
    keeps every row; a row-split one (`dim=0`) keeps one slice per fused block, in order; local
    rows no range covers are the vocabulary's zero padding. `rows` is the global row count
    (default: from `global_param_shapes`, or pass it for an FP8 scale of the weight `name`).
    With `stored=True`, the rows of the stored form (`stored_shard`), without replicated kv
    rows that an earlier rank of the replica group stores.
    """
    if rows is None:
        rows = global_param_shapes(config)[name][0]
    spec = shard_spec(name, config)
    if spec.dim != 0 or (tp_size == 1 and not spec.vocab):
        return [(0, rows, 0)] if rows else []
    if spec.vocab:
        per_rank = padded_vocab_size(rows, tp_size) // tp_size
        start, stop = tp_rank * per_rank, min((tp_rank + 1) * per_rank, rows)
        return [(start, stop, 0)] if stop > start else []
    if not spec.parts:
        lo, hi = _chunk_bounds(rows, tp_rank, tp_size)
        return [(lo, hi, 0)] if hi > lo else []
    out, local = [], 0
    for lo, hi, owned in _pieces(spec, tp_rank, tp_size):
        if hi > lo and (owned or not stored):
            out.append((lo, hi, local))
            local += hi - lo
    return out


def shard_columns(name: str, config: ModelConfig, tp_rank: int, tp_size: int, cols: int
                  ) -> tuple[int, int] | None:
    """The global columns `[start, stop)` this rank holds of a column-split (`dim=1`) tensor
    with `cols` columns; None when the columns are not split (every other tensor)."""
    if shard_spec(name, config).dim != 1 or tp_size == 1:
        return None
    return _chunk_bounds(cols, tp_rank, tp_size)


def unshard_tensors(name: str, shards: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The global tensor from the tensor-parallel shards of every rank, in rank order.

    Each shard may be the local form (`shard_tensor`) or the stored form (`stored_shard`);
    a replicated kv head is taken from the first rank of its replica group.
    """
    if is_expert_param(name) and len(shards) > 1:  # expert parallelism: see `expert_spec`
        return unshard_expert_tensors(name, shards, config)
    spec = shard_spec(name, config)
    tp_size = len(shards)
    if spec.dim is None:
        return shards[0]
    if spec.vocab:
        return torch.cat(shards, dim=0)[: config.vocab_size]
    if not spec.parts:
        return torch.cat(shards, dim=spec.dim)
    located = []  # per rank: per part, (offset in the shard, rows) or None when not there
    for r, shard in enumerate(shards):
        pieces = _pieces(spec, r, tp_size)
        local_form = shard.shape[spec.dim] == sum(hi - lo for lo, hi, _ in pieces)
        where, offset = [], 0
        for lo, hi, owned in pieces:
            held = owned or local_form
            where.append((offset, hi - lo) if owned else None)
            offset += hi - lo if held else 0
        located.append(where)
    return torch.cat([shards[r].narrow(spec.dim, *located[r][p])
                      for p in range(len(spec.parts)) for r in range(tp_size)
                      if located[r][p] is not None], dim=spec.dim)


def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """Pipeline stage indices held by pipeline rank `pp_rank`, in the order its chunks run.

    Placement `looped` (1F1B, interleaved): rank r holds stages r, r + pp, r + 2pp, ...
    Placement `v` (ZBV, DualPipeV; two chunks): rank r holds stages r and 2pp - 1 - r, so the
    first and the last stage share rank 0.
    """
    pp = layout.pp
    if layout.placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(layout.virtual_stages)]


def stage_owners(layout: Layout) -> list[int]:
    """The pipeline rank that holds each stage, indexed by stage id."""
    owners = [0] * layout.num_stages
    for p in range(layout.pp):
        for s in stage_ids(layout, p):
            owners[s] = p
    return owners


def last_stage_pp_rank(layout: Layout) -> int:
    """The pipeline rank that holds the last stage (and so computes the loss)."""
    return stage_owners(layout)[-1]


def stage_layers(stage_id: int, num_stages: int, num_layers: int) -> range:
    """The contiguous global layer indices that pipeline stage `stage_id` holds."""
    per_stage = num_layers // num_stages
    return range(stage_id * per_stage, (stage_id + 1) * per_stage)


def shard_scale(
    name: str, scale: torch.Tensor, config: ModelConfig, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This rank's part of the FP8 scale of weight `name` (see `core.fp8`).

    A per-tensor scale (shape `()`) is whole on every rank. A per-output-channel scale
    (`(out, 1)`) follows the weight's rows: split with them when the weight splits along dim 0,
    whole on every rank when it splits along dim 1 (row-parallel `wo`, `w2`) or not at all.
    """
    if scale.dim() == 0 or shard_spec(name, config).dim != 0:
        return scale
    piece = shard_tensor(name, scale, config, tp_rank, tp_size)
    return piece.masked_fill(piece == 0, 1.0)  # vocabulary padding rows: scale 1, never 0


def unshard_scales(name: str, scales: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The global FP8 scale of weight `name` from every tp rank's part, in rank order."""
    if scales[0].dim() == 0 or shard_spec(name, config).dim != 0:
        return scales[0]
    return unshard_tensors(name, scales, config)


# ----------------------------------------------------- expert parallelism
# Expert banks are split over the expert grid (ep along dim 0, then etp within each expert),
# never over tp; see the module docstring.

_EXPERT = re.compile(r"^layers\.\d+\.feed_forward\.experts\.(w1|w2)$")


def is_expert_param(name: str) -> bool:
    """Whether `name` is an expert bank (`layers.{i}.feed_forward.experts.w1` / `.w2`)."""
    return _EXPERT.match(name) is not None


def expert_global_shape(name: str, config: ModelConfig) -> tuple[int, int, int]:
    """The global shape of expert bank `name`: w1 `(E, F x (2 if gated), h)`, w2 `(E, h, F)`."""
    e, f, h = config.moe.num_experts, expert_ffn_size(config), config.hidden_size
    if name.endswith(".w1"):
        return (e, f * (2 if config.gated else 1), h)
    return (e, h, f)


def expert_spec(name: str, config: ModelConfig) -> ShardSpec:
    """How one ep rank's block of expert bank `name` is split over the etp group: w1 along
    dim 1 (`[gate; up]` halves each split on their own), w2 along dim 2."""
    if name.endswith(".w1"):
        f = expert_ffn_size(config)
        return ShardSpec(dim=1, parts=(f, f) if config.gated else None)
    return ShardSpec(dim=2)


def _etp_slice(spec: ShardSpec, block: torch.Tensor, etp_rank: int, etp_size: int
               ) -> torch.Tensor:
    if etp_size == 1:
        return block
    if not spec.parts:
        return block.chunk(etp_size, dim=spec.dim)[etp_rank]
    pieces = [block.narrow(spec.dim, lo, hi - lo) for lo, hi, _ in _pieces(spec, etp_rank,
                                                                            etp_size)]
    return torch.cat(pieces, dim=spec.dim)


def shard_expert_tensor(name: str, full: torch.Tensor, config: ModelConfig, ep_rank: int,
                        ep_size: int, etp_rank: int, etp_size: int) -> torch.Tensor:
    """Expert-grid rank `(ep_rank, etp_rank)`'s piece of the global expert bank `full`."""
    block = full.chunk(ep_size, dim=0)[ep_rank]
    return _etp_slice(expert_spec(name, config), block, etp_rank, etp_size)


def expert_local_shape(name: str, config: ModelConfig, ep_size: int, etp_size: int
                       ) -> tuple[int, ...]:
    """The shape each expert-grid rank holds of expert bank `name` (the MoE layer builds its
    parameters with it): `(E / ep, rows / etp, h)` for w1, `(E / ep, h, F / etp)` for w2.
    Counted from `expert_piece` (a first `torch.cat` on the meta device costs seconds)."""
    piece = expert_piece(name, config, 0, ep_size, 0, etp_size)
    _, _, cols = expert_global_shape(name, config)
    return (piece.experts[1] - piece.experts[0], sum(b - a for a, b, _ in piece.rows),
            cols if piece.cols is None else piece.cols[1] - piece.cols[0])


def unshard_expert_tensors(name: str, shards: list[torch.Tensor], config: ModelConfig
                           ) -> torch.Tensor:
    """The global expert bank from the pieces of every expert-grid rank, ep-major then
    etp-minor (`ep x etp` of them; ep and etp follow from the pieces' shapes). A list of whole
    copies (a replicated bank saved once per tp rank) gives the first."""
    spec = expert_spec(name, config)
    full = expert_global_shape(name, config)
    ep = full[0] // shards[0].shape[0]
    etp = full[spec.dim] // shards[0].shape[spec.dim]
    if ep * etp == 1:
        return shards[0]
    if ep * etp != len(shards):
        raise ValueError(f"{name}: {len(shards)} pieces of shape {tuple(shards[0].shape)} do "
                         f"not make an ep {ep} x etp {etp} grid of {full}")
    blocks = []
    for e in range(ep):
        part = shards[e * etp:(e + 1) * etp]
        if not spec.parts:
            blocks.append(torch.cat(part, dim=spec.dim))
            continue
        # Each piece is [its slice of gate; its slice of up]: regroup the halves.
        halves = [p.chunk(len(spec.parts), dim=spec.dim) for p in part]
        blocks.append(torch.cat([h[i] for i in range(len(spec.parts)) for h in halves],
                                dim=spec.dim))
    return torch.cat(blocks, dim=0)


class ExpertPiece(NamedTuple):
    """Where expert-grid rank `(ep_rank, etp_rank)`'s piece of an expert bank sits in the
    global bank `(E, R, C)`: the row-range form of `shard_expert_tensor`, for streaming.

    The piece `(experts[1] - experts[0], R_local, C_local)` holds global experts
    `[experts[0], experts[1])`, in order; of each expert's `(R, C)` matrix, local rows
    `[local, local + stop - start)` are global rows `[start, stop)` for each `(start, stop,
    local)` in `rows`, restricted to the global columns `[cols[0], cols[1])` (None: all)."""

    experts: tuple[int, int]
    rows: list[tuple[int, int, int]]
    cols: tuple[int, int] | None


def expert_piece(name: str, config: ModelConfig, ep_rank: int, ep_size: int, etp_rank: int,
                 etp_size: int) -> ExpertPiece:
    """`ExpertPiece` of expert bank `name` for expert-grid rank `(ep_rank, etp_rank)` of an
    `ep_size x etp_size` grid (tested against `shard_expert_tensor`)."""
    e, r, c = expert_global_shape(name, config)
    experts = _chunk_bounds(e, ep_rank, ep_size)
    spec = expert_spec(name, config)
    if etp_size == 1:
        return ExpertPiece(experts, [(0, r, 0)], None)
    if spec.dim == 2:  # w2: each expert's columns
        return ExpertPiece(experts, [(0, r, 0)], _chunk_bounds(c, etp_rank, etp_size))
    # w1 (dim 1 of the bank is the expert matrix's rows): each fused part split on its own.
    rows, local = [], 0
    bounds = [(lo, hi) for lo, hi, _ in _pieces(spec, etp_rank, etp_size)] if spec.parts else [
        _chunk_bounds(r, etp_rank, etp_size)]
    for lo, hi in bounds:
        rows.append((lo, hi, local))
        local += hi - lo
    return ExpertPiece(experts, rows, None)
