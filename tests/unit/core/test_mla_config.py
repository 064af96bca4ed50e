"""Multi-head latent attention's config (`core.mla_config`, `ModelConfig.mla`): what it takes,
what it refuses by name, and that it survives a manifest round-trip; the decoder block under
selective recompute gives the same loss and gradients."""

from __future__ import annotations

import re

import pytest
import torch

from tessera.core.config import ModelConfig
from tessera.core.errors import ConfigError
from tessera.core.mla_config import MLAConfig

MLA = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                q_lora_rank=12)


def _config(**overrides) -> ModelConfig:
    return ModelConfig(**{"family": "deepseek_v3", "vocab_size": 64, "hidden_size": 32,
                          "num_heads": 4, "ffn_hidden_size": 48, "mla": MLA, **overrides})


def test_head_dim_and_rotary_dim_follow_the_latent_shape():
    c = _config()
    assert (c.head_dim, c.rotary_dim, MLA.cache_dims) == (12, 4, 20)
    again = ModelConfig.from_dict(c.to_dict())
    assert again.mla == MLA and again == c


@pytest.mark.parametrize("change, message", [
    (dict(mla=MLAConfig(qk_rope_head_dim=3)), "mla.qk_rope_head_dim=3 must be even"),
    (dict(mla=MLAConfig(kv_lora_rank=0)), "mla.kv_lora_rank=0 must be a positive integer"),
    (dict(mla=MLAConfig(q_lora_rank=0)), "mla.q_lora_rank=0 must be a positive integer or None"),
    (dict(num_kv_heads=2), "num_kv_heads=2 must equal num_heads=4"),
    (dict(head_dim=16), "head_dim=16 must be mla.qk_nope_head_dim + mla.qk_rope_head_dim = 12"),
    (dict(qk_norm=True), "qk_norm=True is not supported with multi-head latent attention"),
    (dict(bias=True), "bias=True is not supported with multi-head latent attention"),
    (dict(sliding_window=8), "sliding_window=8 is not supported with multi-head latent"),
    (dict(mla={"kv_lora_rank": 8}), "mla must be an MLAConfig (core.mla_config) or None"),
    (dict(mla=None), "mla=None (a deepseek_v3 model's attention is multi-head latent attention"),
])
def test_what_latent_attention_cannot_take_is_refused_by_name(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(**change)


def test_selective_recompute_gives_the_same_loss_and_gradients():
    from tessera.core.config import TrainSchedule
    from tessera.core.init import build_model

    config = _config(num_layers=2)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    results = []
    for recompute in ("none", "selective"):
        torch.manual_seed(0)
        model = build_model(config, schedule=TrainSchedule(recompute=recompute)).train()
        assert {layer.attention.selective_recompute for layer in model.layers.values()} == {
            recompute == "selective"}
        loss = model(ids, labels=ids)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.allclose(grads_a[n], grads_b[n], atol=1e-6) for n in grads_a)
