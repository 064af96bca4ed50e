"""FP8 (e4m3) weights: quantization with per-tensor or per-output-channel scales, and the
`convert_to_fp8_linear` module swap that runs a model on them.

Stored form: `q = clamp(w * scale, -448, 448).to(float8_e4m3fn)` with `scale = 448 / amax`
(fp32; a tensor of shape `()` per tensor, `(out, 1)` per output channel, or `(out / bo, in / bi)`
per `bo x bi` block), so that `w ~= q.float() / scale`. The Hugging Face FP8 formats store the
reciprocal, a multiplier (`converters.hf_fp8`); block scales exist only for them. The amax
is always the *global* one (over every tensor-parallel shard), so every layout holds the same
`q` and `scale` values and resharding stays bit-exact; `sharding.shard_scale` says how a scale
is split. Which weights are FP8 is decided by the one
rule `weight_format.quantizable`: the four linear layers of every block. Embeddings, the output
projection, norms and biases keep the higher-precision dtype, as FP8 deployment recipes do.

At run time a `ParallelLinear` in the `Fp8` weight format keeps `q` and `scale` and multiplies
with `torch._scaled_mm` (inputs quantized on the fly) on GPUs with FP8 tensor cores (per-tensor
scales from compute capability 8.9, Ada; per-channel scales from 9.0, Hopper); elsewhere it
dequantizes the weight for each product. `_scaled_mm` also runs on CPU when asked
(`use_scaled_mm=True`), which tests use. The layer does the tensor-parallel communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.core.fp8_activation import quantize_activation
from tessera.core.parallel.layers import ParallelLinear, quantizable_linears
from tessera.core.parallel.weight_format import Dense, WeightFormat

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448

Block = tuple[int, int]  # (rows, columns) of one scale block of a 2-D weight


def check_blocks(shape: tuple[int, ...] | torch.Size, block: Block, name: str = "weight") -> None:
    """Raise ValueError unless a 2-D `shape` splits into whole `block`s.

    Ragged edge blocks are refused: transformers' dequantization derives the block size from
    the scale grid (`rows // scale_rows`), which is wrong for a ragged grid.
    """
    rows, cols = shape
    if rows % block[0] or cols % block[1]:
        raise ValueError(f"{name} of shape {tuple(shape)} does not divide into {block[0]}x{block[1]} "
                         f"FP8 blocks; choose a block size that divides every linear layer's "
                         f"dimensions (e.g. --fp8-block 64, 32 or 16), or use --fp8 tensor")


def expand_blocks(scale: torch.Tensor, block: Block) -> torch.Tensor:
    """A `(rows / bo, cols / bi)` block scale repeated to the weight's `(rows, cols)` shape."""
    return scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype: 448 for e4m3fn, 57344 for e5m2."""
    return float(torch.finfo(dtype).max)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype | torch.Tensor, margin: int = 0,
                    previous: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_max / amax / 2**margin` (fp32); where amax is 0 or not finite, `previous` (else 1).

    `dtype` is an FP8 dtype, or a tensor of fp8 maxima broadcasting against `amax`.
    """
    amax = amax.float()
    # A fill on amax's device, not a tensor from a Python number: that would be a host-to-device
    # copy, which waits for the stream, on every call.
    top = (torch.full_like(amax, fp8_max(dtype)) if isinstance(dtype, torch.dtype)
           else dtype.to(device=amax.device, dtype=torch.float32))
    fallback = torch.ones_like(amax) if previous is None else previous.float()
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, top / amax.clamp(min=1e-30) / 2.0 ** margin, fallback)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`clamp(x * scale, -max, max)` cast to `dtype` (e4m3fn or e5m2), computed in fp32.

    The clamp makes both formats saturate (e5m2 would otherwise overflow to inf); NaN stays NaN.
    """
    top = fp8_max(dtype)
    return (x.float() * scale).clamp(-top, top).to(dtype)


def weight_amax(weight: torch.Tensor, per_channel: bool = False, block: Block | None = None
                ) -> torch.Tensor:
    """The fp32 amax a scale is made from: `()` per tensor, `(out, 1)` per output channel,
    `(out / bo, in / bi)` per `block` (which must divide the weight, see `check_blocks`)."""
    w = weight.abs()
    if block is not None:
        check_blocks(w.shape, block)
        rows, cols = w.shape
        return w.reshape(rows // block[0], block[0], cols // block[1], block[1]).amax(
            dim=(1, 3)).float()
    return (w.amax(dim=-1, keepdim=True) if per_channel else w.amax()).float()


def quantize(weight: torch.Tensor, per_channel: bool = False, amax: torch.Tensor | None = None,
             block: Block | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` for a 2-D weight; zeros map to scale 1 so nothing divides by zero.

    `amax` overrides the weight's own (e.g. the global amax of a tensor-parallel shard, or of
    the fused tensor a part was split from). `block`: one scale per `block` of the weight.
    """
    amax = weight_amax(weight, per_channel, block) if amax is None else amax.float()
    scale = scale_from_amax(amax, torch.float8_e4m3fn)
    full = scale if block is None else expand_blocks(scale, block)
    return quantize_fp8(weight, full, torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """The higher-precision weight `q / scale` in `dtype`."""
    return (q.float() / scale.float()).to(dtype)


def weight_scale_inv(scale: torch.Tensor, out_features: int, rowwise: bool) -> torch.Tensor:
    """The `scale_b` `torch._scaled_mm` takes for a weight `(q, scale)`: `1 / scale` as `(1, out)`
    (rowwise) or `()` (tensorwise). Made once per weight (`Fp8` caches it on the layer)."""
    inv = scale.float().reciprocal()
    return inv.reshape(1, -1).expand(1, out_features).contiguous() if rowwise else inv


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     scale_inv: torch.Tensor | None = None, fast_accum: bool = True
                     ) -> torch.Tensor:
    """`x @ (q / scale)^T` with `torch._scaled_mm`: `x (..., in)` is quantized on the fly
    (`core.fp8_activation`: one compiled pass on CUDA, no host sync).

    On CUDA, per-tensor weight scales pair with a per-tensor input scale and per-channel ones
    with per-row input scales (the rowwise mode, which returns bf16). On CPU the rowwise mode
    is always used: torch's CPU kernel for tensorwise scales is hundreds of times slower.
    `scale_inv`: `weight_scale_inv(scale, ...)` when the caller keeps it (else made here).
    `fast_accum`: Hopper's faster FP8 accumulation, which forward products can afford.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rowwise = scale.dim() > 0 or not x.is_cuda
    xq, x_scale_inv = quantize_activation(x.reshape(-1, k), rowwise)  # () or (M, 1)
    if scale_inv is None:
        scale_inv = weight_scale_inv(scale, q.shape[0], rowwise)
    out_dtype = torch.bfloat16 if rowwise and x.is_cuda else x.dtype
    y = torch._scaled_mm(xq, q.t(), scale_a=x_scale_inv, scale_b=scale_inv,
                         out_dtype=out_dtype, use_fast_accum=fast_accum)
    return y.to(x.dtype).reshape(*lead, q.shape[0])


def _cached_scale_inv(layer: nn.Module, rowwise: bool) -> torch.Tensor:
    """`weight_scale_inv` of `layer.scale`, kept on the layer until the scale changes (a load
    writes it in place, which bumps its version; `.to()` gives it new storage). A scale made
    under `torch.inference_mode` has no version counter, so its reciprocal is made per call."""
    scale = layer.scale
    if torch.compiler.is_compiling() or scale.is_inference():
        return weight_scale_inv(scale, layer.weight.shape[0], rowwise)
    key = (scale.data_ptr(), scale._version, scale.device, rowwise)
    cached = getattr(layer, "_fp8_scale_inv", None)
    if cached is None or cached[0] != key:
        cached = (key, weight_scale_inv(scale, layer.weight.shape[0], rowwise))
        layer._fp8_scale_inv = cached
    return cached[1]


def fp8_tensor_cores(device: torch.device | str, rowwise: bool) -> bool:
    """Whether `device` has FP8 `_scaled_mm` kernels: tensorwise from Ada (8.9), rowwise from
    Hopper (9.0)."""
    device = torch.device(device)
    need = (9, 0) if rowwise else (8, 9)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= need


class Fp8(WeightFormat):
    """FP8 e4m3 weights: `layer.weight` holds `q` (the local shard), `layer.scale` its fp32
    scale (`()` per tensor, `(out_local, 1)` per output channel).

    `use_scaled_mm`: True multiplies with `torch._scaled_mm`, False dequantizes the weight for
    each product, None decides per call (the kernel on FP8 tensor cores, when both matrix
    dimensions are multiples of 16 as the CUDA kernels want).
    """

    name = "fp8"

    def __init__(self, use_scaled_mm: bool | None = None):
        self.use_scaled_mm = use_scaled_mm

    def __repr__(self) -> str:
        return f"Fp8(use_scaled_mm={self.use_scaled_mm})"

    def linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
        q, scale = layer.weight, layer.scale
        use = self.use_scaled_mm
        if use is None:
            use = (fp8_tensor_cores(x.device, scale.dim() > 0)
                   and x.shape[-1] % 16 == 0 and q.shape[0] % 16 == 0)
        if use:
            rowwise = scale.dim() > 0 or not x.is_cuda
            y = scaled_mm_linear(x, q, scale, _cached_scale_inv(layer, rowwise))
            return y if bias is None else y + bias
        return F.linear(x, dequantize(q, scale, x.dtype), bias)


@torch.no_grad()
def to_fp8_(layer: ParallelLinear, per_channel: bool = False,
            use_scaled_mm: bool | None = None) -> ParallelLinear:
    """Quantize `layer`'s dense weight in place with its *global* amax; returns `layer`.

    Collective under tensor parallelism: rows are whole on every rank except under a row
    split, so per-channel amaxes of column-parallel shards are already global and everything
    else takes the max over the tp group.
    """
    if not isinstance(layer.format, Dense):
        raise ValueError(f"to_fp8_ quantizes a dense weight; this layer is {layer.format!r}")
    amax = weight_amax(layer.weight, per_channel)
    if layer.tp_group is not None and (not per_channel or layer.parallel == "row"):
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=layer.tp_group)
    q, scale = quantize(layer.weight, per_channel, amax)
    layer.set_format(Fp8(use_scaled_mm), q, scale)
    _cached_scale_inv(layer, rowwise=per_channel or not q.is_cuda)  # made once, at load
    return layer


def convert_to_fp8_linear(model: nn.Module, per_channel: bool = False,
                          use_scaled_mm: bool | None = None) -> nn.Module:
    """Quantize, in place, every linear `quantizable` names to FP8 (inference); returns `model`.

    Collective under tensor parallelism (see `to_fp8_`), so every layout gets the same FP8
    values a converted checkpoint stores. A model loaded from an FP8 checkpoint (dequantized)
    is quantized back to the stored `q`; its scales agree to within rounding.
    """
    for _, layer in quantizable_linears(model):
        to_fp8_(layer, per_channel, use_scaled_mm)
    return model
