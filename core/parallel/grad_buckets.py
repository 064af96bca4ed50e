"""Gradient averaging in flat buffers, shared by the dense and the expert-parallel reductions."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


def average_gradients(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None,
                      divisor: int) -> None:
    """Divide every gradient by `divisor` and sum it over `group` (None: this rank alone), one
    flat buffer per dtype (one collective each, not one per tensor). A parameter without a
    gradient gets zeros first, so every rank of `group` reduces buffers of the same layout."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for bucket in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        flat.div_(divisor)
        if group is not None:
            dist.all_reduce(flat, group=group)
        for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(g.view_as(p.grad))
