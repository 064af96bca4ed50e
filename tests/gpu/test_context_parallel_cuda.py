"""The ring attention's block kernel and log-sum-exp merge on CUDA against PyTorch's SDPA.

cp ranks cannot share one GPU under NCCL, so the multi-rank parity runs stay on gloo/CPU; here
every cp rank's share is computed in one process on the GPU (zigzag split, blocks in ring order,
merged by their log-sum-exp), and the ring's hand-written backward runs its one-block form.
Marked `gpu` by tests/conftest.py and skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.core.parallel import context_parallel as cpar


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_blocks_merged_on_cuda_equal_sdpa(dtype, cp):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    B, H, Hkv, T, D = 2, 8, 2, 256, 64
    q, k, v = (torch.randn(B, h, T, D, generator=gen, device=dev, dtype=dtype)
               for h in (H, Hkv, Hkv))
    docs = torch.repeat_interleave(torch.arange(3, device=dev),
                                   torch.tensor([100, 60, 96], device=dev)).expand(B, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril() & (
        docs[:, :, None] == docs[:, None, :])
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                          attn_mask=mask[:, None], enable_gqa=True)
    parts = []
    for r in range(cp):
        seq = cpar.sequence_context(T, B, dev, cp_size=cp, cp_rank=r, documents=docs)
        q5 = seq.split(q, 2).float().reshape(B, Hkv, H // Hkv, T // cp, D)
        out = lse = None
        for step in range(cp):
            idx = seq.rank_index((r - step) % cp)
            block = cpar.block_attention(q5, k[:, :, idx].float(), v[:, :, idx].float(),
                                         seq.mask(idx), D ** -0.5)
            out, lse = block if out is None else cpar.merge_partials(out, lse, *block)
        parts.append(out.reshape(B, H, T // cp, D))
    got = cpar.unsplit_sequence(parts, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_ring_backward_on_cuda_matches_sdpa_autograd():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    B, H, Hkv, T, D = 2, 8, 2, 128, 64
    q, k, v = (torch.randn(B, h, T, D, generator=gen, device=dev).requires_grad_()
               for h in (H, Hkv, Hkv))
    docs = torch.repeat_interleave(torch.arange(2, device=dev),
                                   torch.tensor([50, 78], device=dev)).expand(B, T)
    seq = cpar.sequence_context(T, B, dev, documents=docs)
    got = cpar._RingAttention.apply(q, k, v, seq)
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril() & (
        docs[:, :, None] == docs[:, None, :])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g),
                    torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
