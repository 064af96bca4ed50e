"""Typed configs for the model and its parallel layout, with named presets.

`ModelConfig` describes the global (unsharded) network; `ParallelConfig` describes how it is laid
out over ranks. Both are plain dataclasses: they are saved into every checkpoint manifest as JSON
(`to_dict` / `from_dict`) and validated up front with messages that name the numbers and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

Norm = Literal["layernorm", "rmsnorm", "layernorm1p"]
Activation = Literal["gelu", "gelu_tanh", "swiglu", "squared_relu"]
Position = Literal["learned", "rope"]
Recompute = Literal["none", "selective", "full"]


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which numbers clash and what to do."""


@dataclass
class ModelConfig:
    """The global shape of a GPT-style decoder. Defaults describe a tiny Llama-style model."""

    name: str = "custom"
    family: str = "llama"  # gpt2 | llama | nemotron: decides the Hugging Face mapping only
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
    bias: bool = False  # biases on the linear layers (norms of layernorm kind always have one)
    tied_embeddings: bool = False  # output projection shares the token embedding
    dropout: float = 0.0  # hidden and attention dropout
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
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
        if self.position == "rope" and self.rotary_dim % 2:
            raise ConfigError(
                f"rotary dims {self.rotary_dim} (head_dim {self.head_dim} x rotary_fraction "
                f"{self.rotary_fraction}) must be even."
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction)

    @property
    def gated(self) -> bool:
        """True when the first MLP projection holds two fused halves (gate and up)."""
        return self.activation == "swiglu"

    def num_parameters(self) -> int:
        """Parameter count of the global model (tied embeddings counted once)."""
        from tessera.core.parallel.sharding import global_param_shapes

        return sum(math.prod(s) for s in global_param_shapes(self).values())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see `PRESETS`), optionally with fields overridden."""
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], "name": name, **overrides})


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
}
PRESETS["gpt2-124m"] = PRESETS["gpt2-small"]
PRESETS["gpt2-355m"] = PRESETS["gpt2-medium"]


@dataclass
class ParallelConfig:
    """How one model is laid out over `tp * pp * dp` ranks (tp fastest, then dp, then pp)."""

    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size (ranks)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved / V schedules)
    dp: int = 1  # data-parallel size
    sequence_parallel: bool = False  # shard norms/dropout activations along the sequence over tp
    recompute: Recompute = "none"
    recompute_layers: int | None = None  # with recompute="full": first N layers per stage (None: all)
    schedule: str = "1f1b"  # pipeline schedule name, see core.parallel.pipeline.SCHEDULES
    micro_batches: int = 1  # micro-batches per step (pipeline) / gradient-accumulation steps
    data_parallel: Literal["ddp", "fsdp", "zero1"] = "ddp"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelConfig:
        return cls(**{k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def validate(
        self,
        model: ModelConfig,
        world_size: int | None = None,
        global_batch: int | None = None,
        seq_len: int | None = None,
    ) -> None:
        """Raise `ConfigError` naming the clash and the fix for any layout that cannot work."""
        problems = _layout_problems(self, model, world_size, global_batch, seq_len)
        if problems:
            raise ConfigError("invalid parallel layout:\n  - " + "\n  - ".join(problems))


def _layout_problems(
    par: ParallelConfig,
    model: ModelConfig,
    world_size: int | None,
    global_batch: int | None,
    seq_len: int | None,
) -> list[str]:
    from tessera.core.parallel.pipeline import SCHEDULES, V_SCHEDULES, schedule_problems

    out: list[str] = []
    for name in ("tp", "pp", "virtual_stages", "dp", "micro_batches"):
        if getattr(par, name) < 1:
            out.append(f"{name} must be >= 1, got {getattr(par, name)}")
    if out:
        return out
    if world_size is not None and world_size != par.world_size:
        out.append(
            f"world size {world_size} != tp {par.tp} x pp {par.pp} x dp {par.dp} = "
            f"{par.world_size}; launch {par.world_size} processes or change tp/pp/dp "
            f"(e.g. dp = {world_size // (par.tp * par.pp) or 1})"
        )
    if model.num_heads % par.tp:
        out.append(
            f"num_heads {model.num_heads} is not divisible by tp {par.tp}; use a tp that "
            f"divides it (e.g. {_divisors(model.num_heads)})"
        )
    kv = model.num_kv_heads
    if kv % par.tp and par.tp % kv:
        fits = [t for t in _divisors(model.num_heads) if kv % t == 0 or t % kv == 0]
        out.append(
            f"num_kv_heads {kv} and tp {par.tp}: tp must divide num_kv_heads (each rank holds "
            f"whole kv heads) or be a multiple of it (each kv head replicated on tp / "
            f"num_kv_heads ranks); use tp in {fits}"
        )
    if model.ffn_hidden_size % par.tp:
        out.append(f"ffn_hidden_size {model.ffn_hidden_size} is not divisible by tp {par.tp}")
    stages = par.num_stages
    if model.num_layers % stages:
        out.append(
            f"num_layers {model.num_layers} is not divisible by pp {par.pp} x virtual_stages "
            f"{par.virtual_stages} = {stages}; use a stage count in {_divisors(model.num_layers)}"
        )
    if par.schedule not in SCHEDULES:
        out.append(f"unknown schedule {par.schedule!r}; choose one of {sorted(SCHEDULES)}")
    elif par.schedule in V_SCHEDULES and par.virtual_stages != 2:
        out.append(f"schedule {par.schedule!r} places two stages per rank: set virtual_stages 2")
    elif par.virtual_stages > 1 and par.schedule in ("1f1b", "gpipe"):
        out.append(
            f"schedule {par.schedule!r} runs one stage per rank but virtual_stages is "
            f"{par.virtual_stages}; use 'interleaved-1f1b' or set virtual_stages 1"
        )
    if par.pp > 1 and par.schedule in SCHEDULES:
        out += schedule_problems(par)
    if par.sequence_parallel and par.tp == 1:
        out.append("sequence_parallel needs tp > 1 (it shards activations over the tp group)")
    if par.sequence_parallel and seq_len is not None and seq_len % par.tp:
        out.append(f"sequence length {seq_len} is not divisible by tp {par.tp} (sequence parallel)")
    if par.recompute == "full" and par.recompute_layers is not None and par.recompute_layers < 0:
        out.append(f"recompute_layers must be >= 0, got {par.recompute_layers}")
    if global_batch is not None:
        per_dp = global_batch // par.dp
        if global_batch % par.dp:
            out.append(f"global batch {global_batch} is not divisible by dp {par.dp}")
        elif per_dp % par.micro_batches:
            out.append(
                f"per-data-parallel batch {per_dp} (global {global_batch} / dp {par.dp}) does not "
                f"split into {par.micro_batches} micro-batches; choose micro_batches in "
                f"{_divisors(per_dp)}"
            )
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
