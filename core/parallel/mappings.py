"""The conjugate autograd functions of Megatron-style tensor and sequence parallelism.

Each forward collective is paired with its adjoint in backward (Shoeybi et al. 2019, "Megatron-LM";
Korthikanti et al. 2022, "Reducing Activation Recomputation"):

| function                  | forward                     | backward                    |
|---------------------------|-----------------------------|-----------------------------|
| copy_to_tp                | identity                    | all-reduce                  |
| reduce_from_tp            | all-reduce                  | identity                    |
| gather_from_tp (last dim) | all-gather                  | split                       |
| scatter_to_sequence       | split along dim 0           | all-gather along dim 0      |
| gather_from_sequence      | all-gather along dim 0      | reduce-scatter along dim 0  |
| reduce_scatter_to_sequence| reduce-scatter along dim 0  | all-gather along dim 0      |

Activations are laid out `(T, B, C)` so the sequence dimension is dim 0, the only dimension gloo
concatenates on. With a `None` group (size 1) every function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * n, *x.shape[1:]))
    # Sized (n * rows, ...): gloo rejects the stacked (n, rows, ...) output form.
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"dim 0 of size {x.shape[0]} does not split over {n} ranks")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _split_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} does not split over {n} ranks")
    return x.chunk(n, dim=0)[dist.get_rank(group)].contiguous()


def _all_gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    moved = x.movedim(-1, 0)
    return _all_gather_dim0(moved, group).movedim(0, -1).contiguous()


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return x
    return x.chunk(n, dim=-1)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient."""
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results over the group."""
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate last-dimension shards (e.g. vocab-parallel logits) over the group."""
    return x if _size(group) == 1 else _GatherFromTP.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's chunk of the sequence (dim 0)."""
    return x if _size(group) == 1 else _ScatterToSequence.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather sequence chunks (dim 0) before a column-parallel layer under SP."""
    return x if _size(group) == 1 else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence chunk, after a row-parallel layer."""
    return x if _size(group) == 1 else _ReduceScatterToSequence.apply(x, group)


def all_gather_sequence_no_grad(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along dim 0 outside autograd (inference paths)."""
    return _all_gather_dim0(x, group)
