"""Tensors taken off the device (or out of the training state) for a checkpoint writer."""

from __future__ import annotations

import torch


def host_copy(tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """`tensor` contiguous in host memory. With `copy`, always a new tensor (a device tensor
    lands in pinned memory, copied without waiting: call `torch.cuda.synchronize()` before
    reading it); without, a host tensor that is already contiguous is returned as is."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.clone(memory_format=torch.contiguous_format) if copy else \
            tensor.contiguous()
    if not copy:
        return tensor.to("cpu").contiguous()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    return out
