"""Paged decode attention (`core.paged_attention`) equals dense attention over each row's
prefix laid out contiguously: the gather kernel (the CPU path) and FlexAttention's block-mask
kernel (run uncompiled here: torch's reference implementation of the same mask)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.core.paged_attention import block_owners, paged_decode_attention

BLOCK, NUM_BLOCKS, KV_HEADS, HEADS, DIM = 4, 24, 2, 6, 8


def _case(seed: int):
    """A pool, rows of 1 to 17 tokens in scattered blocks (tables padded with the scratch
    block 0), their dense prefixes and queries."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=g)
    values = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=g)
    lengths = [1, 17, 6, 12]
    free = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()  # block 0: scratch
    width = -(-max(lengths) // BLOCK) + 1  # one padding entry past the longest row
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    dense_k, dense_v = [], []
    for r, n in enumerate(lengths):
        held = [free.pop() for _ in range(-(-n // BLOCK))]
        tables[r, :len(held)] = torch.tensor(held)
        dense_k.append(keys[held].reshape(-1, KV_HEADS, DIM)[:n].transpose(0, 1))
        dense_v.append(values[held].reshape(-1, KV_HEADS, DIM)[:n].transpose(0, 1))
    q = torch.randn(len(lengths), HEADS, 1, DIM, generator=g)
    return q, keys, values, tables, torch.tensor(lengths) - 1, dense_k, dense_v


def _dense(q, dense_k, dense_v):
    return torch.cat([F.scaled_dot_product_attention(q[r:r + 1], k[None], v[None],
                                                     enable_gqa=True)
                      for r, (k, v) in enumerate(zip(dense_k, dense_v))])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", ["gather", "flex"])
def test_paged_decode_attention_equals_dense_attention(kernel):
    for seed in range(3):
        q, keys, values, tables, positions, dense_k, dense_v = _case(seed)
        out = paged_decode_attention(q, keys, values, tables, positions, kernel)
        torch.testing.assert_close(out, _dense(q, dense_k, dense_v), atol=1e-5, rtol=1e-5)


def test_block_owners_and_bad_input():
    tables = torch.tensor([[3, 1, 0, 0], [2, 0, 0, 0]])
    owners = block_owners(tables, 5)
    assert owners[0, 3] == 0 and owners[0, 1] == 1 and owners[1, 2] == 0
    assert owners[0, 4] == -1 and owners[1, 1] == -1 and owners[0, 0] >= 2
    q, keys, values, tables, positions, _, _ = _case(0)
    with pytest.raises(ValueError, match="unknown paged attention kernel 'fast'"):
        paged_decode_attention(q, keys, values, tables, positions, "fast")
    with pytest.raises(ValueError, match="one query per row"):
        paged_decode_attention(q.expand(-1, -1, 2, -1), keys, values, tables, positions)
