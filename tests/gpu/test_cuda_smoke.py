"""CUDA smoke test: bf16 matmul and SDPA run and agree with fp32 math.

Everything under tests/gpu is marked `gpu` by tests/conftest.py and skipped without CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def test_bf16_matmul_and_causal_sdpa_on_cuda():
    dev = torch.device("cuda")
    a = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)
    b = torch.randn(128, 32, device=dev, dtype=torch.bfloat16)
    torch.testing.assert_close((a @ b).float(), a.float() @ b.float(), rtol=2e-2, atol=0.25)

    B, nh, T, hs = 2, 4, 16, 32
    q, k, v = (
        torch.randn(B, nh, T, hs, device=dev, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
    att = (q.float() @ k.float().transpose(-2, -1)) / hs**0.5
    att = att.masked_fill(torch.ones(T, T, device=dev).triu(1).bool(), float("-inf"))
    ref = att.softmax(-1) @ v.float()
    assert y.shape == (B, nh, T, hs) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()  # the backward kernels run too
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
