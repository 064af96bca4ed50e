"""Host-to-device copies that do not stall the host.

A copy from ordinary (pageable) host memory to a GPU waits until the GPU has the data; one from
pinned (page-locked) memory with `non_blocking=True` is queued on the stream and returns at once.
The caching host allocator keeps the pinned buffer alive until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`: through pinned memory without waiting when it goes from the CPU to
    a CUDA device, else an ordinary `.to` (a no-op when it is there already)."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy `src` into `dst` (of its size, on any device), through pinned memory without
    waiting when it goes from the CPU to a CUDA device; returns `dst`."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        return dst.copy_(src.pin_memory(), non_blocking=True)
    return dst.copy_(src)
