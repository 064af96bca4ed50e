"""Tensor-parallel building blocks: column/row parallel linears, the vocabulary-parallel
embedding, and the vocabulary-parallel cross-entropy.

Layers are created with *local* shapes (see `sharding.local_shape`) and take the tp group
explicitly; with `tp_group=None` each is a plain layer. Activations are `(T, B, C)`.
"""

from __future__ import annotations

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


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with W split by rows (output features) over the tp group.

    The input is replicated (or, under sequence parallelism, sequence-sharded and gathered
    here); the output stays split along its last dimension.
    """

    def __init__(self, in_features: int, out_local: int, bias: bool, tp_group: Group,
                 sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features))
        self.bias = nn.Parameter(torch.empty(out_local)) if bias else None
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.tp_group,
                                      self.sequence_parallel)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           tp_group: Group, sequence_parallel: bool) -> torch.Tensor:
    """The column-parallel product for a weight held elsewhere (e.g. a tied embedding)."""
    x = gather_from_sequence(x, tp_group) if sequence_parallel else copy_to_tp(x, tp_group)
    return _product(x, weight, bias)


def _product(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # A quantized weight (`core.quantize.Int8Weight`, serving only) brings its own product.
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight.linear(x, bias)


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with W split by columns (input features); partial sums are reduced here.

    Under sequence parallelism the reduction is a reduce-scatter along the sequence. The bias
    is replicated and added once, after the reduction.
    """

    def __init__(self, in_local: int, out_features: int, bias: bool, tp_group: Group,
                 sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # its gradient is partial per sequence chunk
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _product(x, self.weight)
        y = (reduce_scatter_to_sequence(y, self.tp_group) if self.sequence_parallel
             else reduce_from_tp(y, self.tp_group))
        return y if self.bias is None else y + self.bias


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
