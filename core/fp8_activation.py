"""On-the-fly e4m3 quantization of a linear layer's input, in one pass and with no host sync.

`quantize_activation(x, rowwise)` returns `(q, scale_inv)` for a 2-D `x (M, K)`: the amax (of
each row, or of the whole tensor), the scale `448 / amax` (1 where the amax is 0 or not
finite), the saturating cast `clamp(x * scale, -448, 448).to(float8_e4m3fn)` and the
reciprocal `1 / scale` that `torch._scaled_mm` multiplies the product by. The values are those
of `core.fp8.quantize` on the same tensor, bit for bit.

On CUDA the formula runs TorchInductor-compiled (one Triton kernel for row scales, a reduction
and a cast for a tensor scale) instead of five eager passes over the activation, under the
`TESSERA_FUSED_KERNELS` switch of `core.fused` (`off` runs eager; a failed compile falls back
to eager once, with a warning, unless the mode is `on`). Every constant is a Python number, so
no tensor is built from host data and nothing waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tessera.core import fused

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
_TINY = 1e-30  # amax floor, so the division below never sees 0 (those rows take scale 1)


def quantize_activation_eager(x: torch.Tensor, rowwise: bool
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale_inv)`: `q (M, K)` e4m3, `scale_inv` fp32 of shape `(M, 1)` (rowwise) or `()`."""
    amax = (x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()).float()
    ok = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(ok, torch.full_like(amax, E4M3_MAX) / amax.clamp(min=_TINY),
                        torch.ones_like(amax))
    q = (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.reciprocal()


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


# Compiled on CUDA, training or not. Dynamic shapes from the start: a model's linears take
# inputs of two widths (hidden, ffn), and M varies.
quantize_activation = fused.fusable(quantize_activation_eager, when=_on_cuda, dynamic=True)
quantize_activation.__doc__ = "`quantize_activation_eager`, compiled on CUDA (see the module doc)."


def compiled_quantize_activation() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The compiled `quantize_activation_eager` on any device (benches and tests)."""
    return quantize_activation.compiled()
