"""How a decoder's rotary position embedding is scaled (`ModelConfig.rope_scaling`).

The variants and their fields follow transformers' `rope_parameters`, field for field, so a
config.json converts without reinterpretation; `core.rope_scaling` computes the frequencies.

- `default`: plain RoPE, no other field.
- `linear`: every frequency divided by `factor`.
- `dynamic` (NTK): the base grows with the sequence once it passes `max_position_embeddings`;
  the frequencies depend on the length of the sequence being run.
- `llama3`: low frequencies divided by `factor`, high ones kept, a smooth blend between, the
  bands set by `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings`.
- `yarn`: interpolation blended with extrapolation per dimension (`beta_fast`, `beta_slow`,
  `truncate`), and cos/sin scaled by `attention_factor` (default from `factor`, `mscale`,
  `mscale_all_dim`).
- `longrope`: per-dimension `short_factor`s, or `long_factor`s once the sequence passes
  `original_max_position_embeddings`; cos/sin scaled by `attention_factor` (default from
  `factor`, itself defaulting to max_position_embeddings / original_max_position_embeddings).

Torch-free: `core.config` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RopeType = Literal["default", "linear", "dynamic", "yarn", "longrope", "llama3"]
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

# The fields each variant reads (besides `type`); any other set field is an error.
_READS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor",
                 "short_factor", "long_factor"),
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",), "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings", "short_factor", "long_factor"),
}


@dataclass
class RopeScaling:
    """One RoPE variant and its parameters (transformers' names); None: unset."""

    type: RopeType = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None  # yarn, longrope: scale of cos and sin
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn (None: 32)
    beta_slow: float | None = None  # yarn (None: 1)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool | None = None  # yarn: round the ramp's bounds (None: True)
    short_factor: list[float] | None = None  # longrope, one per rotated pair
    long_factor: list[float] | None = None  # longrope, one per rotated pair

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on the length of the sequence being run."""
        return self.type in ("dynamic", "longrope")


def rope_scaling_problems(rope: RopeScaling, rotary_dim: int) -> list[str]:
    """Every reason `rope` cannot scale a RoPE of `rotary_dim` dims (empty when it can)."""
    if rope.type not in ROPE_TYPES:
        return [f"rope_scaling.type {rope.type!r} is not supported (supported: "
                f"{', '.join(ROPE_TYPES)})"]
    out = []
    reads = _READS[rope.type]
    for name in ("factor", "original_max_position_embeddings", "attention_factor",
                 "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                 "mscale_all_dim", "truncate", "short_factor", "long_factor"):
        value = getattr(rope, name)
        if value is not None and name not in reads:
            out.append(f"rope_scaling.{name}={value!r} means nothing to rope type {rope.type!r} "
                       f"(it reads: {', '.join(reads) or 'no other field'})")
        elif value is None and name in _REQUIRED.get(rope.type, ()):
            out.append(f"rope type {rope.type!r} needs rope_scaling.{name}")
    if out:
        return out
    if rope.factor is not None and rope.factor <= 0:
        out.append(f"rope_scaling.factor must be > 0, got {rope.factor}")
    original = rope.original_max_position_embeddings
    if original is not None and original < 1:
        out.append(f"rope_scaling.original_max_position_embeddings must be >= 1, got {original}")
    if rope.type == "llama3" and rope.low_freq_factor >= rope.high_freq_factor:
        out.append(f"rope_scaling.low_freq_factor {rope.low_freq_factor} must be below "
                   f"high_freq_factor {rope.high_freq_factor}")
    if rope.type == "longrope":
        for name in ("short_factor", "long_factor"):
            n = len(getattr(rope, name))
            if n != rotary_dim // 2:
                out.append(f"rope_scaling.{name} has {n} values; a rotary dim of {rotary_dim} "
                           f"needs {rotary_dim // 2} (one per rotated pair)")
    if rope.type == "dynamic" and rotary_dim <= 2:
        out.append(f"dynamic rope needs a rotary dim above 2, got {rotary_dim}")
    return out
