"""FP8 (e4m3) weight quantization with per-tensor or per-output-channel scales.

Stored form: `q = clamp(w * scale, -448, 448).to(float8_e4m3fn)` with `scale = 448 / amax`
(fp32; a tensor of shape `()` per tensor, or `(out, 1)` per output channel), so that
`w ~= q.float() / scale`. Under tensor parallelism a per-channel scale is split with its rows.
"""

from __future__ import annotations

import torch

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def quantize(weight: torch.Tensor, per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` for a 2-D weight; zeros map to scale 1 so nothing divides by zero."""
    w = weight.float()
    amax = w.abs().amax(dim=-1, keepdim=True) if per_channel else w.abs().amax()
    scale = torch.where(amax > 0, E4M3_MAX / amax.clamp(min=1e-12), torch.ones_like(amax))
    q = (w * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """The higher-precision weight `q / scale` in `dtype`."""
    return (q.float() / scale.float()).to(dtype)
