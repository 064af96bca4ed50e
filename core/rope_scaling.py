"""The rotary frequencies of every RoPE variant (`core.rope_config.RopeScaling`), computed as
transformers computes them, so converted models give its logits.

`rotary_angles(config, positions, lengths)` is what the decoder's rotary embedding needs: the
inverse frequencies for each row of a batch, and the factor cos and sin are multiplied by. The
variants whose frequencies depend on the sequence length (`length_dependent`: `dynamic`,
`longrope`) use each row's sequence length, which is what transformers takes per forward call of
one sequence (its largest position + 1): a whole prompt uses the frequencies of its full length,
and each generated token those of the length so far. Keys cached earlier keep the rotation they
were made with, as in transformers. A caller that runs a prompt in chunks, or pads rows of
different lengths into one pass, passes `lengths` (the serving engine does); without it a row's
length is its largest position + 1.
Everything is fp32 tensor arithmetic without host reads, so the decoder still compiles.
"""

from __future__ import annotations

import math

import torch

from tessera.core.config import ModelConfig
from tessera.core.rope_config import RopeScaling


def _exponents(dim: int, device: torch.device) -> torch.Tensor:
    """`(0, 2, 4, ..., dim - 2) / dim` in fp32: the exponents of the base, one per pair."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def base_inv_freq(theta: float, dim: int, device: torch.device) -> torch.Tensor:
    """Plain RoPE's inverse frequencies `(dim / 2,)`."""
    return 1.0 / (theta ** _exponents(dim, device))


def _llama3(inv: torch.Tensor, rope: RopeScaling) -> torch.Tensor:
    original = rope.original_max_position_embeddings
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (original / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(config: ModelConfig) -> float:
    rope = config.rope_scaling
    if rope.factor is not None:
        return rope.factor
    return config.max_position_embeddings / rope.original_max_position_embeddings


def _yarn(config: ModelConfig, device: torch.device) -> torch.Tensor:
    rope, dim, base = config.rope_scaling, config.rotary_dim, config.rope_theta
    factor, original = _yarn_factor(config), rope.original_max_position_embeddings
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate is None or rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = (1 - ramp).to(device)
    powers = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    return (1.0 / (factor * powers)) * (1 - extrapolate) + (1.0 / powers) * extrapolate


def attention_factor(config: ModelConfig) -> float:
    """The factor cos and sin are multiplied by (1 but for yarn and longrope)."""
    rope = config.rope_scaling
    if rope.attention_factor is not None or rope.type not in ("yarn", "longrope"):
        return 1.0 if rope.attention_factor is None else rope.attention_factor
    if rope.type == "yarn":
        factor = _yarn_factor(config)
        if rope.mscale and rope.mscale_all_dim:
            return _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        return _yarn_mscale(factor)
    original = rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else (
        config.max_position_embeddings / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def length_dependent(config: ModelConfig) -> bool:
    """Whether the rotary frequencies depend on the sequence length (`dynamic`, `longrope`)."""
    return config.position == "rope" and config.rope_scaling.type in ("dynamic", "longrope")


def recompute_at(config: ModelConfig) -> int | None:
    """The cached length at which a generation re-encodes its whole sequence once: transformers'
    Phi-3 does so (its `prepare_inputs_for_generation`) when a sequence that started within
    `original_max_position_embeddings` first passes it, so every key gets longrope's long factors.
    The family says whether it does (`Family.longrope_reencodes`); None for every other model."""
    from tessera.core.models.registry import family  # the registry imports the models

    rope = config.rope_scaling
    if (config.position == "rope" and rope.type == "longrope"
            and family(config.family).longrope_reencodes):
        return rope.original_max_position_embeddings
    return None


# (factors, theta, dim, device) -> 1 / (factors * theta ** exponents): longrope's two sets, built
# once per device rather than copied from the host on every forward.
_LONGROPE: dict[tuple[tuple[float, ...], float, int, torch.device], torch.Tensor] = {}


def _longrope_inv(factors: tuple[float, ...], theta: float, dim: int,
                  device: torch.device) -> torch.Tensor:
    key = (factors, theta, dim, device)
    inv = _LONGROPE.get(key)
    if inv is None or torch.compiler.is_compiling():  # compiled: a constant of the graph
        powers = theta ** _exponents(dim, device)
        inv = 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * powers)
        if not torch.compiler.is_compiling():
            _LONGROPE[key] = inv
    return inv


def rotary_angles(config: ModelConfig, positions: torch.Tensor,
                  lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies `(B, 1, rotary_dim / 2)` fp32 for `positions (B, T)`, the factor
    of cos and sin). Rows differ only for the length-dependent variants, which use `lengths
    (B,)` (each row's sequence length; default: its largest position + 1)."""
    rope, dim, theta = config.rope_scaling, config.rotary_dim, config.rope_theta
    device = positions.device
    scale = attention_factor(config)
    if length_dependent(config):
        if lengths is None:
            length = positions.amax(dim=-1, keepdim=True) + 1  # (B, 1)
        else:
            length = lengths.to(device=device, dtype=torch.long).view(-1, 1)
    if rope.type == "dynamic":
        top = config.max_position_embeddings
        length = length.clamp(min=top)
        bases = theta * ((rope.factor * length / top) - (rope.factor - 1)) ** (dim / (dim - 2))
        inv = 1.0 / (bases.unsqueeze(-1) ** _exponents(dim, device))
        return inv, scale
    if rope.type == "longrope":
        short = _longrope_inv(tuple(rope.short_factor), theta, dim, device)
        long = _longrope_inv(tuple(rope.long_factor), theta, dim, device)
        inv = torch.where((length > rope.original_max_position_embeddings).unsqueeze(-1),
                          long, short)
        return inv, scale
    if rope.type == "yarn":
        inv = _yarn(config, device)
    else:
        inv = base_inv_freq(theta, dim, device)
        if rope.type == "linear":
            inv = inv / rope.factor
        elif rope.type == "llama3":
            inv = _llama3(inv, rope)
    return inv.expand(positions.shape[0], 1, -1), scale
