"""`Family`: what a model family gives the generic code (configs, sharding, init, pipeline,
checkpoints, training), so that code never names a family.

A family module (the target of its registry line, `core.models.registry`) must import without
torch: `ModelConfig` validation resolves the family, and `--help` and planning stay torch-free.
So the fields that need torch name their function by import path with `Lazy`, imported on
first call. This module imports nothing from tessera: `core.config` asks the registry, which
returns a `Family`, so `config` below means a `core.config.ModelConfig` and `layout` a
`Layout`, untyped here to keep that one-way.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


def import_named(path: str) -> Any:
    """The object `"package.module:attribute"` names, importing its module (every registry
    line here and in the upper layers' registries is such a path)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


class Lazy:
    """A callable named `"package.module:attribute"`, imported on first use."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._target: Any = None

    def resolve(self) -> Any:
        """The named object (imported once)."""
        if self._target is None:
            self._target = import_named(self.path)
        return self._target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Lazy({self.path!r})"


def no_problems(config: Any) -> list[str]:
    """A family that takes any `ModelConfig` its generic checks accept."""
    return []


def stage_layers_even(config: Any, stage_id: int, num_stages: int) -> tuple[range, ...]:
    """One stack of `num_layers` layers cut into `num_stages` equal contiguous blocks."""
    per_stage = config.num_layers // num_stages
    return (range(stage_id * per_stage, (stage_id + 1) * per_stage),)


@dataclass(frozen=True)
class Family:
    """One model family, as the generic code sees it. `config` is always a `ModelConfig` whose
    `family` is `name`; global parameter names are the checkpoint's (layout-independent).

    Required:
    - `name`: the `ModelConfig.family` value (saved in checkpoint manifests; never renamed).
    - `stage_class`: the `nn.Module` class of one pipeline stage (`Lazy`). Every stage has the
      attributes of `core.stage.init_stage` and `global_name(local_name)`, and its forward with
      labels returns the mean loss of its batch.
    - `param_shapes(config)`: every global parameter name and its unsharded shape, in module
      order (`core.parallel.sharding.global_param_shapes` asks this).
    - `shard_spec(name, config)`: the `ShardSpec` of one of its global names over the tp group
      (LoRA factors are derived from their base weight's by `sharding.shard_spec` itself).
    - `init_tensor(name, config, seed, device)`: the fp32 global initial value of `name` for run
      seed `seed`, the same under every layout (`core.init`).

    With defaults (a decoder-style family states only what differs):
    - `build_stage(config, layout, groups, stage_id, num_stages, schedule)`: stage `stage_id`
      of `num_stages` for this rank, unmaterialized (called on the meta device); None: the
      `stage_class` constructor. The pipeline builds stages only through this (`stage`).
    - `stage_layers(config, stage_id, num_stages)`: the global layer indices of each layer stack
      (one range per stack: decoder 1, encoder-decoder 2) that stage `stage_id` holds.
    - `problems(config)`: what this family cannot take in a `ModelConfig`, each a message that
      names the field and what to do (raised by `ModelConfig.__post_init__`).
    - `layout_problems(config, layout)`: how `layout`'s stages cannot split this model
      (`Layout.problems`); None: `num_layers` must divide over the stages (`stage_layers_even`).
    - `objective`: the name of its pretraining objective (`training.objectives.OBJECTIVES`);
      core never imports training, so it is a name.
    - `traits`: the `ModelConfig` values this family fixes (e.g. Llama: RMSNorm, SwiGLU, RoPE);
      what a converter checks before writing a config as this family.
    - `norm`: the decoder's norm module class, built as `norm(config, sequence_parallel)` for
      every norm of a decoder stage (`Lazy`); None: `core.models.decoder.model.Norm`.
    - `norm_shapes(config)`: local name -> shape of the parameters of one such norm (e.g.
      `{"weight": (hidden,)}`), matching `norm`; None: the decoder's (weight, and a bias unless
      RMSNorm).
    - `options`: the dataclass of what only this family's configs say (`ModelConfig.options`,
      e.g. `T5Options`), built with its defaults when a config gives none; None: the family has
      no options. It must import without torch, like the family module.
    - `lora_modules(config)`: every linear module name LoRA may adapt, in model order
      (`core.lora.adaptable_modules`); None: each decoder block's qkv, wo, w1 and w2.
    - `transformer_engine`: whether `build_model(backend="auto" | "te")` may swap its linears
      for Transformer Engine's.
    - `longrope_reencodes`: whether a generation re-encodes its whole sequence once on first
      passing longrope's original length (transformers' Phi-3 generate; `core.rope_scaling
      .recompute_at`).
    """

    name: str
    stage_class: Lazy
    param_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    shard_spec: Callable[[str, Any], Any]
    init_tensor: Callable[..., Any]
    build_stage: Callable[..., Any] | None = None
    stage_layers: Callable[[Any, int, int], tuple[range, ...]] = stage_layers_even
    problems: Callable[[Any], list[str]] = no_problems
    layout_problems: Callable[[Any, Any], list[str]] | None = None
    objective: str = "causal-lm"
    traits: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    norm: Lazy | None = None
    norm_shapes: Callable[[Any], dict[str, tuple[int, ...]]] | None = None
    lora_modules: Callable[[Any], list[str]] | None = None
    transformer_engine: bool = True
    options: type | None = None
    longrope_reencodes: bool = False

    def stage(self, config: Any, layout: Any = None, groups: Any = None, stage_id: int = 0,
              num_stages: int = 1, schedule: Any = None) -> Any:
        """Stage `stage_id` of `num_stages` (`build_stage`, or the `stage_class` constructor)."""
        build = self.build_stage or self.stage_class
        return build(config, layout, groups, stage_id, num_stages, schedule)
