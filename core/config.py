"""Typed configs for the model, its parallel layout and the training step, with named presets.

`ModelConfig` describes the global (unsharded) network; `Layout` describes where its weights live
over ranks (saved in every checkpoint manifest, `to_dict` / `from_dict`); `TrainSchedule` describes
how a training step runs on a layout. All are validated up front with messages that name the
numbers and the fix. This module imports nothing from `core.parallel`: the schedule checks that
need the schedule names live in `core.parallel.pipeline`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from tessera.core.errors import ConfigError
from tessera.core.expert_config import expert_layout_problems
from tessera.core.flat_model_fields import FLAT_MOE, FLAT_OPTIONS, as_dict, nest_flat_fields
from tessera.core.mla_config import MLAConfig, mla_problems
from tessera.core.models.registry import family as model_family
from tessera.core.moe.config import MoEConfig
from tessera.core.rope_config import RopeScaling, rope_scaling_problems

Norm = Literal["layernorm", "rmsnorm", "layernorm1p", "rmsnorm1p"]
Activation = Literal["gelu", "gelu_tanh", "swiglu", "squared_relu", "geglu", "relu"]
Position = Literal["learned", "rope", "relative"]
Recompute = Literal["none", "selective", "full"]


@dataclass
class ModelConfig:
    """The global shape of a model of one family (`core.models.registry`): the fields every
    family reads, the decoder's Mixture-of-Experts options (`moe`) and the family's own
    (`options`). Defaults describe a tiny Llama-style model."""

    name: str = "custom"
    family: str = "llama"  # a `core.models.registry` name: gpt2|llama|...|t5|bert
    vocab_size: int = 512  # the true vocabulary; TP padding is a layout detail, never saved
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None  # None: same as num_heads (no grouped-query attention)
    head_dim: int | None = None  # None: hidden_size // num_heads
    ffn_hidden_size: int = 256
    max_position_embeddings: int = 256
    norm: Norm = "rmsnorm"
    norm_eps: float = 1e-5
    activation: Activation = "swiglu"
    position: Position = "rope"
    rope_theta: float = 10000.0
    rotary_fraction: float = 1.0  # share of each head's dims that rotate (Nemotron: 0.5)
    # The RoPE variant (llama3, linear, dynamic, yarn, longrope) and its fields (core.rope_config).
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bias: bool = False  # biases on the linear layers (norms of layernorm kind always have one)
    # Biases on the fused q/k/v projection alone (Qwen2): None means the same as `bias`.
    qkv_bias: bool | None = None
    tied_embeddings: bool = False  # output projection shares the token embedding
    dropout: float = 0.0  # hidden and attention dropout
    init_std: float = 0.02
    # Qwen3 (`core.qk_norm`): an RMSNorm (eps norm_eps) over each head's dims of q and
    # k, after the projection and before RoPE; weights `attention.{q,k}_norm.weight (head_dim,)`.
    qk_norm: bool = False
    # What the q/k norm spans: "head" (each head's dims, Qwen3) or "projection" (the whole q
    # and k projections, OLMo-2; weights `(num_heads * head_dim,)` / `(num_kv_heads * head_dim,)`).
    qk_norm_width: Literal["head", "projection"] = "head"
    # Where each layer's norms sit: "input" normalizes a sublayer's input (pre-norm,
    # `x + f(norm(x))`); "output" its output before the residual add (OLMo-2, `x + norm(f(x))`);
    # "sandwich" both, with two more norms per layer (Gemma 2, `x + norm2(f(norm1(x)))`).
    norm_placement: Literal["input", "output", "sandwich"] = "input"
    # Sliding-window attention (Mistral, Qwen2): a query at position i sees the keys at
    # positions j with i - sliding_window < j <= i. None: the whole causal context.
    sliding_window: int | None = None
    # The layers the window applies to (Qwen2's `max_window_layers`); None: every layer.
    sliding_window_layers: tuple[int, ...] | None = None
    # The RoPE base of the windowed layers (Gemma 3's local layers): they rotate with plain,
    # unscaled RoPE of this base while the others keep `rope_theta` and `rope_scaling`.
    # None: every layer rotates alike.
    sliding_window_rope_theta: float | None = None
    # Mixture-of-Experts, a block option of the decoder (`core.moe`); the default is dense.
    moe: MoEConfig = field(default_factory=MoEConfig)
    # Multi-head latent attention (DeepSeek-V2/V3, `core.mla_config`); None: the fused-QKV one.
    mla: MLAConfig | None = None
    # What only this family says (`Family.options`, e.g. `T5Options`, `BertOptions`): None
    # becomes the family's defaults; a family without options takes only None.
    options: Any = None

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        if self.mla is not None and not isinstance(self.mla, MLAConfig):
            raise ConfigError(f"mla must be an MLAConfig (core.mla_config) or None, got "
                              f"{self.mla!r}")
        if self.head_dim is None and self.mla is not None:
            self.head_dim = self.mla.qk_head_dim
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads "
                    f"{self.num_heads}; pick a multiple or set head_dim explicitly."
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}; grouped-query attention needs whole groups."
            )
        if self.mla is not None:
            problems = mla_problems(self)
            if problems:
                raise ConfigError("invalid multi-head latent attention config: "
                                  + "; ".join(problems))
        if self.position == "rope" and self.rotary_dim % 2:
            raise ConfigError(
                f"rotary dims {self.rotary_dim} (head_dim {self.head_dim} x rotary_fraction "
                f"{self.rotary_fraction}) must be even."
            )
        if not isinstance(self.moe, MoEConfig):
            raise ConfigError(f"moe must be a MoEConfig (core.moe.config), got {self.moe!r}")
        if not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"rope_scaling must be a RopeScaling (core.rope_config), got "
                              f"{self.rope_scaling!r}")
        if self.rope_scaling.type != "default" and self.position != "rope":
            raise ConfigError(f"rope_scaling.type {self.rope_scaling.type!r} scales RoPE, but "
                              f"position is {self.position!r}; set position='rope' or drop it")
        problems = rope_scaling_problems(self.rope_scaling, self.rotary_dim)
        if problems:
            raise ConfigError("invalid rope_scaling: " + "; ".join(problems))
        self._check_options(model_family(self).options)
        problems = model_family(self).problems(self)  # what this family cannot take
        if problems:
            raise ConfigError(f"a family {self.family!r} model cannot take "
                              + "; ".join(problems))
        if self.qk_norm and (self.norm, self.qk_norm_width) not in (  # core.qk_norm
                ("rmsnorm", "head"), ("rmsnorm", "projection"), ("rmsnorm1p", "head")):
            raise ConfigError(f"qk_norm is an RMSNorm of q and k; it needs norm='rmsnorm' (or "
                              f"'rmsnorm1p' with qk_norm_width='head'), not norm={self.norm!r} "
                              f"with qk_norm_width={self.qk_norm_width!r}")
        if self.qk_norm_width not in ("head", "projection"):
            raise ConfigError(f"qk_norm_width must be 'head' or 'projection', not "
                              f"{self.qk_norm_width!r}")
        if self.norm_placement not in ("input", "output", "sandwich"):
            raise ConfigError(f"norm_placement must be 'input', 'output' or 'sandwich', not "
                              f"{self.norm_placement!r}")
        self._check_sliding_window()
        if self.moe.num_experts:
            from tessera.core.moe.validate import moe_problems

            problems = moe_problems(self)
            if problems:
                raise ConfigError("invalid Mixture-of-Experts config:\n  - "
                                  + "\n  - ".join(problems))

    def _check_sliding_window(self) -> None:
        if self.sliding_window_layers is not None:
            self.sliding_window_layers = tuple(int(i) for i in self.sliding_window_layers)
        if self.sliding_window is None:
            layers = self.sliding_window_layers
            for name, value in (("sliding_window_layers", layers and list(layers)),
                                ("sliding_window_rope_theta", self.sliding_window_rope_theta)):
                if value is not None:
                    raise ConfigError(f"{name}={value!r} needs a sliding_window; set one or "
                                      "drop it")
            return
        theta = self.sliding_window_rope_theta
        if theta is not None and self.position != "rope":
            raise ConfigError(f"sliding_window_rope_theta={theta!r} needs position='rope', not "
                              f"{self.position!r}; drop it or use RoPE")
        if theta is not None and not theta > 0:
            raise ConfigError(f"sliding_window_rope_theta={theta!r} must be a RoPE base > 0")
        if isinstance(self.sliding_window, bool) or int(self.sliding_window) < 1:
            raise ConfigError(f"sliding_window={self.sliding_window!r} must be a positive number "
                              "of tokens (or None for the whole causal context)")
        if self.family in ("t5", "bert"):
            raise ConfigError(f"sliding_window={self.sliding_window} is supported by the decoder "
                              f"families only, not {self.family!r}")
        bad = [i for i in self.sliding_window_layers or () if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"sliding_window_layers {bad} are not layers of a "
                              f"{self.num_layers}-layer model")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to the whole causal context)."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is not None and layer not in self.sliding_window_layers:
            return None
        return self.sliding_window

    def _check_options(self, options: type | None) -> None:
        """Give the family's default options for None; refuse options of another type."""
        if self.options is None and options is not None:
            self.options = options()
        elif self.options is not None and not isinstance(self.options, options or ()):
            wants = f"a {options.__name__}" if options is not None else "None (it has none)"
            raise ConfigError(f"a family {self.family!r} model takes options {wants}, got "
                              f"{self.options!r}")

    @property
    def rotary_dim(self) -> int:
        if self.mla is not None:  # the rotary part of each query head and the shared key
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.rotary_fraction)

    @property
    def gated(self) -> bool:
        """True when the first MLP projection holds two fused halves (gate and up)."""
        return self.activation in ("swiglu", "geglu")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """A config from `to_dict` output, or from the flat form of older manifests (top-level
        `num_experts`, `moe_top_k`, `num_decoder_layers`, ...: `core.flat_model_fields`);
        `moe` and `options` may be mappings or instances. Unknown fields are an error."""
        name = data.get("family", cls.family)
        options = model_family(name).options
        data = nest_flat_fields(data, name, options)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields {unknown}; known fields: {sorted(known)}")
        if "moe" in data:
            data["moe"] = _sub_config(MoEConfig, data["moe"], "moe")
        if data.get("mla") is not None:
            data["mla"] = _sub_config(MLAConfig, data["mla"], "mla")
        if "rope_scaling" in data:
            data["rope_scaling"] = _sub_config(RopeScaling, data["rope_scaling"], "rope_scaling")
        if data.get("options") is not None and options is not None:
            data["options"] = _sub_config(options, data["options"], "options")
        return cls(**data)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see `PRESETS`), optionally with fields overridden (as `from_dict`
        reads them). A mapping for `moe` or `options` changes only the fields it names; an
        instance replaces the preset's."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        data = {**PRESETS[name], "name": name}
        for key, value in overrides.items():
            if key in ("moe", "options", "rope_scaling", "mla") and isinstance(value, dict):
                value = {**as_dict(data.get(key)), **value}
            data[key] = value
        return cls.from_dict(data)

    @classmethod
    def field_types(cls, family: str) -> dict[str, Any]:
        """The type of every field a family `family` config takes by name: the common ones,
        `moe.<field>` and `options.<field>` (the family's options), and the flat names of older
        manifests (`num_experts`, `moe_top_k`, ...)."""
        types = {k: v for k, v in typing.get_type_hints(cls).items()
                 if k not in ("moe", "options", "rope_scaling", "mla")}
        subs = {"moe": MoEConfig, "options": model_family(family).options,
                "rope_scaling": RopeScaling, "mla": MLAConfig}
        for prefix, kind in subs.items():
            if kind is not None:
                types.update({f"{prefix}.{k}": v for k, v in typing.get_type_hints(kind).items()})
        types.update({flat: types[f"moe.{name}"] for flat, name in FLAT_MOE.items()})
        types.update({flat: types[f"options.{flat}"] for flat in FLAT_OPTIONS
                      if f"options.{flat}" in types})
        return types


def _sub_config(kind: type, value: Any, where: str) -> Any:
    """A mapping `value` as a `kind` (unknown fields are an error); anything else as it is
    (`ModelConfig.__post_init__` checks its type)."""
    if not isinstance(value, dict):
        return value
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"unknown {where} fields {unknown}; known fields: {sorted(known)}")
    return kind(**value)


_GPT2 = dict(family="gpt2", norm="layernorm", activation="gelu_tanh", position="learned",
             bias=True, tied_embeddings=True, norm_eps=1e-5, vocab_size=50257,
             max_position_embeddings=1024)
_LLAMA = dict(family="llama", norm="rmsnorm", activation="swiglu", position="rope", bias=False,
              tied_embeddings=False)
_NEMOTRON = dict(family="nemotron", norm="layernorm1p", activation="squared_relu",
                 position="rope", rotary_fraction=0.5, bias=False, tied_embeddings=False)

PRESETS: dict[str, dict[str, Any]] = {
    # Tiny sizes for tests and the CPU demo.
    "gpt2-tiny": {**_GPT2, "vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 4,
                  "ffn_hidden_size": 256, "max_position_embeddings": 256},
    "llama-tiny": {**_LLAMA, "vocab_size": 512, "hidden_size": 64, "num_layers": 2,
                   "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 172,
                   "max_position_embeddings": 256},
    "nemotron-tiny": {**_NEMOTRON, "vocab_size": 512, "hidden_size": 64, "num_layers": 2,
                      "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 256,
                      "max_position_embeddings": 256},
    "llama-demo": {**_LLAMA, "vocab_size": 2048, "hidden_size": 192, "num_layers": 4,
                   "num_heads": 6, "num_kv_heads": 2, "ffn_hidden_size": 512,
                   "max_position_embeddings": 256},
    # Real sizes, for planning memory and parallel layouts.
    "gpt2-small": {**_GPT2, "hidden_size": 768, "num_layers": 12, "num_heads": 12,
                   "ffn_hidden_size": 3072},
    "gpt2-medium": {**_GPT2, "hidden_size": 1024, "num_layers": 24, "num_heads": 16,
                    "ffn_hidden_size": 4096},
    "llama2-7b": {**_LLAMA, "vocab_size": 32000, "hidden_size": 4096, "num_layers": 32,
                  "num_heads": 32, "ffn_hidden_size": 11008, "max_position_embeddings": 4096},
    "llama3-8b": {**_LLAMA, "vocab_size": 128256, "hidden_size": 4096, "num_layers": 32,
                  "num_heads": 32, "num_kv_heads": 8, "ffn_hidden_size": 14336,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "llama-1b": {**_LLAMA, "vocab_size": 32000, "hidden_size": 2048, "num_layers": 16,
                 "num_heads": 16, "num_kv_heads": 8, "ffn_hidden_size": 5632,
                 "max_position_embeddings": 2048},
    "nemotron4-15b": {**_NEMOTRON, "vocab_size": 256000, "hidden_size": 6144, "num_layers": 32,
                      "num_heads": 48, "num_kv_heads": 8, "ffn_hidden_size": 24576,
                      "max_position_embeddings": 4096},
    "nemotron4-340b": {**_NEMOTRON, "vocab_size": 256000, "hidden_size": 18432, "num_layers": 96,
                       "num_heads": 96, "num_kv_heads": 8, "ffn_hidden_size": 73728,
                       "max_position_embeddings": 4096},
    # The GPT shapes of Narayanan et al. 2021 (PTD-P) Table 1 and GPT-3 (Brown et al. 2020)
    # as Megatron trains them: sequence 2048, vocabulary padded to 51200, for `tessera plan`.
    "gpt-1.7b": {**_GPT2, "vocab_size": 51200, "hidden_size": 2304, "num_layers": 24,
                 "num_heads": 24, "ffn_hidden_size": 9216, "max_position_embeddings": 2048},
    "gpt-18.4b": {**_GPT2, "vocab_size": 51200, "hidden_size": 6144, "num_layers": 40,
                  "num_heads": 48, "ffn_hidden_size": 24576, "max_position_embeddings": 2048},
    "gpt-145.6b": {**_GPT2, "vocab_size": 51200, "hidden_size": 12288, "num_layers": 80,
                   "num_heads": 96, "ffn_hidden_size": 49152, "max_position_embeddings": 2048},
    "gpt3-175b": {**_GPT2, "vocab_size": 51200, "hidden_size": 12288, "num_layers": 96,
                  "num_heads": 96, "ffn_hidden_size": 49152, "max_position_embeddings": 2048},
}
PRESETS["gpt2-124m"] = PRESETS["gpt2-small"]
# Llama 3.2 1B and Qwen2.5 0.5B at their real sizes (their config.json): tied output; Llama 3's
# rope scaling; Qwen2's biases on q/k/v alone.
PRESETS["llama3.2-1b"] = {
    **_LLAMA, "vocab_size": 128256, "hidden_size": 2048, "num_layers": 16, "num_heads": 32,
    "num_kv_heads": 8, "head_dim": 64, "ffn_hidden_size": 8192, "max_position_embeddings": 131072,
    "rope_theta": 500000.0, "norm_eps": 1e-5, "tied_embeddings": True,
    "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
PRESETS["qwen2.5-0.5b"] = {
    **_LLAMA, "family": "qwen2", "vocab_size": 151936, "hidden_size": 896, "num_layers": 24,
    "num_heads": 14, "num_kv_heads": 2, "ffn_hidden_size": 4864,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "norm_eps": 1e-6,
    "tied_embeddings": True, "qkv_bias": True}
# Qwen3-0.6B at its real size (596M, 440M without the tied embedding): per-head q/k norms.
PRESETS["qwen3-0.6b"] = {
    **_LLAMA, "family": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "num_layers": 28,
    "num_heads": 16, "num_kv_heads": 8, "head_dim": 128, "ffn_hidden_size": 3072,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "norm_eps": 1e-6,
    "tied_embeddings": True, "qk_norm": True}
# Phi-3-mini-4k at its real size (3.8B; Phi-3.5-mini is the same shape with longrope to 128k),
# with the 2047-token window its config.json sets on every layer.
PRESETS["phi3-mini"] = {
    **_LLAMA, "family": "phi3", "vocab_size": 32064, "hidden_size": 3072, "num_layers": 32,
    "num_heads": 32, "ffn_hidden_size": 8192, "max_position_embeddings": 4096, "norm_eps": 1e-5,
    "sliding_window": 2047}
# OLMo-2 1B (OLMo-2-0425-1B's config.json): norms on the sublayer outputs, q/k norm over the
# whole projections.
PRESETS["olmo2-1b"] = {
    **_LLAMA, "family": "olmo2", "vocab_size": 100352, "hidden_size": 2048, "num_layers": 16,
    "num_heads": 16, "ffn_hidden_size": 8192, "max_position_embeddings": 4096,
    "rope_theta": 500000.0, "norm_eps": 1e-6, "qk_norm": True, "qk_norm_width": "projection",
    "norm_placement": "output"}
# Gemma 2 2B (its config.json): 4096-token sliding windows on every other layer from the first.
PRESETS["gemma2-2b"] = {
    "family": "gemma2", "norm": "rmsnorm1p", "activation": "geglu", "position": "rope",
    "bias": False, "tied_embeddings": True, "norm_placement": "sandwich", "vocab_size": 256000,
    "hidden_size": 2304, "num_layers": 26, "num_heads": 8, "num_kv_heads": 4, "head_dim": 256,
    "ffn_hidden_size": 9216, "max_position_embeddings": 8192, "norm_eps": 1e-6,
    "sliding_window": 4096, "sliding_window_layers": tuple(range(0, 26, 2)),
    "options": dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0)}
# Gemma 3 1B (google/gemma-3-1b-pt's config.json): 512-token windows on five of every six
# layers, which rotate at base 10000; the global layers (5, 11, 17, 23) at 1000000.
PRESETS["gemma3-1b"] = {
    "family": "gemma3", "norm": "rmsnorm1p", "activation": "geglu", "position": "rope",
    "bias": False, "tied_embeddings": True, "norm_placement": "sandwich", "qk_norm": True,
    "vocab_size": 262144, "hidden_size": 1152, "num_layers": 26, "num_heads": 4,
    "num_kv_heads": 1, "head_dim": 256, "ffn_hidden_size": 6912,
    "max_position_embeddings": 32768, "norm_eps": 1e-6, "rope_theta": 1000000.0,
    "sliding_window": 512, "sliding_window_layers": tuple(i for i in range(26) if (i + 1) % 6),
    "sliding_window_rope_theta": 10000.0,
    "options": dict(query_pre_attn_scalar=256)}
# T5 (`core.models.t5.model`): v1.1 (gated GELU, untied output, no output scaling); relu + tied +
# `options.scaled_output` gives the original T5.
_T5 = dict(family="t5", norm="rmsnorm", norm_eps=1e-6, activation="geglu", position="relative",
           bias=False, tied_embeddings=False, init_std=0.05)
PRESETS["t5-tiny"] = {**_T5, "vocab_size": 512, "hidden_size": 64, "num_layers": 2,
                      "num_heads": 4, "ffn_hidden_size": 128, "max_position_embeddings": 512,
                      "options": dict(num_decoder_layers=2, relative_attention_num_buckets=32,
                                      relative_attention_max_distance=128)}
PRESETS["t5-base"] = {**_T5, "vocab_size": 32128, "hidden_size": 768, "num_layers": 12,
                      "num_heads": 12, "ffn_hidden_size": 2048, "max_position_embeddings": 512,
                      "options": dict(num_decoder_layers=12)}
PRESETS["gpt2-355m"] = PRESETS["gpt2-medium"]
# Mixture-of-Experts (`MoEConfig` fields under "moe"): tiny sizes for tests, real ones (Mixtral
# 8x7B, Qwen1.5-MoE-A2.7B, whose q/k/v projections alone have biases) for planning.
_MIXTRAL_MOE = dict(num_experts=8, top_k=2, norm_topk=True, aux_loss_coef=0.02)
_QWEN_MOE = dict(top_k=4, norm_topk=False, aux_loss_coef=0.001)
_MIXTRAL = dict(_LLAMA, family="mixtral")
PRESETS.update({
    "mixtral-tiny": {**_MIXTRAL, "vocab_size": 512, "hidden_size": 64, "num_layers": 2,
                     "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 128,
                     "max_position_embeddings": 256, "moe": {**_MIXTRAL_MOE, "num_experts": 4}},
    "qwen-moe-tiny": {**_LLAMA, "family": "qwen2_moe", "vocab_size": 512, "hidden_size": 64,
                      "num_layers": 2, "num_heads": 4, "num_kv_heads": 4, "ffn_hidden_size": 128,
                      "max_position_embeddings": 256,
                      "moe": {**_QWEN_MOE, "num_experts": 8, "top_k": 2, "ffn_hidden_size": 32,
                              "shared_ffn_hidden_size": 128}},
    "mixtral-8x7b": {**_MIXTRAL, "vocab_size": 32000, "hidden_size": 4096, "num_layers": 32,
                     "num_heads": 32, "num_kv_heads": 8, "ffn_hidden_size": 14336,
                     "max_position_embeddings": 32768, "rope_theta": 1e6, "moe": _MIXTRAL_MOE},
    "qwen1.5-moe-a2.7b": {**_LLAMA, "family": "qwen2_moe", "vocab_size": 151936,
                          "hidden_size": 2048, "num_layers": 24, "num_heads": 16,
                          "ffn_hidden_size": 5632, "max_position_embeddings": 8192,
                          "rope_theta": 1e6, "norm_eps": 1e-6, "qkv_bias": True,
                          "moe": {**_QWEN_MOE, "num_experts": 60, "ffn_hidden_size": 1408,
                                  "shared_ffn_hidden_size": 5632}},
})

# BERT: post-LayerNorm, exact GELU, learned positions, LayerNorm eps 1e-12, the
# masked-LM decoder tied to the word embedding (`core.models.bert.model`); two token types.
_BERT = dict(family="bert", norm="layernorm", norm_eps=1e-12, activation="gelu",
             position="learned", bias=True, tied_embeddings=True,
             options=dict(type_vocab_size=2))
BERT_PRESETS: dict[str, dict[str, Any]] = {
    "bert-tiny": {**_BERT, "vocab_size": 512, "hidden_size": 64, "num_layers": 2,
                  "num_heads": 4, "ffn_hidden_size": 256, "max_position_embeddings": 256},
    # bert-base-uncased's shape, for planning.
    "bert-base": {**_BERT, "vocab_size": 30522, "hidden_size": 768, "num_layers": 12,
                  "num_heads": 12, "ffn_hidden_size": 3072, "max_position_embeddings": 512},
}
PRESETS.update(BERT_PRESETS)

# Qwen3-MoE (`core.qk_norm`): Qwen2-MoE without the shared expert, with per-head q/k
# RMSNorm, normalized top-k and an explicit head_dim. A tiny one for tests and Qwen3-30B-A3B's
# real sizes for planning (its config.json: 48 layers, 128 experts, top-8).
_QWEN3_MOE = dict(_LLAMA, family="qwen3_moe", qk_norm=True)
PRESETS.update({
    "qwen3-moe-tiny": {**_QWEN3_MOE, "vocab_size": 512, "hidden_size": 64, "num_layers": 2,
                       "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "ffn_hidden_size": 128,
                       "max_position_embeddings": 256,
                       "moe": dict(num_experts=8, top_k=2, ffn_hidden_size=32, norm_topk=True,
                                   aux_loss_coef=0.001)},
    "qwen3-30b-a3b": {**_QWEN3_MOE, "vocab_size": 151936, "hidden_size": 2048, "num_layers": 48,
                      "num_heads": 32, "num_kv_heads": 4, "head_dim": 128,
                      "ffn_hidden_size": 6144, "max_position_embeddings": 40960,
                      "rope_theta": 1e6, "norm_eps": 1e-6,
                      "moe": dict(num_experts=128, top_k=8, ffn_hidden_size=768, norm_topk=True,
                                  aux_loss_coef=0.001)},
})


# DeepSeek-V2-Lite (15.7B, 2.4B active) and DeepSeek-V3 (671B without its multi-token-prediction
# layer), their config.json shapes: multi-head latent attention (`mla`), yarn rope to 160k, the
# first layers dense, then shared experts beside group-limited routed ones (V3: sigmoid scores
# through a routing bias, normalized and scaled weights); `converters.hf` reads their
# config.json to these same fields.
_DEEPSEEK = dict(_LLAMA, norm_eps=1e-6, max_position_embeddings=163840, rope_theta=10000.0)
_DEEPSEEK_YARN = dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                      beta_fast=32.0, beta_slow=1.0)
PRESETS.update({
    "deepseek-v2-lite": {
        **_DEEPSEEK, "family": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
        "num_layers": 27, "num_heads": 16, "num_kv_heads": 16, "ffn_hidden_size": 10944,
        "rope_scaling": {**_DEEPSEEK_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
        "mla": dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    q_lora_rank=None),
        "moe": dict(num_experts=64, top_k=6, ffn_hidden_size=1408, shared_ffn_hidden_size=2816,
                    shared_expert_gated=False, first_dense_layers=1, norm_topk=False,
                    aux_loss_coef=0.001)},
    "deepseek-v3": {
        **_DEEPSEEK, "family": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "num_layers": 61, "num_heads": 128, "num_kv_heads": 128, "ffn_hidden_size": 18432,
        "rope_scaling": {**_DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
        "mla": dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    q_lora_rank=1536),
        "moe": dict(num_experts=256, top_k=8, ffn_hidden_size=2048, shared_ffn_hidden_size=2048,
                    shared_expert_gated=False, first_dense_layers=3, router_score="sigmoid",
                    norm_topk=True, routed_scale=2.5, num_groups=8, topk_groups=4,
                    group_score="top2_sum", expert_bias=True, aux_loss_coef=0.001)},
})


Placement = Literal["looped", "v"]
DataParallel = Literal["ddp", "fsdp", "zero1"]
CPComm = Literal["allgather", "ring"]
PLACEMENTS: tuple[str, ...] = ("looped", "v")
CP_COMMS: tuple[str, ...] = ("allgather", "ring")


@dataclass(frozen=True)
class Layout:
    """Where the weights live: how one model is laid out over `tp * cp * dp * pp` ranks.

    Rank order, fastest first: tp, then cp, then dp, then pp, so global rank
    `= ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank` (`core.parallel.groups.rank_of`).
    Parameters are replicated over cp and dp. `placement` maps the `pp * virtual_stages` stages
    onto pipeline ranks (`looped` or `v`). Expert parallelism (`ep`, `etp`; MoE models only) adds
    no ranks: it folds each stage's `tp * cp * dp` ranks into an etp x ep x edp grid
    (`core.parallel.expert_groups`); ep must divide dp x cp, ep x etp must divide tp x cp x dp,
    and tp > 1 with ep x etp > 1 needs sequence parallelism. Checkpoints record the whole layout;
    any checkpoint loads under any other. How a step runs is a separate `TrainSchedule`.

    Why this order, the placements and the expert grid: docs/architecture.md, "Rank order,
    placement and the expert grid".
    """

    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size (ranks)
    virtual_stages: int = 1  # model chunks (stages) per pipeline rank
    placement: Placement = "looped"  # how stages map onto pipeline ranks: looped | v
    dp: int = 1  # data-parallel size
    sequence_parallel: bool = False  # shard norm/dropout activations along the sequence over tp
    cp: int = 1  # context-parallel size: each sequence split over cp ranks
    # --- Expert parallelism (see the docstring): folded over tp x cp x dp.
    ep: int = 1  # expert-parallel size: experts split over ep ranks
    etp: int = 1  # expert-tensor-parallel size: each expert's FFN split over etp ranks

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        """A layout from `to_dict` output; missing fields take their defaults (a version-1
        manifest holds only tp, pp and virtual_stages), unknown ones are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown Layout fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    def problems(
        self, model: ModelConfig, world_size: int | None = None, seq_len: int | None = None
    ) -> list[str]:
        """Every reason this layout cannot hold `model` (empty when it can), each with the
        numbers that clash and what to do."""
        return _layout_problems(self, model, world_size, seq_len)

    def validate(
        self, model: ModelConfig, world_size: int | None = None, seq_len: int | None = None
    ) -> None:
        """Raise `ConfigError` listing every problem (`problems`) of this layout for `model`."""
        problems = self.problems(model, world_size, seq_len)
        if problems:
            raise ConfigError("invalid parallel layout:\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True)
class TrainSchedule:
    """How a training step runs on a `Layout`: what the weights' placement does not decide.

    Validated against a layout by `core.parallel.pipeline.schedule_problems`, which knows the
    schedule names; `core.parallel.pipeline.default_placement(schedule)` gives the placement a
    schedule needs.
    """

    schedule: str = "1f1b"  # pipeline schedule name, see core.parallel.pipeline.SCHEDULES
    micro_batches: int = 1  # micro-batches per step (pipeline) / gradient-accumulation steps
    recompute: Recompute = "none"
    recompute_layers: int | None = None  # with recompute="full": first N layers per stage (None: all)
    data_parallel: DataParallel = "ddp"
    # How attention exchanges K/V over the cp group (`core.parallel.context_parallel`):
    # allgather (one autograd all-gather per layer; the CPU default) or ring (p2p blocks,
    # the next block's transfer overlapped with the current block's attention).
    cp_comm: CPComm = "allgather"
    # Dynamic context parallelism (`core.parallel.dynamic_cp_runtime`): per micro-batch, each
    # sequence (packed document) spread over its own power-of-two block of the cp group.
    cp_dynamic: bool = False
    # Mixture-of-Experts under expert parallelism: how tokens reach the ranks holding
    # their experts, "alltoall" or "allgather" (`core.parallel.expert_parallel`).
    moe_dispatcher: str = "alltoall"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _layout_problems(
    lay: Layout, model: ModelConfig, world_size: int | None, seq_len: int | None
) -> list[str]:
    out = [f"{name} must be >= 1, got {getattr(lay, name)}"
           for name in ("tp", "pp", "virtual_stages", "dp", "cp") if getattr(lay, name) < 1]
    if out:
        return out
    if world_size is not None and world_size != lay.world_size:
        cp = f" x cp {lay.cp}" if lay.cp > 1 else ""
        out.append(
            f"world size {world_size} != tp {lay.tp}{cp} x pp {lay.pp} x dp {lay.dp} = "
            f"{lay.world_size}; launch {lay.world_size} processes or change tp/pp/dp"
            f"{'/cp' if cp else ''} (e.g. dp = {world_size // (lay.tp * lay.cp * lay.pp) or 1})"
        )
    if model.num_heads % lay.tp:
        out.append(
            f"num_heads {model.num_heads} is not divisible by tp {lay.tp}; use a tp that "
            f"divides it (e.g. {divisors(model.num_heads)})"
        )
    out += _kv_head_problems(model, lay.tp)
    if model.mla is not None and lay.cp > 1:
        out.append(f"cp {lay.cp}: multi-head latent attention (mla) has no context-parallel "
                   "path; use cp 1 (tp, sequence parallelism and pp split it)")
    if model.ffn_hidden_size % lay.tp:
        out.append(f"ffn_hidden_size {model.ffn_hidden_size} is not divisible by tp {lay.tp}")
    if model.moe.num_experts:  # Mixture-of-Experts
        from tessera.core.moe.validate import moe_layout_problems

        out += moe_layout_problems(model, lay)
    stages, split = lay.num_stages, model_family(model).layout_problems
    if split is not None:  # the family shares out its stages its own way (e.g. T5's two stacks)
        out += split(model, lay)
    elif model.num_layers % stages:
        out.append(
            f"num_layers {model.num_layers} is not divisible by pp {lay.pp} x virtual_stages "
            f"{lay.virtual_stages} = {stages}; use a stage count in {divisors(model.num_layers)}"
        )
    if lay.placement not in PLACEMENTS:
        out.append(f"unknown placement {lay.placement!r}; choose one of {list(PLACEMENTS)}")
    elif lay.placement == "v" and lay.virtual_stages != 2:
        out.append(f"placement 'v' puts two stages on each pipeline rank: set virtual_stages 2 "
                   f"(got {lay.virtual_stages})")
    if lay.sequence_parallel and lay.tp == 1:
        out.append("sequence_parallel needs tp > 1 (it shards activations over the tp group)")
    if lay.sequence_parallel and seq_len is not None and seq_len % lay.tp:
        out.append(f"sequence length {seq_len} is not divisible by tp {lay.tp} (sequence parallel)")
    if lay.cp > 1 and seq_len is not None:
        unit = 2 * lay.cp
        if seq_len % unit:
            out.append(f"sequence length {seq_len} is not divisible by 2 x cp = {unit} (context "
                       f"parallel cuts each sequence into 2 x cp chunks); use a multiple of "
                       f"{unit} (e.g. {seq_len // unit * unit or unit}) or a smaller cp")
        elif lay.sequence_parallel and (seq_len // lay.cp) % lay.tp:
            out.append(f"each cp rank's {seq_len // lay.cp} tokens (sequence length {seq_len} / "
                       f"cp {lay.cp}) do not split over tp {lay.tp} (sequence parallel); use a "
                       f"sequence length that is a multiple of {lay.tp * 2 * lay.cp}")
    if lay.cp > 1:
        out += packed_attention_problems(
            model, f"cp {lay.cp}", "use cp 1 (tp, sequence parallelism and pp hold this model)")
    out += expert_layout_problems(lay, model)  # expert parallelism
    return out


def packed_attention_problems(model: ModelConfig, what: str, instead: str) -> list[str]:
    """Why `what` (context parallelism, packed documents) cannot run `model`, with `instead` as
    the fix: the attention over cp chunks or packed documents
    (`parallel.context_parallel.attention`) scores with 1 / sqrt(head_dim), uncapped, so a
    model with another score scale or a soft cap (Gemma 2's options) is refused."""
    fields = {f: getattr(model.options, f, None)
              for f in ("query_pre_attn_scalar", "attn_logit_softcapping")}
    named = ", ".join(f"{f}={v}" for f, v in fields.items() if v is not None)
    if not named:
        return []
    return [f"{what}: the attention over context-parallel chunks and packed documents scores "
            f"with 1 / sqrt(head_dim) and no soft cap, but the model sets {named}; {instead}"]


def _kv_head_problems(model: ModelConfig, tp: int) -> list[str]:
    """tp must divide num_kv_heads (each rank holds whole kv heads) or be a multiple of it
    (each kv head replicated on tp / num_kv_heads ranks, `sharding.kv_replicas`)."""
    kv = model.num_kv_heads
    if kv % tp and tp % kv:
        fits = [t for t in divisors(model.num_heads) if kv % t == 0 or t % kv == 0]
        return [f"num_kv_heads {kv} and tp {tp}: tp must divide num_kv_heads (each rank holds "
                f"whole kv heads) or be a multiple of it (each kv head replicated on tp / "
                f"num_kv_heads ranks); use tp in {fits}"]
    return []


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending (for error messages that suggest a fix)."""
    return [d for d in range(1, n + 1) if n % d == 0]
