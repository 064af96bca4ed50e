"""Tensor-parallel building blocks: the column/row parallel linear (one class, its product
delegated to a weight format), the vocabulary-parallel embedding, and the vocabulary-parallel
cross-entropy.

Layers are created with *local* shapes (see `sharding.local_shape`) and take the tp group
explicitly; with `tp_group=None` each is a plain layer. Activations are `(T, B, C)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.core import fused
from tessera.core.parallel.mappings import (
    Group,
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)
from tessera.core.parallel.weight_format import DENSE, WeightFormat, quantizable


class ParallelLinear(nn.Module):
    """`y = x W^T + b`, tensor-parallel by `parallel` ("column" or "row"), the product done by
    the layer's weight format (`format`, see `weight_format.py`; dense when built).

    The communication is written here once, for every format:
    - column: W split by rows (output features). The input is replicated (or, under sequence
      parallelism, sequence-sharded and all-gathered here); the output stays split along its
      last dimension, with the bias split the same way.
    - row: W split by columns (input features). Partial sums are all-reduced (under sequence
      parallelism, reduce-scattered along the sequence); the bias is replicated and added once,
      after the reduction.
    With `tp_group=None` either is a plain linear layer.

    `adapter` (None, or set by `core.lora.attach_lora`) is a callable `(layer, x) -> term` added
    to the local product before any reduction: for a row-parallel layer it then joins the
    partial sums the layer reduces anyway, so it costs no communication of its own.
    """

    def __init__(self, in_local: int, out_local: int, bias: bool, parallel: str,
                 tp_group: Group, sequence_parallel: bool = False):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
        self.weight = nn.Parameter(torch.empty(out_local, in_local))
        self.bias = nn.Parameter(torch.empty(out_local)) if bias else None
        self.parallel, self.tp_group, self.sequence_parallel = parallel, tp_group, sequence_parallel
        self.format: WeightFormat = DENSE
        self.adapter: Callable[[ParallelLinear, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "column":
            return self._product(_column_input(x, self.tp_group, self.sequence_parallel),
                                 self.bias)
        y = _row_output(self._product(x, None), self.tp_group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The local product, plus the adapter's term when one is attached."""
        y = self.format.linear(self, x, bias)
        return y if self.adapter is None else y + self.adapter(self, x)

    @torch.no_grad()
    def set_format(self, fmt: WeightFormat, weight: torch.Tensor,
                   scale: torch.Tensor | None = None) -> None:
        """Hold `weight` (this rank's shard, as `fmt` stores it) and its `scale`, multiplied by
        `fmt` from now on. For inference: the weight becomes a buffer and the bias (kept in the
        model's dtype) stops taking gradients."""
        if weight.shape != self.weight.shape:
            raise ValueError(f"a {fmt.name} weight of shape {tuple(weight.shape)} cannot replace "
                             f"one of shape {tuple(self.weight.shape)}")
        del self.weight  # a parameter slot cannot hold a buffer
        self.register_buffer("weight", weight)
        if scale is not None:
            self.register_buffer("scale", scale)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.format = fmt

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return (f"in_local={inp}, out_local={out}, bias={self.bias is not None}, "
                f"parallel={self.parallel}, format={self.format!r}")


class ColumnParallelLinear(ParallelLinear):
    """A column-parallel `ParallelLinear`: `in_features` whole, `out_local` of them per rank."""

    def __init__(self, in_features: int, out_local: int, bias: bool, tp_group: Group,
                 sequence_parallel: bool = False):
        super().__init__(in_features, out_local, bias, "column", tp_group, sequence_parallel)


class RowParallelLinear(ParallelLinear):
    """A row-parallel `ParallelLinear`: `in_local` input features per rank, outputs whole."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp_group: Group,
                 sequence_parallel: bool = False):
        super().__init__(in_local, out_features, bias, "row", tp_group, sequence_parallel)
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # its gradient is partial per sequence chunk


def _column_input(x: torch.Tensor, tp_group: Group, sequence_parallel: bool) -> torch.Tensor:
    """Enter a column-parallel product: all-gather the sequence (SP) or copy (identity)."""
    return gather_from_sequence(x, tp_group) if sequence_parallel else copy_to_tp(x, tp_group)


def _row_output(y: torch.Tensor, tp_group: Group, sequence_parallel: bool) -> torch.Tensor:
    """Leave a row-parallel product: reduce-scatter along the sequence (SP) or all-reduce."""
    return (reduce_scatter_to_sequence(y, tp_group) if sequence_parallel
            else reduce_from_tp(y, tp_group))


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           tp_group: Group, sequence_parallel: bool) -> torch.Tensor:
    """The column-parallel product for a dense weight held elsewhere (the output projection,
    which may be the tied embedding table)."""
    return F.linear(_column_input(x, tp_group, sequence_parallel), weight, bias)


def plain_linear(linear: nn.Linear) -> ColumnParallelLinear:
    """A single-rank `ParallelLinear` sharing `linear`'s weight and bias (to give a plain
    `nn.Linear` a weight format)."""
    layer = ColumnParallelLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                 None)
    layer.weight = linear.weight
    layer.bias = linear.bias
    return layer


def quantizable_linears(model: nn.Module) -> list[tuple[str, ParallelLinear]]:
    """`(module name, layer)` of every linear of `model` whose weight `quantizable` names, in
    module order: the layers FP8, int8 and Transformer Engine convert."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, ParallelLinear) and quantizable(f"{name}.weight")]


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split into contiguous row blocks per rank."""

    def __init__(self, rows_local: int, dim: int, tp_rank: int, tp_group: Group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows_local, dim))
        self.start = tp_rank * rows_local
        self.tp_group = tp_group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp_group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, without gathering them."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, ignore_index):
        logits = logits.float()
        n_local = logits.shape[-1]
        # Columns past the true vocabulary are TP padding: they must get zero probability.
        pad_from = vocab_size - vocab_start
        if pad_from < n_local:
            logits = logits.clone()
            logits[:, max(pad_from, 0):] = float("-inf")
        logits_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local_target = target - vocab_start
        in_range = (local_target >= 0) & (local_target < n_local)
        safe_target = local_target.masked_fill(~in_range, 0)
        rows = torch.arange(shifted.shape[0], device=shifted.device)
        predicted = shifted[rows, safe_target].masked_fill(~in_range, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            # One all-reduce for both sums.
            both = torch.stack([predicted, sum_exp])
            dist.all_reduce(both, group=group)
            predicted, sum_exp = both[0], both[1]
        loss = sum_exp.log() - predicted
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe_target, in_range & ~ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_target, hit, ignored = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, safe_target] -= hit.to(grad.dtype)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Group,
    tp_rank: int,
    vocab_size: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token losses (fp32, 0 where `target == ignore_index`) from vocab-parallel logits.

    `logits` is `(N, V_local)` on each tp rank (rank r holds padded-vocabulary columns
    `[r * V_local, (r + 1) * V_local)`), `target` is `(N,)` global token ids.
    """
    if tp_group is None and logits.shape[-1] == vocab_size:
        # One rank, no padding: log-softmax + NLL, compiled into few passes when training.
        return fused.cross_entropy(logits, target, ignore_index)
    vocab_start = tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, vocab_start, vocab_size,
                                            ignore_index)
