"""DeepSeek-V2 and DeepSeek-V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`: multi-head
latent attention, dense layers) against transformers.

Tiny random models built from configs (nothing downloaded): V2-Lite's shape (no q bottleneck)
and V3's (q bottleneck), both with yarn RoPE whose `mscale_all_dim` also scales the scores, run
on prompts past the original rope length. Imported logits within 1e-4, greedy serving equal to
`generate` for 20 tokens over the latent KV cache, export giving the same config and logits,
tp2 and tp2 x pp2 reshards keeping them, a peft LoRA round-trip; the KV cache holds the latent
(its bytes per token counted); the fields Tessera cannot honour refused by name.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.converters.hf_mapping import ConversionError, config_from_hf  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.core.paged_kv_cache import PagedKVCache  # noqa: E402
from tessera.core.parallel.sharding import kv_geometry  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.engine.executor import LocalExecutor  # noqa: E402
from tessera.serving.engine.kv_config import KVCacheConfig  # noqa: E402
from tessera.serving.engine.runner import ModelRunner  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.serving_helper import collect  # noqa: E402

from . import hf_family_checks as check  # noqa: E402

VOCAB = 128
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
            mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1)
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2,
              max_position_embeddings=128, rope_parameters=YARN, initializer_range=0.2,
              pad_token_id=0, eos_token_id=1, bos_token_id=2)
# V2-Lite has no q bottleneck; V3 has one.
SHAPES = {"deepseek_v2": dict(q_lora_rank=None), "deepseek_v3": dict(q_lora_rank=24)}
# The attention's projections (peft's DeepSeek mapping also targets MoE expert parameters
# when an MLP name is given, which a Tessera adapter does not map).
PEFT_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
LONG = 60  # past the original rope length (32)


def _hf_config(kind: str, **overrides):
    cls = transformers.DeepseekV2Config if kind == "deepseek_v2" else transformers.DeepseekV3Config
    return cls(**{**CONFIG, **SHAPES[kind], **overrides})


def _hf_model(config):
    torch.manual_seed(0)
    return check.perturbed(transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager"), scale=0.3)


_IMPORTED: dict[str, tuple] = {}


def _imported(kind: str, tmp_path_factory) -> tuple:
    """(kind, the HF model, the directory holding `hf` and its import `ckpt`), made once."""
    if kind not in _IMPORTED:
        root = tmp_path_factory.mktemp(kind)
        hf_model = _hf_model(_hf_config(kind))
        hf_model.save_pretrained(root / "hf")
        import_hf(root / "hf", root / "ckpt")
        _IMPORTED[kind] = kind, hf_model, root
    return _IMPORTED[kind]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def imported(request, tmp_path_factory):
    return _imported(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def imported_v3(tmp_path_factory):
    """V3 alone, for the slower checks (its attention is V2's with a q bottleneck)."""
    return _imported("deepseek_v3", tmp_path_factory)


def test_imported_logits_match(imported):
    kind, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    c = model.config
    assert (c.family, c.mla.q_lora_rank, c.mla.rope_interleave, c.rotary_dim) == (
        kind, SHAPES[kind]["q_lora_rank"], True, 8)
    for length in (12, LONG):
        assert check.logit_diff(hf_model, model, check.ids(VOCAB, length, batch=2)) <= 1e-4


@pytest.mark.parametrize("detail", ["rope_interleave", "softmax_scale"])
def test_each_deepseek_detail_matters(imported, detail):
    """Dropping the pair layout or yarn's score scale changes the logits: parity covers both."""
    kind, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    for layer in model.layers.values():
        if detail == "rope_interleave":
            layer.attention.mla = dataclasses.replace(layer.attention.mla, rope_interleave=False)
        else:
            layer.attention.scale = model.config.mla.qk_head_dim ** -0.5
    assert check.logit_diff(hf_model, model, check.ids(VOCAB, LONG)) > 1e-3


def test_v3_rope_on_halves_matches(tmp_path):
    """DeepSeek-V3 with `rope_interleave=False` rotates the halves of the rotary dims."""
    hf_model = _hf_model(_hf_config("deepseek_v3", rope_interleave=False))
    hf_model.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model = load_checkpoint(tmp_path / "ckpt").eval()
    assert model.config.mla.rope_interleave is False
    assert check.logit_diff(hf_model, model, check.ids(VOCAB, LONG)) <= 1e-4
    check.export_matches(tmp_path / "ckpt", tmp_path / "out", hf_model, check.ids(VOCAB, 20),
                         transformers)


def test_greedy_serving_equals_generate(imported):
    kind, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    prompt = check.ids(VOCAB, 40, seed=5)[0].tolist()  # generation runs past position 32
    assert check.engine_greedy(model, prompt, 20) == check.hf_greedy(hf_model, prompt, 20)


def test_export_gives_the_same_config_and_logits(imported, tmp_path):
    kind, hf_model, root = imported
    check.export_matches(root / "ckpt", tmp_path / "out", hf_model, check.ids(VOCAB, LONG),
                         transformers)


def test_tp2_reshard_keeps_the_logits(imported, tmp_path):
    kind, hf_model, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2", check.ids(VOCAB, 24))


def test_tp2_pp2_reshard_keeps_the_logits(imported_v3, tmp_path):
    kind, hf_model, root = imported_v3
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2pp2", check.ids(VOCAB, 24), pp=2)


def test_peft_lora_round_trips(imported_v3, tmp_path):
    kind, hf_model, root = imported_v3
    check.peft_round_trip(root / "hf", root / "ckpt", tmp_path, PEFT_TARGETS,
                          check.ids(VOCAB, 24, batch=2), transformers, peft)


@pytest.mark.parametrize("kind", sorted(SHAPES))
@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported (supported: 'silu')"),
    ({"attention_bias": True}, "attention_bias=True is not supported (supported: False)"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 is not supported (supported: "
                                 "num_attention_heads=4"),
    ({"rope_parameters": {**YARN, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5 is not supported (supported: 1.0"),
    ({"rope_parameters": {**YARN, "rope_type": "su"}}, "rope type 'su' is not supported"),
])
def test_fields_tessera_cannot_honour_are_refused(kind, change, message):
    with pytest.raises(ConversionError, match=re.escape(f"{kind} config: {message}")):
        config_from_hf({**_hf_config(kind).to_dict(), **change})


def test_v2_mlp_bias_is_refused():
    with pytest.raises(ConversionError, match=re.escape(
            "deepseek_v2 config: mlp_bias=True is not supported (supported: False)")):
        config_from_hf({**_hf_config("deepseek_v2").to_dict(), "mlp_bias": True})


def test_context_parallel_and_packed_documents_are_refused(imported):
    kind, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    tokens = check.ids(VOCAB, 8)
    with pytest.raises(NotImplementedError, match="multi-head latent attention runs without "
                                                  "context parallelism or packed documents"):
        model(tokens, document_ids=torch.zeros_like(tokens))


def test_the_paged_kv_cache_holds_the_latent(imported_v3):
    """The paged pool keeps per token and layer the latent and the rotary key (not per-head K
    and V), is sized by that for a memory budget, and serves greedy tokens equal to
    `generate`; the block manager's peak counts the blocks those tokens took."""
    kind, hf_model, root = imported_v3
    model = load_checkpoint(root / "ckpt").eval()
    c, m = model.config, model.config.mla
    per_token = c.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 4  # fp32
    per_head_kv = c.num_layers * c.num_heads * (m.qk_head_dim + m.v_head_dim) * 4
    assert (per_token, per_head_kv) == (320, 1152)  # 3.6x less
    kv = KVCacheConfig(kind="paged", block_size=8, memory="64KiB")
    runner = ModelRunner(model, 2, kv=kv)
    cache = runner.cache
    assert cache.num_blocks == 64 * 1024 // (8 * per_token)
    assert cache.nbytes() == cache.num_blocks * cache.block_size * per_token
    entry = kv_geometry(c, tp_size=2)  # the latent is whole on every tp rank
    assert entry.token_values == m.kv_lora_rank + m.qk_rope_head_dim
    assert PagedKVCache.block_bytes(c.num_layers, 8, entry.heads, entry.key_dim, torch.float32,
                                    entry.value_dim) == 8 * per_token
    prompt = check.ids(VOCAB, 40, seed=5)[0].tolist()
    with LLMEngine(LocalExecutor(runner), kv=kv) as engine:
        result = collect(engine, [GenerationRequest("r", prompt, SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True))])[0]
        peak = engine.stats()["kv_blocks_peak_used"]
    assert result.token_ids == check.hf_greedy(hf_model, prompt, 20)
    assert peak == -(-(40 + 20 - 1) // 8)  # the last token's keys are never written
