"""LoRA adapters between Tessera (`core.lora_format`) and Hugging Face `peft`, both ways.

`export_peft` writes a Tessera adapter as a PEFT LoRA directory that
`peft.PeftModel.from_pretrained(model, DIR)` loads on the Hugging Face export of the same base
(`tessera convert --to hf`); `import_peft` reads a LoRA adapter trained with `peft` on that HF
model into a Tessera adapter directory for a given Tessera base checkpoint.

Invariants: peft's model computes what Tessera's merged model computes (fused modules split
onto HF's, scales carried by `rank_pattern` / `alpha_pattern`); an imported adapter exports back
with its original modules and ranks; what has no Tessera equivalent, or factors that do not fit
the base, are refused with the reason; `peft` is never imported; outputs are atomic.

How modules, scales and dropout map, and what is refused: docs/guides/converting.md, "How the
PEFT mapping works".
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tessera.converters.hf.registry import hf_family, mapped_families
from tessera.converters.hf_mapping import ConversionError, config_to_hf
from tessera.core.checkpoint import atomic_directory, read_manifest
from tessera.core.config import ModelConfig
from tessera.core.files import save_safetensors
from tessera.core.fingerprint import base_fingerprint
from tessera.core.lora import MLA_PROJECTIONS, adaptable_modules
from tessera.core.lora_format import CONFIG_FILE as ADAPTER_CONFIG
from tessera.core.lora_format import (
    AdapterConfig,
    check_base,
    load_adapter,
    lora_names,
    save_adapter,
)
from tessera.core.parallel.sharding import global_param_shapes, shard_spec

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_WEIGHTS_BIN = "adapter_model.bin"  # older peft versions
FINGERPRINT_KEY = "tessera_base_fingerprint"  # safetensors metadata of an exported adapter
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF *ForCausalLM
LORA_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                *MLA_PROJECTIONS)
_LAYER_MODULE = re.compile(r"^layers\.(\d+)\.(.+)$")
_KEY = re.compile(r"^(?P<module>.+)\.(?P<factor>lora_A|lora_B)\.weight$")

# PEFT config fields that change what the adapter computes in ways a Tessera LoRA cannot.
# Each maps to its harmless value(s) and the reason it is refused otherwise.
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_dora": ((False, None), "DoRA adds a learned magnitude per output"),
    "bias": (("none", None), "LoRA-trained biases have no place in a Tessera adapter"),
    "lora_bias": ((False, None), "a bias on lora_B has no place in a Tessera adapter"),
    "modules_to_save": ((None, []), "fully trained modules are not LoRA factors"),
    "trainable_token_indices": ((None, [], {}), "trained token embeddings are not LoRA factors"),
    "layer_replication": ((None, []), "replicated layers change the base model"),
    "target_parameters": ((None, []), "LoRA on raw parameters (e.g. MoE experts) is not mapped"),
    "alora_invocation_tokens": ((None, []), "activated LoRA depends on the prompt's tokens"),
    "use_qalora": ((False, None), "QA-LoRA pools the input, unlike a plain LoRA"),
    "use_bdlora": ((None, False, {}), "block-diagonal LoRA is another product"),
    "arrow_config": ((None, {}), "Arrow routing mixes several adapters"),
    "kasa_config": ((None, {}), "KaSA is another product"),
    "velora_config": ((None, {}), "VeLoRA changes the backward pass it was trained with"),
    "monteclora_config": ((None, {}), "MonteCLoRA samples its factors"),
}
# Initializations that rewrite the base weights (an adapter saved without converting it back
# only works on that rewritten base).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class PeftLoraError(ConversionError):
    """A LoRA adapter that cannot be converted as asked; the message says why and what to do."""


# --------------------------------------------------------------------------------- mapping


def _linear_map(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Tessera linear leaf (`attention.wqkv`) -> its HF module leaves under one layer, in the
    order the base map stacks them along the rows (`model.layers.{}.self_attn.q_proj`, ...)."""
    try:
        names = hf_family(config.family).name_map
    except ConversionError as exc:
        raise PeftLoraError(str(exc)) from None
    if names is None:
        with_maps = [f for f in mapped_families() if hf_family(f).name_map is not None]
        raise PeftLoraError(f"family {config.family!r} has no per-layer Hugging Face name map "
                            f"for LoRA; families with one: {', '.join(with_maps)}")
    return {leaf: tuple(n.removesuffix(".weight") for n in names[f"layers.{{}}.{leaf}.weight"])
            for leaf in LORA_LINEARS if f"layers.{{}}.{leaf}.weight" in names}


def hf_modules(config: ModelConfig, module: str) -> list[tuple[str, int]]:
    """The HF modules (full names in the *ForCausalLM) that Tessera `module` is made of, with
    the number of B's rows each takes, in row order."""
    m = _LAYER_MODULE.match(module)
    if not m or m.group(2) not in LORA_LINEARS or int(m.group(1)) >= config.num_layers:
        raise PeftLoraError(f"{module} is not a linear layer of this {config.num_layers}-layer "
                            f"model; LoRA modules are layers.N.{{{','.join(LORA_LINEARS)}}}")
    if module not in adaptable_modules(config):  # an MoE layer's w1 / w2: grouped experts
        raise PeftLoraError(f"{module} is a Mixture-of-Experts layer's expert weight, which "
                            "LoRA does not adapt in Tessera; only that layer's attention maps")
    layer, leaf = m.groups()
    targets = _linear_map(config)[leaf]
    parts = shard_spec(f"{module}.weight", config).parts
    rows = list(parts) if len(targets) > 1 else [global_param_shapes(config)[f"{module}.weight"][0]]
    return [(t.format(layer), r) for t, r in zip(targets, rows, strict=True)]


def _hf_index(config: ModelConfig) -> dict[str, tuple[str, int]]:
    """HF module -> (Tessera module, its part index) for every module LoRA may adapt."""
    index = {}
    for module in adaptable_modules(config):  # MoE layers' experts are not LoRA modules
        for part, (name, _) in enumerate(hf_modules(config, module)):
            index[name] = (module, part)
    return index


def _target_names(config: ModelConfig, modules: list[str]) -> list[str]:
    """PEFT `target_modules` matching exactly `modules` (HF names): the short leaf names (with
    their parent where a leaf alone is ambiguous, GPT-2's `attn.c_proj` / `mlp.c_proj`) when
    every layer has the same set, else the full names."""
    patterns = [t for ts in _linear_map(config).values() for t in ts]
    last = [p.rsplit(".", 1)[-1] for p in patterns]
    short = {p: (leaf if last.count(leaf) == 1 else ".".join(p.rsplit(".", 2)[-2:]))
             for p, leaf in zip(patterns, last, strict=True)}
    by_pattern: dict[str, set[str]] = {}
    for p in patterns:
        names = {p.format(i) for i in range(config.num_layers)}
        if names & set(modules):
            by_pattern[p] = names
    if set().union(*by_pattern.values()) == set(modules):
        return sorted(short[p] for p in by_pattern)
    return sorted(modules)


# ---------------------------------------------------------------------------------- export


def _nonzero_columns(b: torch.Tensor) -> torch.Tensor:
    """B's columns that are not all zero (all of them if none is): a fused module imported
    from separate PEFT modules has zero blocks outside each part's own rank columns."""
    keep = (b != 0).any(dim=0).nonzero().flatten()
    return keep if keep.numel() else torch.arange(b.shape[1])


def _check_fits(config: ModelConfig, module: str, a: torch.Tensor, b: torch.Tensor,
                where: str) -> None:
    out_f, in_f = global_param_shapes(config)[f"{module}.weight"]
    if a.shape[1] != in_f or b.shape[0] != out_f:
        raise PeftLoraError(
            f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but the "
            f"base's {module}.weight is ({out_f}, {in_f}); this adapter was made for another "
            "model")


def export_peft(adapter_dir: str | os.PathLike, base_checkpoint: str | os.PathLike,
                out_dir: str | os.PathLike, *, hf_model: str | None = None,
                overwrite: bool = False) -> Path:
    """Write the Tessera adapter at `adapter_dir` (tuned on `base_checkpoint`) as a PEFT LoRA
    directory `out_dir` for the Hugging Face export of that base; `hf_model` fills
    `base_model_name_or_path` (the HF export's path or hub id). Atomic; returns `out_dir`.

    Raises:
        AdapterError: the adapter is damaged or was tuned on another base.
        PeftLoraError: the base has no HF mapping, or the adapter does not fit it.
    """
    adapter, tensors = load_adapter(adapter_dir)
    fingerprint = base_fingerprint(base_checkpoint)
    check_base(adapter, fingerprint, base_checkpoint)
    config = read_manifest(base_checkpoint).model
    try:
        config_to_hf(config)  # a base with no HF equivalent has no PEFT adapter either
    except ConversionError as exc:
        raise PeftLoraError(str(exc)) from None
    out: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    for module in adapter.modules:
        a, b = (tensors[n] for n in lora_names(module))
        _check_fits(config, module, a, b, str(adapter_dir))
        layout = hf_modules(config, module)
        whole = bool(b.count_nonzero())
        for name, part in zip((n for n, _ in layout), b.split([r for _, r in layout]),
                              strict=True):
            if whole and not part.count_nonzero():
                continue  # a part the adapter leaves alone (imported from q/v-only LoRA)
            keep = _nonzero_columns(part)
            out[f"{PREFIX}{name}.lora_A.weight"] = a[keep].contiguous()
            out[f"{PREFIX}{name}.lora_B.weight"] = part[:, keep].contiguous()
            ranks[name] = int(keep.numel())
    # Full module names as pattern keys: peft matches `(.*\.)?(KEY)$`, so each hits one module.
    rank_pattern = {n: r for n, r in ranks.items() if r != adapter.rank}
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": hf_model,
        "r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": adapter.dropout,
        "target_modules": _target_names(config, list(ranks)),
        "rank_pattern": rank_pattern,
        "alpha_pattern": {n: adapter.scaling * r for n, r in rank_pattern.items()},
        "fan_in_fan_out": hf_family(config.family).fan_in_fan_out,  # Conv1D; peft sets it too
        "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "layers_to_transform": None,
        "layers_pattern": None, "exclude_modules": None, "revision": None,
    }
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        save_safetensors(out, str(tmp / PEFT_WEIGHTS),
                         metadata={"format": "pt", FINGERPRINT_KEY: fingerprint})
        (tmp / PEFT_CONFIG).write_text(json.dumps(peft_config, indent=2) + "\n")
    return Path(out_dir)


# ---------------------------------------------------------------------------------- import


def _read_peft(peft_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], str | None]:
    """The adapter config, its tensors, and the Tessera base fingerprint if we exported it."""
    file = peft_dir / PEFT_CONFIG
    if not file.is_file():
        raise PeftLoraError(f"{peft_dir} is not a PEFT adapter directory ({PEFT_CONFIG} is "
                            "missing); save one with `peft_model.save_pretrained(DIR)`")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise PeftLoraError(f"{file} is not valid JSON ({exc})") from exc
    fingerprint = None
    if (peft_dir / PEFT_WEIGHTS).is_file():
        with safe_open(str(peft_dir / PEFT_WEIGHTS), "pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
            fingerprint = (fh.metadata() or {}).get(FINGERPRINT_KEY)
    elif (peft_dir / PEFT_WEIGHTS_BIN).is_file():
        tensors = torch.load(peft_dir / PEFT_WEIGHTS_BIN, map_location="cpu", weights_only=True)
    else:
        raise PeftLoraError(f"{peft_dir} has no adapter weights ({PEFT_WEIGHTS} or "
                            f"{PEFT_WEIGHTS_BIN})")
    return cfg, tensors, fingerprint


def _check_supported(cfg: dict[str, Any], where: Path) -> None:
    if cfg.get("peft_type") != "LORA":
        raise PeftLoraError(f"{where} is a {cfg.get('peft_type')} adapter; only LoRA adapters "
                            "import here (prompt tuning: `tessera tune --import-peft`)")
    for key, (allowed, why) in _UNSUPPORTED.items():
        if cfg.get(key) not in allowed:
            raise PeftLoraError(f"{where}: {key}={cfg[key]!r} cannot be represented as a "
                                f"Tessera LoRA adapter ({why}); train the adapter without it")
    init = str(cfg.get("init_lora_weights", True)).lower()
    if init.startswith(_BASE_CHANGING_INITS):
        raise PeftLoraError(f"{where}: init_lora_weights={cfg['init_lora_weights']!r} rewrites "
                            "the base weights, so the adapter fits only that rewritten base; save "
                            "it with `save_pretrained(..., path_initial_model_for_weight_conversion"
                            "=...)` to get a plain LoRA of the original base")


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """peft's own lookup (`get_pattern_key`): the first key matching `(.*\\.)?(KEY)$`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _peft_factors(tensors: dict[str, torch.Tensor],
                  where: Path) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF module name, A, B) per adapted module; any other tensor is refused."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key.removeprefix(PREFIX))
        if not m:
            raise PeftLoraError(f"{where}: tensor {key} is not a LoRA factor of a linear layer "
                                "(embedding LoRA, DoRA magnitudes, biases or saved modules "
                                "cannot be represented as a Tessera LoRA adapter)")
        factors.setdefault(m["module"], {})[m["factor"]] = tensor
    for module, pair in sorted(factors.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise PeftLoraError(f"{where}: {module} has {sorted(pair)} but not both lora_A and "
                                "lora_B; the adapter is incomplete")
        yield module, pair["lora_A"].float(), pair["lora_B"].float()


def import_peft(peft_dir: str | os.PathLike, base_checkpoint: str | os.PathLike,
                out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Convert the PEFT LoRA adapter at `peft_dir`, trained on the Hugging Face export of the
    Tessera checkpoint `base_checkpoint`, into a Tessera adapter directory `out_dir` (with that
    base's fingerprint). Atomic; returns `out_dir`.

    Raises:
        PeftLoraError: a PEFT feature a Tessera adapter cannot represent, a module with no
            Tessera equivalent, or factors whose shapes do not fit the base.
    """
    adapter, out = peft_to_tessera(peft_dir, base_checkpoint)
    return save_adapter(out_dir, adapter, out, overwrite=overwrite)


def peft_to_tessera(peft_dir: str | os.PathLike, base_checkpoint: str | os.PathLike
                    ) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """What `import_peft` writes, in memory: the Tessera adapter config (with the base's
    fingerprint) and its global fp32 factors. `tessera serve` loads PEFT directories so."""
    peft_dir = Path(peft_dir)
    cfg, tensors, exported_from = _read_peft(peft_dir)
    _check_supported(cfg, peft_dir)
    config = read_manifest(base_checkpoint).model
    fingerprint = base_fingerprint(base_checkpoint)
    if exported_from is not None and exported_from != fingerprint:
        raise PeftLoraError(
            f"{peft_dir} was exported by Tessera from an adapter of another base (fingerprint "
            f"{exported_from[:12]}), not {base_checkpoint} (fingerprint {fingerprint[:12]}); an "
            "adapter only works on the model it was tuned on")
    index = _hf_index(config)
    r, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora"))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    scale = alpha / (math.sqrt(r) if rslora else r)  # PEFT's scale of a module with no pattern
    parts: dict[str, dict[int, tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for name, a, b in _peft_factors(tensors, peft_dir):
        if name not in index:
            raise PeftLoraError(
                f"{peft_dir}: {name} has no Tessera LoRA equivalent in this "
                f"{config.num_layers}-layer {config.family} model (LoRA maps onto the attention "
                "and MLP linear layers only; embeddings, lm_head and norms are not adapted)")
        r_m = int(_pattern_value(rank_pattern, name, r))
        if a.shape[0] != r_m or b.shape[1] != r_m:
            raise PeftLoraError(f"{peft_dir}: {name} has lora_A {tuple(a.shape)} and lora_B "
                                f"{tuple(b.shape)}, but its rank is {r_m} by the config")
        s_m = float(_pattern_value(alpha_pattern, name, alpha)) / (
            math.sqrt(r_m) if rslora else r_m)
        module, part = index[name]
        parts.setdefault(module, {})[part] = (r_m, a, b * (s_m / scale))  # one scale: fold
    if not parts:
        raise PeftLoraError(f"{peft_dir}: the adapter holds no LoRA factors")
    out: dict[str, torch.Tensor] = {}
    for module, got in parts.items():
        layout = hf_modules(config, module)
        out_f, in_f = global_param_shapes(config)[f"{module}.weight"]
        rank = sum(r_m for r_m, _, _ in got.values())
        a_full, b_full = torch.zeros(rank, in_f), torch.zeros(out_f, rank)
        row = col = 0
        for part, (name, rows) in enumerate(layout):
            if part in got:
                r_m, a, b = got[part]
                if a.shape[1] != in_f or b.shape[0] != rows:
                    raise PeftLoraError(
                        f"{peft_dir}: {name} has lora_A {tuple(a.shape)} and lora_B "
                        f"{tuple(b.shape)}, but in the base {base_checkpoint} that module is "
                        f"({rows}, {in_f}); this adapter was trained on another model")
                a_full[col:col + r_m] = a
                b_full[row:row + rows, col:col + r_m] = b
                col += r_m
            row += rows
        out[lora_names(module)[0]], out[lora_names(module)[1]] = a_full, b_full
    order = [n.removesuffix(".weight") for n in global_param_shapes(config)]
    modules = tuple(m for m in order if m in parts)
    targets = tuple(sorted({m.rsplit(".", 1)[-1] for m in modules}))
    adapter = AdapterConfig(rank=r, alpha=scale * r, modules=modules, targets=targets,
                            dropout=float(cfg.get("lora_dropout") or 0.0),
                            base_checkpoint=str(base_checkpoint),
                            base_fingerprint=fingerprint)
    return adapter, out


def read_any_adapter(directory: str | os.PathLike, base_checkpoint: str | os.PathLike
                     ) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """A Tessera adapter directory (checked against `base_checkpoint`'s fingerprint) or a PEFT
    one (converted for that base, as `import_peft` does): the config and global factors."""
    directory = Path(directory)
    if (directory / PEFT_CONFIG).is_file() and not (directory / ADAPTER_CONFIG).is_file():
        return peft_to_tessera(directory, base_checkpoint)
    adapter, tensors = load_adapter(directory)
    check_base(adapter, base_fingerprint(base_checkpoint), base_checkpoint)
    return adapter, tensors
