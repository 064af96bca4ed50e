"""The paged KV cache reproduces the full forward pass: prefill in chunks then decode, rows of
different lengths through scattered (non-consecutive, out-of-order) blocks, and two rows
reading one shared prefix block."""

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.paged_kv_cache import PagedKVCache

# Learned positions and grouped-query attention (the engine tests cover every family).
FAMILIES = ["gpt2-tiny", "llama-tiny"]


def _cache(model, blocks=16, block_size=4, max_seq=64):
    c = model.config
    return PagedKVCache(model.layer_ids, blocks, block_size, max_seq, c.num_kv_heads, c.head_dim)


@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_chunked_prefill_then_decode_through_scattered_blocks(name):
    model = build_model(ModelConfig.from_name(name), seed=3).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 19))
    full = model(ids)
    cache = _cache(model)
    # Row 0 in blocks 9, 2, 14, 5, 7; row 1 in 3, 1, 12, 6, 11 (block 0: padding's scratch).
    tables = torch.tensor([[9, 2, 14, 5, 7], [3, 1, 12, 6, 11]])
    out = []
    for lo, hi in ((0, 6), (6, 13)):  # two prefill chunks crossing block boundaries
        pos = torch.arange(lo, hi).expand(2, hi - lo)
        out.append(model(ids[:, lo:hi], positions=pos, cache=cache, slots=tables))
    for t in range(13, 19):
        out.append(model(ids[:, t:t + 1], positions=torch.full((2, 1), t), cache=cache,
                         slots=tables))
    torch.testing.assert_close(torch.cat(out, dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_ragged_rows_and_a_shared_prefix_block():
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=4).eval()
    prefix = torch.randint(0, 512, (1, 4))  # exactly one block of 4
    a = torch.cat([prefix, torch.randint(0, 512, (1, 5))], 1)
    b = torch.cat([prefix, torch.randint(0, 512, (1, 2))], 1)
    cache = _cache(model)
    model(a[:, :8], positions=torch.arange(8)[None], cache=cache, slots=torch.tensor([[4, 8]]))
    # b reuses a's first block (4) and computes only its own 2 tokens, next to a's decode;
    # a's padding (position 9) lands in its own partly filled block 13.
    ids = torch.stack([torch.cat([a[0, 8:9], a.new_zeros(1)]), b[0, 4:6]])
    positions = torch.tensor([[8, 9], [4, 5]])
    tables = torch.tensor([[4, 8, 13], [4, 10, 0]])
    out = model(ids, positions=positions, cache=cache, slots=tables)
    torch.testing.assert_close(out[0, 0], model(a)[0, 8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], model(b)[0, 4:], atol=1e-5, rtol=1e-5)


def test_bad_tables_and_a_stale_plan_are_refused():
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=5).eval()
    cache = _cache(model)
    with pytest.raises(ValueError, match="block tables"):
        cache.begin(torch.arange(9)[None], torch.tensor([[1, 2]]))  # 9 tokens need 3 blocks
    with pytest.raises(ValueError, match="exceeds the cache length"):
        cache.begin(torch.tensor([[64]]), torch.zeros(1, 17, dtype=torch.long))
    cache.begin(torch.arange(3)[None], torch.tensor([[1]]))
    k = torch.zeros(1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="planned pass"):
        cache.update(model.layer_ids[0], k, k, torch.tensor([[0]]), torch.tensor([[1]]))
    assert cache.nbytes() == 2 * 2 * 16 * 2 * 4 * 16 * 4
    assert PagedKVCache.block_bytes(2, 4, 2, 16, torch.float32) * 16 == cache.nbytes()


_GEMMA = dict(norm="rmsnorm1p", activation="geglu", norm_placement="sandwich", num_kv_heads=2,
              tied_embeddings=True, sliding_window=6, sliding_window_layers=(0,))


@pytest.mark.parametrize("family, fields", [
    ("gemma2", dict(options=dict(query_pre_attn_scalar=2, attn_logit_softcapping=0.5))),
    ("gemma3", dict(qk_norm=True, sliding_window_rope_theta=100.0,
                    options=dict(query_pre_attn_scalar=2))),
])
@torch.no_grad()
def test_flex_decode_keeps_gemma_score_scale_and_soft_cap(family, fields):
    """One-token passes over a flex-planned cache still scale (and soft-cap) the scores as
    the model's own attention does."""
    config = ModelConfig.from_name("llama-tiny", family=family, **_GEMMA, **fields)
    model = build_model(config, seed=6).eval()
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = PagedKVCache(model.layer_ids, 8, 4, 16, 2, config.head_dim,
                         decode_attention="flex", windows=(None, 6))
    tables = torch.tensor([[1, 2, 3]])
    out = [model(ids[:, :8], positions=torch.arange(8)[None], cache=cache, slots=tables)]
    for t in range(8, 12):
        out.append(model(ids[:, t:t + 1], positions=torch.full((1, 1), t), cache=cache,
                         slots=tables))
    torch.testing.assert_close(torch.cat(out, dim=1), model(ids), atol=1e-5, rtol=1e-5)
