"""Which SDPA kernels attention may use, where torch's own choice is the wrong one.

Decoding with a KV cache meets a new key length at every step. On Hopper with torch 2.11 and
cuDNN 9, SDPA prefers cuDNN's kernel, which builds an execution plan per new shape: the first
pass over a 128-token decode ran at 14.8 tok/s on an H200 and the same request again, on
lengths already planned, at 68.7 tok/s (bench/results/gpu_check-NVIDIA-H200-2026-11-27-run1.md).
Flash and memory-efficient attention launch the same kernel for any length. Training keeps
torch's choice: its shapes are fixed, and there cuDNN measured 1.6x faster than flash.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.nn.attention import SDPBackend, sdpa_kernel

# Without cuDNN; math last, for what the fused kernels refuse (e.g. fp32 masks on some GPUs).
CACHED_DECODE = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def cached_attention_backends() -> Iterator[None]:
    """The SDPA kernels attention over a KV cache runs with (`CACHED_DECODE`)."""
    with sdpa_kernel(CACHED_DECODE):
        yield
