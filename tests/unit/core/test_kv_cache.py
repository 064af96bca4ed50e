"""Cached decoding reproduces the full forward pass, also with rows of different lengths."""

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.kv_cache import KVCache

FAMILIES = ["gpt2-tiny", "llama-tiny", "nemotron-tiny"]


def _cache(model, slots=4, max_seq=64):
    c = model.config
    return KVCache(model.layer_ids, slots, max_seq, c.num_kv_heads, c.head_dim)


@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_prefill_then_decode_matches_full_forward(name):
    model = build_model(ModelConfig.from_name(name), seed=3).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    full = model(ids)
    cache, slots = _cache(model), torch.tensor([2, 0])
    pos = torch.arange(12).expand(2, 12)
    out = [model(ids[:, :12], positions=pos, cache=cache, slots=slots)]
    for t in range(12, 20):
        out.append(model(ids[:, t:t + 1], positions=torch.full((2, 1), t), cache=cache,
                         slots=slots))
    torch.testing.assert_close(torch.cat(out, dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_ragged_batch_prefill_next_to_decode():
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=4).eval()
    a, b = torch.randint(0, 512, (1, 9)), torch.randint(0, 512, (1, 5))
    cache = _cache(model)
    # Request a is already prefilled with 8 tokens; request b arrives and prefills alongside
    # a's next decode step (padded to the same length; padding positions are discarded).
    model(a[:, :8], positions=torch.arange(8)[None], cache=cache, slots=torch.tensor([0]))
    ids = torch.cat([torch.cat([a[:, 8:9], a.new_zeros(1, 4)], 1), b], 0)
    positions = torch.tensor([[8, 9, 10, 11, 12], [0, 1, 2, 3, 4]])
    out = model(ids, positions=positions, cache=cache, slots=torch.tensor([0, 1]))
    torch.testing.assert_close(out[0, 0], model(a)[0, 8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], model(b)[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_gathered_reads_equal_views_and_a_stale_plan_is_refused():
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=5).eval()
    ids = torch.randint(0, 512, (2, 10))
    outs = []
    for views in (True, False):
        cache, slots = _cache(model), torch.tensor([1, 2])  # consecutive: a view when allowed
        pos = torch.arange(9).expand(2, 9)
        model(ids[:, :9], positions=pos, cache=cache, slots=slots)
        cache.begin(torch.full((2, 1), 9), slots, views=views)
        assert cache._pass[1] == (1 if views else None) and cache.pass_length == 10
        h = model.embed(ids[:, 9:]).transpose(0, 1).contiguous()
        outs.append(model.forward_hidden(h, positions=torch.full((2, 1), 9), cache=cache,
                                         slots=slots))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="planned pass has 2 x 1"):
        h = model.embed(ids[:1, :3]).transpose(0, 1).contiguous()
        model.forward_hidden(h, positions=torch.arange(3)[None], cache=cache,
                             slots=torch.tensor([0]))
    with pytest.raises(RuntimeError, match="before KVCache.begin"):
        h = model.embed(ids[:, :1]).transpose(0, 1).contiguous()
        model.forward_hidden(h, positions=torch.zeros(2, 1, dtype=torch.long), cache=_cache(model),
                             slots=slots)
