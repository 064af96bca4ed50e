"""The Hugging Face <-> Tessera contract, for any family with a mapping in `converters.hf`.

Config: `config_from_hf(config.json dict) -> ModelConfig` for the model types the registry
lists (`converters.hf.registry`); `config_to_hf(ModelConfig) -> dict` is the inverse, a
config.json that `transformers.AutoConfig` reads. Anything the Tessera model cannot compute
exactly is an error that names the field, never a silent approximation.

Weights: each family lists, per Tessera global name, the HF tensors it is made of
(`HfFamily.tensor_pairs`). Several HF tensors are stacked along dim 0 in the order listed; the
split sizes on the way back come from `sharding.shard_spec`, the one place that defines the
fused layouts; Mixture-of-Experts tensors `(E, ...)` are the experts' blocks one after the
other. Both directions are pure re-arrangements (cat, split, transpose, reshape), so HF ->
Tessera -> HF gives back bit-identical tensors, and both stream: `read(name)` is called once
per tensor, when the tensor is needed.

This module names no family: it asks the registry, which imports a family's module on first
use.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Set
from typing import Any

import torch

from tessera.converters.hf.family import ConversionError, Read, TensorPairs
from tessera.converters.hf.registry import family_of_model_type, hf_family, model_types
from tessera.core.config import ModelConfig
from tessera.core.parallel.sharding import global_param_shapes, shard_spec

__all__ = ["ConversionError", "Read", "check_exportable", "config_for_weights", "config_from_hf",
           "config_to_hf", "export_tensors", "hf_parts", "import_tensors", "tensor_pairs"]

# Old checkpoints name tensors without the base-model prefix (`h.0.ln_1.weight`).
_BASE_PREFIXES = ("transformer.", "model.")


# ---------------------------------------------------------------------------------- config


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """The Tessera `ModelConfig` of a Hugging Face `config.json` (as a dict).

    Raises:
        ConversionError: an unsupported model type, or a feature Tessera cannot compute exactly.
    """
    model_type = hf_config.get("model_type")
    family = family_of_model_type(model_type)
    if family is None:
        arch = ", ".join(hf_config.get("architectures") or []) or "unknown architecture"
        raise ConversionError(f"model_type {model_type!r} ({arch}) is not supported; supported "
                              f"model types: {', '.join(model_types())}")
    try:
        return hf_family(family).config_from_hf(hf_config)
    except KeyError as exc:
        raise ConversionError(f"{model_type} config lacks the field {exc.args[0]!r}") from None


def config_for_weights(config: ModelConfig, hf_names: Set[str]) -> ModelConfig:
    """`config` corrected by what the HF weights hold (a BERT's next-sentence head that its
    config omits); usually `config` itself."""
    return hf_family(config.family).from_weights(config, hf_names)


def check_exportable(config: ModelConfig) -> None:
    """Raise ConversionError when no Hugging Face model computes what `config` does."""
    hf_family(config.family).check_exportable(config)


def config_to_hf(config: ModelConfig, *, dtype: str = "float32",
                 bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None) -> dict[str, Any]:
    """The `config.json` contents of `config` for transformers (v5, and v4 via legacy keys)."""
    family = hf_family(config.family)
    family.check_exportable(config)
    return family.config_to_hf(config, dtype=dtype, bos_token_id=bos_token_id,
                               eos_token_id=eos_token_id, pad_token_id=pad_token_id)


# --------------------------------------------------------------------------------- tensors


def tensor_pairs(config: ModelConfig, hf_names: Set[str] | None = None) -> TensorPairs:
    """(Tessera global name, [(HF name, transposed?), ...]) in `global_param_shapes` order;
    `hf_names`, the names in the HF files on import, choose between on-disk layouts (MoE
    experts one by one or fused)."""
    return hf_family(config.family).tensor_pairs(config, hf_names)


def _resolve(hf_name: str, hf_names: set[str]) -> str | None:
    if hf_name in hf_names:
        return hf_name
    for prefix in _BASE_PREFIXES:
        if hf_name.startswith(prefix) and hf_name[len(prefix):] in hf_names:
            return hf_name[len(prefix):]
    return None


def import_tensors(config: ModelConfig, read: Read,
                   hf_names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(Tessera global name, tensor)` in `global_param_shapes` order from HF tensors.

    Every name is checked before the first tensor is read: a missing HF tensor, or one this
    map does not know (other than the family's buffers, such as GPT-2's `attn.bias`, and tied
    copies), raises ConversionError. Names without the base-model prefix (old GPT-2 files:
    `h.0.ln_1.weight`) are accepted.
    """
    family = hf_family(config.family)
    plan: list[tuple[str, list[tuple[str, bool]]]] = []
    used: set[str] = set()
    for name, sources in family.tensor_pairs(config, hf_names):
        resolved = []
        for hf_name, transposed in sources:
            found = _resolve(hf_name, hf_names)
            if found is None:
                raise ConversionError(f"the Hugging Face weights lack {hf_name} (needed for "
                                      f"Tessera's {name})")
            resolved.append((found, transposed))
            used.add(found)
        plan.append((name, resolved))
    ignored = re.compile(family.ignored) if family.ignored else None
    unknown = sorted(n for n in hf_names - used - family.unread(config)
                     if ignored is None or not ignored.search(n))
    if unknown:
        raise ConversionError(f"the Hugging Face weights hold tensors the {config.family} map "
                              f"does not know: {unknown[:6]}; refusing a partial conversion")
    shapes = global_param_shapes(config)
    for name, sources in plan:
        parts = [read(n).t().contiguous() if transposed else read(n) for n, transposed in sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if len(shapes[name]) == 3 and tensor.dim() == 2:  # MoE experts, one after the other
            tensor = tensor.reshape(-1, *shapes[name][1:])
        if tuple(tensor.shape) != shapes[name]:
            raise ConversionError(f"{[n for n, _ in sources]} give shape {tuple(tensor.shape)} "
                                  f"for {name}; the config implies {shapes[name]}")
        yield name, tensor


def export_tensors(config: ModelConfig, read: Read) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(HF name, tensor)` from Tessera global tensors `read(name)`; the inverse of
    `import_tensors`. `lm_head.weight` is absent when the embeddings are tied, as transformers
    expects. Tensors may be views of the one read; they are contiguous."""
    check_exportable(config)
    for name, targets in tensor_pairs(config):
        yield from hf_parts(config, name, read(name), targets)


def hf_parts(config: ModelConfig, name: str, tensor: torch.Tensor,
             targets: list[tuple[str, bool]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`(HF name, tensor)` of each HF tensor the Tessera global `tensor` `name` is made of
    (`targets` from `tensor_pairs`): fused blocks split, transposed weights transposed."""
    parts = (tensor,)
    if tensor.dim() == 3 and len(targets) > 1:  # MoE experts: equal blocks, expert by expert
        parts = tensor.reshape(-1, tensor.shape[-1]).chunk(len(targets), dim=0)
    elif len(targets) > 1:  # fused blocks: their sizes live in the sharding rules
        parts = tensor.split(list(shard_spec(name, config).parts), dim=0)
    for (hf_name, transposed), part in zip(targets, parts, strict=True):
        yield hf_name, part.t().contiguous() if transposed else part.contiguous()
