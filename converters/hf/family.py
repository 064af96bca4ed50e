"""What a model family's Hugging Face mapping provides (`HfFamily`), and the helpers the family
modules share. Family-neutral: it imports no family module.

Weights are described by a name map, Tessera global name (with `{}` for the layer index) -> the
HF tensors it is made of, stacked along dim 0 in the order listed. Names listed in `transposed`
are stored `(in, out)` by Hugging Face and transposed on the way in and out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass
from typing import Any

import torch

from tessera.core.config import ModelConfig
from tessera.core.models.registry import family as core_family
from tessera.core.parallel.sharding import global_param_shapes

Read = Callable[[str], torch.Tensor]
NameMap = dict[str, tuple[str, ...]]
TensorPairs = Iterator[tuple[str, list[tuple[str, bool]]]]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


class ConversionError(ValueError):
    """A model that cannot be converted as asked; the message names the field or tensor."""


def require(hf: dict[str, Any], key: str, allowed: tuple[Any, ...], default: Any) -> Any:
    """`hf[key]` (or `default`), which must be one of `allowed`; else ConversionError."""
    value = hf.get(key, default)
    if value not in allowed:
        raise ConversionError(f"{hf.get('model_type')} config: {key}={value!r} is not supported "
                              f"(supported: {', '.join(map(repr, allowed))})")
    return value


def check_traits(config: ModelConfig, clash: dict[str, Any] | None = None) -> None:
    """Raise ConversionError when `config` differs from its family's `traits` (the values the
    family fixes, `core.models.family.Family`: what its HF model computes) or `clash` (further
    differences the caller found) is not empty."""
    traits = dict(core_family(config).traits)
    clash = {**{k: getattr(config, k) for k, v in traits.items() if getattr(config, k) != v},
             **(clash or {})}
    if clash:
        raise ConversionError(f"this {config.family} model cannot be written as a Hugging Face "
                              f"{config.family} model: {clash} differ from what it computes "
                              f"({traits})")


def with_shared_fields(fields: dict[str, Any], config: ModelConfig, *, dtype: str,
                       bos_token_id: int | None, eos_token_id: int | list[int] | None,
                       pad_token_id: int | None) -> dict[str, Any]:
    """`fields` plus the `config.json` keys the decoder families and BERT write alike
    (initialization, tying, special tokens, dtype)."""
    return {**fields, "initializer_range": config.init_std,
            "tie_word_embeddings": config.tied_embeddings, "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
            "dtype": dtype, "torch_dtype": dtype}  # `dtype` is v5's name, `torch_dtype` v4's


def layer_pattern(name: str) -> tuple[str, str]:
    """(name with `{}` for the layer index, the layer index or "")."""
    m = _LAYER.match(name)
    return (f"layers.{{}}.{m.group(2)}", m.group(1)) if m else (name, "")


def mapped_pairs(config: ModelConfig, names: NameMap, transposed: Set[str] = frozenset(),
                 expand: Callable[[tuple[str, ...]], list[str]] = list) -> TensorPairs:
    """(Tessera global name, [(HF name, transposed?), ...]) in `global_param_shapes` order from
    a name map; `expand` turns one entry's HF names into the list stacked (default: as is)."""
    for name in global_param_shapes(config):
        pattern, layer = layer_pattern(name)
        if pattern not in names:
            raise ConversionError(f"no Hugging Face name for {name} in the {config.family} map")
        yield name, [(p.format(layer), p in transposed) for p in expand(names[pattern])]


def _tied_head(config: ModelConfig) -> set[str]:
    return {"lm_head.weight"} if config.tied_embeddings else set()  # a stored tied copy


def _as_is(config: ModelConfig, hf_names: Set[str]) -> ModelConfig:
    return config


@dataclass(frozen=True)
class HfFamily:
    """One family's Hugging Face mapping.

    - `family`: the core family (`ModelConfig.family`) it maps, its registry key;
    - `config_from_hf(config.json dict) -> ModelConfig`: raises ConversionError (or KeyError
      for a missing field) for anything the Tessera model cannot compute exactly;
    - `check_exportable(config)`: raises ConversionError when no HF model of the family
      computes what `config` does;
    - `config_to_hf(config, dtype=, bos_token_id=, eos_token_id=, pad_token_id=)`: the whole
      `config.json`, for a config that passed `check_exportable`;
    - `name_map`: the weights as a name map (None when `pairs` lists them instead), with
      `transposed` HF names; `pairs(config, hf_names)` overrides the name map's listing, where
      `hf_names` are the HF files' tensor names on import (None on export);
    - `unread(config)`: HF tensors an import may find and leaves unread (tied copies);
      `ignored`: a regex of HF entries that are buffers, not weights;
    - `from_weights(config, hf_names)`: the config corrected by what the weights hold;
    - `fan_in_fan_out`: the HF linears are `Conv1D` (PEFT's flag);
    - `fp8_export`: the FP8 loaders quantize the HF linears; else `fp8_refusal` says why not.
    """

    family: str
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    check_exportable: Callable[[ModelConfig], None]
    config_to_hf: Callable[..., dict[str, Any]]
    name_map: NameMap | None = None
    transposed: frozenset[str] = frozenset()
    pairs: Callable[[ModelConfig, Set[str] | None], TensorPairs] | None = None
    unread: Callable[[ModelConfig], set[str]] = _tied_head
    ignored: str = ""
    from_weights: Callable[[ModelConfig, Set[str]], ModelConfig] = _as_is
    fan_in_fan_out: bool = False
    fp8_export: bool = False
    fp8_refusal: str = ("the FP8 loaders of transformers and vLLM do not quantize its Hugging "
                        "Face model")

    def tensor_pairs(self, config: ModelConfig, hf_names: Set[str] | None = None) -> TensorPairs:
        """(Tessera global name, [(HF name, transposed?), ...]) in `global_param_shapes` order."""
        if self.pairs is not None:
            return self.pairs(config, hf_names)
        assert self.name_map is not None, f"{self.family}: neither a name map nor pairs"
        return mapped_pairs(config, self.name_map, self.transposed)
