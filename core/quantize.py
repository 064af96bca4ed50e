"""Quantized weights for serving: weight-only int8 (this module) or FP8 e4m3 (`core.fp8`).

`quantize(model, "fp8")` quantizes to e4m3 with one fp32 scale per output channel (the
per-channel FP8 of vLLM's compressed-tensors format: `weight_scale` of shape `(out, 1)`), and
the product is W8A8: the activations are quantized per row on the fly and multiplied with
`torch._scaled_mm` on GPUs whose FP8 tensor cores take row scales (Hopper, compute capability
9.0); elsewhere the weight is dequantized for each product (W8A16). See `core.fp8`.

Weight-only int8: int8 weights, one bf16 scale per output channel.

Decoding a token reads every weight once, so at small batch its time is the weight bytes over
the memory bandwidth. Int8 weights are a quarter of fp32 and half of bf16. This is for latency
at low concurrency: with many rows per step the int8 kernel loses to a plain bf16 model. On CPU,
`torch._weight_int8pack_mm` multiplies bf16 activations by int8 weights without materialising
a dequantized copy (measured on this project's 2-core machine: a 512x3072 product in 39 us
against 107 us in fp32); elsewhere the weight is dequantized per call, correct but not faster.

Quantization is symmetric per output row: `scale = max|w_row| / 127`, `q = round(w / scale)`.
Under tensor parallelism each rank quantizes its own shard, so a row-parallel weight gets one
scale per row of each shard: every partial sum is still exact to its own scales.

What is quantized: the weights `weight_format.quantizable` names, the same as FP8 and
Transformer Engine: the matrices of every block (fused QKV, attention output, MLP). The output
layer, embeddings, norms and biases keep the model's dtype. Activations run in bf16 (the CPU
kernel takes bf16 activations; it is 10x slower with fp32 ones). A quantized layer is a
`ParallelLinear` in the `Int8` weight format, which does its tensor-parallel communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.core.fp8 import convert_to_fp8_linear, fp8_tensor_cores
from tessera.core.parallel.layers import quantizable_linears
from tessera.core.parallel.weight_format import Dense, WeightFormat

QUANTIZE_CHOICES = ("none", "int8", "fp8")
KERNEL_MAX_ROWS = 24  # rows (tokens) above which dequantizing is faster than the int8 kernel


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` for an `(out, in)` weight: int8 `q`, one `scale_dtype` scale per row."""
    w = weight.detach().float()
    exact = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(scale_dtype).tiny)
    # Quantize with the scale as stored, rounded up so no |w| maps past 127: then every
    # weight is within half a step of its int8 value.
    scale = exact.to(scale_dtype)
    low = scale.float() < exact
    scale[low] = torch.nextafter(scale[low], torch.full_like(scale[low], float("inf")))
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """The weight `q * scale` (per row) in `dtype`."""
    return (q.to(torch.float32) * scale.float()[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T (+ bias)` in `x.dtype` for `x (..., in)` and the int8 weight `(q, scale)`."""
    flat = x.reshape(-1, x.shape[-1])
    # torch 2.13's CPU kernel reads past the rows when in_features % 16 != 0 (a crash, or
    # NaNs): those shapes take the dequantized path. Its cost also grows with the rows (on
    # the 2-core machine: 43 us for 1 row, 316 us for 16, of a 512x3072 weight, against
    # ~420 us to dequantize and multiply in bf16), so many rows dequantize too.
    if flat.device.type == "cpu" and flat.dtype == scale.dtype \
            and flat.shape[-1] % 16 == 0 and flat.shape[0] <= KERNEL_MAX_ROWS:
        y = torch._weight_int8pack_mm(flat.contiguous(), q, scale)
    else:
        y = F.linear(flat, dequantize_int8(q, scale, flat.dtype))
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


class Int8(WeightFormat):
    """Weight-only int8: `layer.weight` holds int8 `q (out, in_local)`, `layer.scale` its
    per-row scales (`int8_linear`)."""

    name = "int8"

    def linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
        return int8_linear(x, layer.weight, layer.scale, bias)


INT8 = Int8()


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Quantize, in place, every dense linear `quantizable` names to int8; returns `model`,
    ready for inference only (the int8 weights have no gradients)."""
    for _, layer in quantizable_linears(model):
        if isinstance(layer.format, Dense):
            layer.set_format(INT8, *quantize_int8(layer.weight))
    return model


def product(method: str, device: torch.device | str) -> str:
    """How the quantized layers of `method` multiply on `device`, for the start-up line."""
    if method == "int8":
        return "weight-only int8, bf16 activations"
    if method == "fp8":
        return ("W8A8: per-row FP8 activations, torch._scaled_mm"
                if fp8_tensor_cores(device, rowwise=True)
                else "W8A16: FP8 weights dequantized per product, no row-scaled FP8 kernel here")
    return "unquantized"


def quantize(model: nn.Module, method: str) -> nn.Module:
    """`quantize_int8_` for "int8", per-channel FP8 (`core.fp8.convert_to_fp8_linear`) for
    "fp8", `model` as is for "none"; any other name is an error. Collective under tensor
    parallelism for "fp8" (the scales come from global amaxes)."""
    if method == "none":
        return model
    if method == "int8":
        return quantize_int8_(model)
    if method == "fp8":
        return convert_to_fp8_linear(model, per_channel=True)
    raise ValueError(f"unknown quantization {method!r}; choose one of {QUANTIZE_CHOICES}")
