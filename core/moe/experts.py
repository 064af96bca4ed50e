"""The routed experts: every local expert's MLP over its contiguous rows, in one grouped GEMM.

`GroupedExperts(xs (m, h), counts (E_local,))` takes the token copies grouped by expert (the
first `counts[0]` rows go to local expert 0, and so on: what a dispatcher returns) and applies
expert e's `w2[e] @ act(w1[e] @ x)` to its rows. Weights are stacked: `w1 (E, F * (2 if gated
else 1), h)` with `[gate; up]` along dim 1, `w2 (E, h, F)` (names in `core.moe.shapes`).

Two paths computing the same products:
- `torch._grouped_mm(xs, w^T, offs=cumsum(counts))`: one call for all experts. It runs on CPU
  (torch >= 2.8) and on CUDA (bf16, sm90+), and needs 16-byte aligned row strides, so the hidden
  and FFN sizes times the element size must be multiples of 16 bytes (`grouped_mm_supported`);
- a loop over experts (`F.linear` per expert): the fallback, and the reference.
On CPU in torch 2.13 both give bit-identical results in fp32 and bf16 (checked by the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.core import fused


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The MLP nonlinearity (as `core.models.decoder.model.MLP`): SwiGLU over `[gate, up]`,
    squared ReLU, GELU."""
    if activation == "swiglu":
        return fused.swiglu(h)
    if activation == "squared_relu":
        return F.relu(h).square()
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    return F.gelu(h)


def grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` can multiply `x (m, h)` by each of `weights (E, out, in)`
    (transposed) here: the op exists, the dtype and device take it, strides are 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    elif x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # the op's shape function (what torch.compile traces with) takes only bf16
    size = x.element_size()
    dims = {x.shape[-1]} | {d for w in weights for d in w.shape[1:]}
    # An activation halves the gated w1 output: its half must be aligned too.
    dims |= {d // 2 for w in weights[:1] for d in w.shape[1:2]}
    return all(d * size % 16 == 0 for d in dims)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: `_grouped_mm`'s backward
    rejects expanded (stride-0) gradients, such as the one of a plain `.sum()`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`(m, out)`: rows `[offsets[e-1], offsets[e])` of `x (m, in)` times `weight[e]^T`."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets))


def looped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The per-expert loop form of `grouped_linear` (`counts` rows per expert)."""
    chunks = x.split(counts)
    return torch.cat([F.linear(chunk, weight[e]) for e, chunk in enumerate(chunks)])


class GroupedExperts(nn.Module):
    """The local experts' stacked weights and their grouped forward.

    `use_grouped_mm`: None picks `torch._grouped_mm` where it runs (`grouped_mm_supported`),
    False forces the per-expert loop, True forces the grouped op (an error where it cannot run).
    """

    def __init__(self, num_experts: int, hidden: int, ffn: int, activation: str,
                 use_grouped_mm: bool | None = None):
        super().__init__()
        self.activation, self.use_grouped_mm = activation, use_grouped_mm
        rows = ffn * (2 if activation == "swiglu" else 1)
        self.w1 = nn.Parameter(torch.empty(num_experts, rows, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def grouped(self, xs: torch.Tensor) -> bool:
        """Whether the forward of `xs` takes the grouped-GEMM path."""
        if self.use_grouped_mm is None:
            return grouped_mm_supported(xs, self.w1, self.w2)
        return self.use_grouped_mm

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        device = xs.device.type
        if torch.is_autocast_enabled(device):  # as F.linear would, for both paths alike
            xs = xs.to(torch.get_autocast_dtype(device))
        w1, w2 = self.w1.to(xs.dtype), self.w2.to(xs.dtype)  # no-ops unless under autocast
        if self.grouped(xs):
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            h = activate(grouped_linear(xs, w1, offsets), self.activation)
            return grouped_linear(h, w2, offsets)
        return looped_experts(xs, w1, w2, counts, self.activation)


# Eager even inside a compiled block: the loop's shapes are the token counts per expert, which
# change every step, so a traced loop would be recompiled for each new set of counts.
@torch.compiler.disable
def looped_experts(xs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                   activation: str) -> torch.Tensor:
    """The experts' MLPs over `xs` by the per-expert loop (`counts` rows per expert)."""
    sizes = counts.tolist()
    h = activate(looped_linear(xs, w1, sizes), activation)
    return looped_linear(h, w2, sizes)
