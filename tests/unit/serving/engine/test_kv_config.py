"""Sizing the paged KV pool: memory sizes and fractions, and the default."""

import pytest
import torch

from tessera.serving.engine.kv_config import KVCacheConfig, parse_memory, resolve_num_blocks


def test_sizes_and_fractions():
    assert parse_memory("8GiB") == (8 << 30, None)
    assert parse_memory("512 MiB") == (512 << 20, None)
    assert parse_memory(2) == (2 << 30, None)  # a bare number above 1: GiB
    assert parse_memory("0.25") == (None, 0.25)  # at most 1: a fraction of free memory
    for bad in ("0", "-1", "8 parsecs", "lots"):
        with pytest.raises(ValueError, match="kv-cache-memory"):
            parse_memory(bad)
    with pytest.raises(ValueError, match="not one of"):
        KVCacheConfig(kind="pages")


def test_block_counts():
    shape = dict(num_layers=2, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu",
                 max_batch=4, max_seq=100)
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # k and v, layers, heads, tokens, head_dim, bytes
    assert resolve_num_blocks(KVCacheConfig(), **shape) == 4 * 7 + 1
    assert resolve_num_blocks(KVCacheConfig(memory="1MiB"), **shape) == (1 << 20) // per_block
    assert resolve_num_blocks(KVCacheConfig(num_blocks=5), **shape) == 5
    assert resolve_num_blocks(KVCacheConfig(memory="0.5"), **shape) > 2
    with pytest.raises(ValueError, match="at least 2"):
        resolve_num_blocks(KVCacheConfig(memory="1KiB"), **shape)
