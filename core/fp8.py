"""FP8 (e4m3) weights: quantization with per-tensor or per-output-channel scales, and the
`convert_to_fp8_linear` module swap that runs a model on them.

Stored form: `q = clamp(w * scale, -448, 448).to(float8_e4m3fn)` with `scale = 448 / amax`
(fp32; a tensor of shape `()` per tensor, or `(out, 1)` per output channel), so that
`w ~= q.float() / scale`. The amax is always the *global* one (over every tensor-parallel
shard), so every layout holds the same `q` and `scale` values and resharding stays bit-exact;
`sharding.shard_scale` says how a scale is split. Which weights are FP8 is decided once, by
`is_fp8_weight`: the four linear layers of every block. Embeddings, the output projection,
norms and biases keep the higher-precision dtype, as FP8 deployment recipes do.

At run time `Fp8Linear` keeps `q` and `scale` and multiplies with `torch._scaled_mm` (inputs
quantized on the fly) on GPUs with FP8 tensor cores (per-tensor scales from compute capability
8.9, Ada; per-channel scales from 9.0, Hopper); elsewhere it dequantizes the weight for each
product. `_scaled_mm` also runs on CPU when asked (`use_scaled_mm=True`), which tests use.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.core.parallel.layers import ColumnParallelLinear, RowParallelLinear
from tessera.core.parallel.mappings import (
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448

_FP8_WEIGHT = re.compile(r"(^|\.)layers\.\d+\.(attention\.(wqkv|wo)|feed_forward\.(w1|w2))\.weight$")


def is_fp8_weight(name: str) -> bool:
    """True for the weights stored and run in FP8: `wqkv`, `wo`, `w1`, `w2` of every block."""
    return _FP8_WEIGHT.search(name) is not None


def weight_amax(weight: torch.Tensor, per_channel: bool = False) -> torch.Tensor:
    """The fp32 amax a scale is made from: `()` per tensor, `(out, 1)` per output channel."""
    w = weight.abs()
    return (w.amax(dim=-1, keepdim=True) if per_channel else w.amax()).float()


def quantize(weight: torch.Tensor, per_channel: bool = False, amax: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` for a 2-D weight; zeros map to scale 1 so nothing divides by zero.

    `amax` overrides the weight's own (e.g. the global amax of a tensor-parallel shard).
    """
    amax = weight_amax(weight, per_channel) if amax is None else amax.float()
    scale = torch.where(amax > 0, E4M3_MAX / amax.clamp(min=1e-12), torch.ones_like(amax))
    q = (weight.float() * scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """The higher-precision weight `q / scale` in `dtype`."""
    return (q.float() / scale.float()).to(dtype)


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ (q / scale)^T` with `torch._scaled_mm`: `x (..., in)` is quantized on the fly.

    On CUDA, per-tensor weight scales pair with a per-tensor input scale and per-channel ones
    with per-row input scales (the rowwise mode, which returns bf16). On CPU the rowwise mode
    is always used: torch's CPU kernel for tensorwise scales is hundreds of times slower.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rowwise = scale.dim() > 0 or not x.is_cuda
    xq, x_scale = quantize(x.reshape(-1, k), per_channel=rowwise)  # x_scale: () or (M, 1)
    w_scale = scale.reshape(1, -1).expand(1, q.shape[0]) if rowwise else scale  # () or (1, out)
    out_dtype = torch.bfloat16 if rowwise and x.is_cuda else x.dtype
    y = torch._scaled_mm(xq, q.t(), scale_a=x_scale.reciprocal(), scale_b=w_scale.reciprocal(),
                         out_dtype=out_dtype)
    return y.to(x.dtype).reshape(*lead, q.shape[0])


def _fp8_tensor_cores(device: torch.device, rowwise: bool) -> bool:
    """FP8 `_scaled_mm` kernels: tensorwise from Ada (8.9), rowwise from Hopper (9.0)."""
    need = (9, 0) if rowwise else (8, 9)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= need


class Fp8Linear(nn.Module):
    """A column-parallel, row-parallel or plain linear layer holding FP8 weights.

    Buffers `weight` (float8_e4m3fn, the local shard) and `scale` (fp32) replace the weight
    parameter; the bias (if any) stays a parameter in the activation dtype. The tensor-parallel
    communication is the same as the layer it replaces.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None,
                 parallel: str = "none", tp_group=None, sequence_parallel: bool = False,
                 use_scaled_mm: bool | None = None):
        super().__init__()
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)
        self.bias = bias
        self.parallel, self.tp_group, self.sequence_parallel = parallel, tp_group, sequence_parallel
        self.use_scaled_mm = use_scaled_mm  # None: decide per device (FP8 tensor cores or not)

    def extra_repr(self) -> str:
        gran = "tensor" if self.scale.dim() == 0 else "channel"
        return (f"out={self.weight.shape[0]}, in={self.weight.shape[1]}, parallel={self.parallel}, "
                f"scale={gran}, scaled_mm={self.use_scaled_mm}")

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        use = self.use_scaled_mm
        if use is None:  # the CUDA kernels want both matrix dims in multiples of 16
            use = (_fp8_tensor_cores(x.device, self.scale.dim() > 0)
                   and x.shape[-1] % 16 == 0 and self.weight.shape[0] % 16 == 0)
        if use:
            y = scaled_mm_linear(x, self.weight, self.scale)
            return y if bias is None else y + bias
        return F.linear(x, dequantize(self.weight, self.scale, x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, sp = self.tp_group, self.sequence_parallel
        if self.parallel == "column":
            x = gather_from_sequence(x, g) if sp else copy_to_tp(x, g)
        if self.parallel != "row":
            return self._matmul(x, self.bias)
        y = self._matmul(x, None)
        y = reduce_scatter_to_sequence(y, g) if sp else reduce_from_tp(y, g)
        return y if self.bias is None else y + self.bias

    @classmethod
    @torch.no_grad()
    def from_linear(cls, layer: nn.Module, per_channel: bool = False,
                    use_scaled_mm: bool | None = None) -> Fp8Linear:
        """Quantize `layer` (Column/RowParallelLinear or nn.Linear) with its global amax."""
        parallel = ("column" if isinstance(layer, ColumnParallelLinear) else
                    "row" if isinstance(layer, RowParallelLinear) else "none")
        group = getattr(layer, "tp_group", None)
        amax = weight_amax(layer.weight, per_channel)
        # Rows are whole on every rank except under a row-parallel split: per-channel amaxes of
        # column-parallel shards are already global, everything else needs the max over tp.
        if group is not None and (not per_channel or parallel == "row"):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        q, scale = quantize(layer.weight, per_channel, amax)
        bias = layer.bias
        if bias is not None:
            bias.requires_grad_(False)
        return cls(q, scale, bias, parallel, group, getattr(layer, "sequence_parallel", False),
                   use_scaled_mm)


def convert_to_fp8_linear(model: nn.Module, per_channel: bool = False,
                          use_scaled_mm: bool | None = None) -> nn.Module:
    """Swap every linear layer `is_fp8_weight` names for an `Fp8Linear`, in place (inference).

    Collective under tensor parallelism (the amax is reduced over each layer's tp group), so
    every layout gets the same FP8 values a converted checkpoint stores. A model loaded from an
    FP8 checkpoint (dequantized) is quantized back to the stored `q`; its scales agree to within
    rounding.
    """
    for name, module in list(model.named_modules()):
        if not is_fp8_weight(f"{name}.weight"):
            continue
        if not isinstance(module, nn.Linear | ColumnParallelLinear | RowParallelLinear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.from_linear(module, per_channel, use_scaled_mm))
    return model
