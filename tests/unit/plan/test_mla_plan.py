"""The planner counts multi-head latent attention (DeepSeek-V2/V3) by its own shapes: the
q/kv down- and up-projections in parameters and FLOPs, the down-projections whole on every tp
rank, query/key heads of `qk_nope + qk_rope` dims against values of `v_head_dim`, and a KV
cache of the latent and the shared rotary key, whole on every tp rank.

References: Tessera's built models (`sum(p.numel())` on the meta device), its sharding rules
(`global_param_shapes`, `local_shape`, `kv_geometry`), the published totals and figures worked
by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from tessera.core.config import ModelConfig
from tessera.core.models.decoder.model import GPTModel
from tessera.core.parallel.sharding import (
    global_param_shapes,
    is_expert_param,
    kv_geometry,
    local_shape,
)
from tessera.plan import formulas as F
from tessera.plan import load_hardware, plan_serving

GIB = 2**30
_MOE = dict(num_experts=8, top_k=2, ffn_hidden_size=16, shared_ffn_hidden_size=32,
            shared_expert_gated=False, first_dense_layers=1, num_groups=2, topk_groups=1)


def _mla(q_lora_rank: int | None = None, moe: bool = False) -> ModelConfig:
    """h 32, 4 heads with q/k of 8 + 8 dims and values of 12, a latent of 16, FFN 48."""
    fields = dict(family="deepseek_v3", vocab_size=128, hidden_size=32, num_layers=3,
                  num_heads=4, num_kv_heads=4, ffn_hidden_size=48, max_position_embeddings=64,
                  mla=dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                           v_head_dim=12, q_lora_rank=q_lora_rank))
    return ModelConfig.from_dict({**fields, **({"moe": _MOE} if moe else {})})


SMALL = [_mla(), _mla(q_lora_rank=12), _mla(q_lora_rank=12, moe=True)]
SMALL_IDS = ["q-direct", "q-lora", "q-lora-moe"]
LATENT = ("wq_a", "q_a_norm", "wkv_a", "kv_a_norm")  # the down-projections and their norms


def _built(config: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPTModel(config).parameters())


@pytest.mark.parametrize("config", SMALL, ids=SMALL_IDS)
def test_parameter_counts_equal_the_built_model(config):
    """Every parameter Tessera builds; at tp 2 every rank holds the latent down-projections
    whole, and the other replicated weights (layer norms, routers) are counted split as
    `params_per_rank` documents."""
    counts = F.parameter_counts(config)
    assert counts.total == _built(config)
    shapes = global_param_shapes(config)
    latent = sum(math.prod(s) for n, s in shapes.items() if n.split(".")[-2] in LATENT)
    assert counts.layer_replicated * config.num_layers == latent > 0
    held = sum(math.prod(local_shape(n, config, 2)) for n in shapes)
    replicated = sum(math.prod(s) for n, s in shapes.items()
                     if n.startswith("layers.") and not is_expert_param(n)
                     and local_shape(n, config, 2) == s)
    assert F.params_per_rank(counts, tp=2, pp=1) == held - (replicated - latent) // 2


@pytest.mark.parametrize("config", SMALL, ids=SMALL_IDS)
def test_layer_flops_follow_the_attention_weights(config):
    """2 FLOPs a multiply-add over every attention weight matrix the model builds (norms
    aside) and the dense MLP; scores over q/k heads of 16 dims and values of 12:
    2 x s x 4 heads x (16 + 12) = 224 s a token."""
    tokens, s = 10, 64
    shapes = global_param_shapes(config)
    attn_w = sum(math.prod(v) for n, v in shapes.items()
                 if n.startswith("layers.0.attention.") and len(v) == 2)
    lf = F.layer_forward_flops(config, tokens, s)
    assert lf.dense == 2 * tokens * (attn_w + 3 * 32 * 48)
    assert lf.attention == 224 * tokens * s


def test_small_config_by_hand():
    """q-lora 12: wq_a 12 x 32 = 384, wq_b 64 x 12 = 768, wkv_a 24 x 32 = 768, wkv_b
    80 x 16 = 1,280, wo 32 x 48 = 1,536: 4,736 weights; latent norms 12 + 16. Replicated per
    layer 384 + 768 + 28 = 1,180. Activations: Q and K 2 x 64 / 32 each, V and the projection
    input 2 x 48 / 32 each, SwiGLU MLP 6 x 48 / 32: 23 split units; the two latents' norm
    inputs and outputs 4 x (16 + 12) / 32 = 3.5 units on every tp rank."""
    config = SMALL[1]
    assert sum(p.n * p.k for p in F.attention_projections(config)) == 4_736
    assert F.parameter_counts(config).layer_replicated == 1_180
    u = F.layer_activation_units(config)
    assert (u.split, u.whole) == (23.0, 3.5)
    s, b = 64, 2
    sbh = s * b * 32
    assert F.layer_activation_bytes(config, s, b, t=2, sequence_parallel=True) == pytest.approx(
        sbh * (10 / 2 + 3.5 + (23 + 5 * 4 * 64 / 32) / 2))


@pytest.mark.parametrize("name, total, active", [
    ("deepseek-v2-lite", 15_706_484_224, 2.4e9),  # 15.7B, 2.4B activated
    ("deepseek-v3", 671_026_419_200, 37e9),  # 671B, 37B activated (no MTP layer)
])
def test_presets_have_the_published_counts(name, total, active):
    """The planner's total equals the built model's shapes exactly (V3 was 702.6B before it
    knew the latent attention); the activated count without the input embedding lookup is the
    published one to its rounding."""
    from tessera.core.parallel.sharding import num_parameters

    config = ModelConfig.from_name(name)
    counts = F.parameter_counts(config)
    assert counts.total == num_parameters(config) == total
    assert counts.active - counts.word_embedding == pytest.approx(active, rel=0.025)


@pytest.mark.parametrize("config", [SMALL[1], ModelConfig.from_name("deepseek-v3"),
                                    ModelConfig.from_name("llama3-8b")],
                         ids=["small-mla", "deepseek-v3", "llama3-8b"])
@pytest.mark.parametrize("tp", [1, 2, 4, 16])
def test_kv_cache_per_rank_is_the_serving_geometry(config, tp):
    """A tp rank's KV bytes are what `kv_geometry` makes the engine cache: MLA's
    `kv_lora_rank + qk_rope_head_dim` values per token and layer on every rank; kv heads split
    (or replicated past their count) otherwise."""
    tokens, pp = 1000, 1
    geometry = kv_geometry(config, tp)
    assert F.kv_cache_bytes_per_rank(config, tokens, tp, pp) == (
        config.num_layers * geometry.token_values * tokens * 2)


def test_serving_plan_holds_the_latent_cache():
    """DeepSeek-V2-Lite at 32k tokens: 27 layers x 576 values x 2 bytes a token, 0.95 GiB a
    sequence (per-head K/V would be 10.1 GiB), on every tp rank; its weights at tp 2 hold the
    latent down-projections on both ranks."""
    config = ModelConfig.from_name("deepseek-v2-lite")
    options = {(o.tp, o.pp): o for o in plan_serving(config, 2, load_hardware("h100-80gb"),
                                                     context=32768).options}
    latent = 27 * 576 * 32768 * 2 / GIB
    assert options[1, 1].kv_cache_gib == pytest.approx(latent)
    assert options[2, 1].kv_cache_gib == pytest.approx(latent)
    counts = F.parameter_counts(config)
    whole = counts.num_layers * counts.layer_replicated * 2 / GIB
    assert options[2, 1].weights_gib - options[1, 1].weights_gib / 2 == pytest.approx(whole / 2)


@pytest.mark.parametrize("name, gpus", [("deepseek-v2-lite", "8"), ("deepseek-v3", "256")])
def test_tessera_plan_takes_the_deepseek_presets(capsys, name, gpus):
    """`tessera plan --model NAME` plans training (no context parallelism: MLA refuses it) and
    serving on one node of H200s (V3 in FP8, 84 GiB a GPU at tp 8)."""
    import json

    from tessera.__main__ import main

    train = ["--gpus", gpus, "--gpu", "h100-80gb", "--global-batch", "512", "--seq-len", "4096"]
    assert main(["plan", "--model", name, *train, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["candidates"][0]
    assert best["fits"] and best["cp"] == 1 and best["ep"] > 1
    serve = ["--serve", "--gpus", "8", "--gpu", "h200", "--context", "32768", "--precision", "fp8"]
    assert main(["plan", "--model", name, *serve]) == 0
    assert f"{name} (fp8) fits on 8 x h200" in capsys.readouterr().out
