"""How a parallel linear multiplies by its weight (its *weight format*), and which weights may
be stored in a low-precision one.

`ParallelLinear` (`core/parallel/layers.py`) owns the tensor-parallel communication and hands
the local product `x @ W^T (+ b)` to its format, a stateless strategy:
- `Dense`: the weight is a trainable parameter in the model's dtype (`F.linear`);
- `core.fp8.Fp8`: e4m3 weights with fp32 scales (`torch._scaled_mm`, or dequantized);
- `core.quantize.Int8`: weight-only int8 with per-row scales (serving).
The tensors stay on the layer (`weight`, plus `scale` for a quantized format), so a layer's
tensors have the same names under every format, the names FP8 checkpoints store
(`layers.0.attention.wqkv.weight` and `...wqkv.weight.scale` in the file, `wqkv.scale` on the
module). Transformer Engine is not a format: it brings its own communication, so it replaces
whole layers (`core/te_backend.py`), the same layers.

`quantizable(name)` is the one rule for which weights a low-precision format (FP8, int8) or
Transformer Engine may take: the four linear layers of every transformer block (fused QKV,
attention output, MLP in and out). Embeddings, the output projection (tied or not), norms and
biases keep the model's dtype, as FP8 deployment recipes do and as FP8 checkpoints store them.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

_QUANTIZABLE = re.compile(
    r"(^|\.)layers\.\d+\.(attention\.(wqkv|wo)|feed_forward\.(w1|w2))\.weight$")


def quantizable(name: str) -> bool:
    """True for a weight that may take a low-precision format: `wqkv`, `wo`, `w1`, `w2` of a
    block, by global parameter name (a prefix such as `module.` is allowed)."""
    return _QUANTIZABLE.search(name) is not None


class WeightFormat(ABC):
    """The local product of a linear layer, reading the layer's `weight` (and `scale`)."""

    name: str

    @abstractmethod
    def linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
        """`x @ W^T (+ bias)` in `x.dtype`, for `x (..., in_local)` and `layer.weight`'s W."""

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class Dense(WeightFormat):
    """A plain weight in the activations' dtype: what every model is built with."""

    name = "dense"

    def linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


DENSE = Dense()
