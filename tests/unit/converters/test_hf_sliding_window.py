"""Sliding-window attention (Mistral, Qwen2 with `max_window_layers`, Mixtral) against
transformers, for prompts and generations much longer than the window.

Tiny random models built from a config (nothing downloaded): imported logits within 1e-4 (fp32)
for a 40-token prompt under a window of 8; greedy serving equal to `generate` for 20 tokens past
the window with the slot cache, the paged cache (gather and flex kernels) and the static,
bucketed decode step, also with prefix reuse and speculative decoding; the export giving the
same config and logits; a tp2 reshard keeping them; a peft LoRA round-trip past Mistral's
window; a long generation holding at most ceil(window / block_size) + 1 KV blocks; and the
window fields Tessera cannot honour refused by name.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.converters.hf_mapping import ConversionError, config_from_hf  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.engine.executor import LocalExecutor  # noqa: E402
from tessera.serving.engine.kv_config import KVCacheConfig  # noqa: E402
from tessera.serving.engine.runner import ModelRunner  # noqa: E402
from tessera.serving.engine.speculative import SpeculativeConfig  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.serving_helper import collect  # noqa: E402

from . import hf_family_checks as check  # noqa: E402

VOCAB, WINDOW, BLOCK = 256, 8, 4
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
               initializer_range=0.1, tie_word_embeddings=False)
MODELS = {
    "mistral": ("MistralConfig", dict(**_COMMON, sliding_window=WINDOW)),
    # Layer 0 attends to everything, layer 1 through the window (max_window_layers=1).
    "qwen2": ("Qwen2Config", dict(**_COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=1)),
}


def _hf_config(name: str, **overrides):
    cls, fields = MODELS[name]
    return getattr(transformers, cls)(**{**fields, **overrides})


@pytest.fixture(scope="module", params=list(MODELS))
def imported(request, tmp_path_factory):
    name, root = request.param, tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(_hf_config(name)))
    hf_model.config._attn_implementation = "eager"  # the reference: transformers' own masks
    hf_model.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    return name, hf_model, root


def test_window_is_imported(imported):
    name, _, root = imported
    config = load_checkpoint(root / "ckpt").config
    assert config.sliding_window == WINDOW
    assert config.sliding_window_layers == (None if name == "mistral" else (1,))


def test_logits_match_past_the_window(imported):
    _, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    tokens = check.ids(VOCAB, 40, batch=2)
    assert check.logit_diff(hf_model, model, tokens) <= 1e-4
    # The window matters: the same model attending to everything differs.
    model.config.sliding_window = None
    for layer in model.layers.values():
        layer.attention.window = None
    assert check.logit_diff(hf_model, model, tokens) > 1e-3


def _engine_tokens(model, prompt: list[int], n: int, kv: KVCacheConfig | None,
                   compile_decode: bool | str = False) -> tuple[list[int], int]:
    """Greedy tokens of one request, and the most KV blocks held at once (0: slot cache)."""
    runner = ModelRunner(model, 2, kv=kv, compile_decode=compile_decode)
    with LLMEngine(LocalExecutor(runner), kv=kv) as engine:
        result = collect(engine, [GenerationRequest("r", prompt, SamplingParams(
            max_tokens=n, temperature=0, ignore_eos=True))])[0]
        peak = engine.stats().get("kv_blocks_peak_used", 0)
    return result.token_ids, int(peak)


@pytest.mark.parametrize("kv, compile_decode", [
    (None, False),
    (KVCacheConfig(kind="paged", block_size=BLOCK), False),
    (KVCacheConfig(kind="paged", block_size=BLOCK, decode_attention="flex"), False),
    (KVCacheConfig(kind="paged", block_size=BLOCK), "static"),
], ids=["slots", "paged-gather", "paged-flex", "paged-static"])
def test_greedy_serving_equals_generate_past_the_window(imported, kv, compile_decode):
    name, hf_model, root = imported
    prompt = check.ids(VOCAB, 12)[0].tolist()
    want = check.hf_greedy(hf_model, prompt, 20)
    model = load_checkpoint(root / "ckpt").eval()
    got, _ = _engine_tokens(model, prompt, 20, kv, compile_decode)
    assert got == want


def test_export_gives_the_same_config_and_logits(imported, tmp_path):
    _, hf_model, root = imported
    check.export_matches(root / "ckpt", tmp_path / "out", hf_model, check.ids(VOCAB, 40),
                         transformers)


def test_tp2_reshard_keeps_the_window_and_logits(imported, tmp_path):
    _, _, root = imported
    check.tp2_keeps_logits(root / "ckpt", tmp_path / "tp2", check.ids(VOCAB, 40))
    assert load_checkpoint(tmp_path / "tp2").config.sliding_window == WINDOW


@pytest.mark.parametrize("imported", ["mistral"], indirect=True)
def test_peft_lora_round_trips_past_the_window(imported, tmp_path):
    name, hf_model, root = imported
    check.peft_round_trip(root / "hf", root / "ckpt", tmp_path,
                          ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"], check.ids(VOCAB, 24, batch=2), transformers, peft)


def test_long_generation_holds_only_the_window_blocks(tmp_path):
    torch.manual_seed(0)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(
        _hf_config("mistral")))
    hf_model.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model = load_checkpoint(tmp_path / "ckpt").eval()
    kv = KVCacheConfig(kind="paged", block_size=BLOCK, num_blocks=64)
    runner = ModelRunner(model, 1, kv=kv)
    bound = math.ceil(WINDOW / BLOCK) + 1
    with LLMEngine(LocalExecutor(runner), kv=kv) as engine:
        collect(engine, [GenerationRequest("r", check.ids(VOCAB, 6)[0].tolist(), SamplingParams(
            max_tokens=60, temperature=0, ignore_eos=True))])
        stats = engine.stats()
    # 66 tokens are 17 blocks of 4; the window keeps at most 3 of them at any time.
    assert 0 < stats["kv_blocks_peak_used"] <= bound
    assert stats["kv_block_window_frees_total"] >= 66 // BLOCK - bound
    assert stats["kv_blocks_used"] == 0  # the finished request gave back what it still held


def test_prefix_cache_reuse_past_the_window_keeps_generate(imported):
    """A second request sharing a 24-token prefix (blocks the first gave back as they left
    its window, still cached) generates what transformers does, from the cached blocks."""
    _, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    kv = KVCacheConfig(kind="paged", block_size=BLOCK, num_blocks=64)
    first = check.ids(VOCAB, 24)[0].tolist()
    second = first + [7, 8, 9]
    with LLMEngine(LocalExecutor(ModelRunner(model, 1, kv=kv)), kv=kv) as engine:
        got = [collect(engine, [GenerationRequest(name, prompt, SamplingParams(
            max_tokens=16, temperature=0, ignore_eos=True))])[0].token_ids
            for name, prompt in (("first", first), ("second", second))]
        stats = engine.stats()
    assert stats["prefix_cache_hits_tokens_total"] >= 24
    assert got == [check.hf_greedy(hf_model, p, 16) for p in (first, second)]


def test_speculative_decoding_past_the_window_keeps_generate_and_the_bound(imported):
    name, hf_model, root = imported
    model = load_checkpoint(root / "ckpt").eval()
    kv = KVCacheConfig(kind="paged", block_size=BLOCK, num_blocks=64)
    prompt = (check.ids(VOCAB, 5)[0].tolist() * 4)[:18]  # repeats: n-gram drafts to verify
    with LLMEngine(LocalExecutor(ModelRunner(model, 1, kv=kv)), kv=kv,
                   speculative=SpeculativeConfig("ngram", 3)) as engine:
        got = collect(engine, [GenerationRequest("r", prompt, SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True))])[0].token_ids
        stats = engine.stats()
    assert stats["spec_draft_tokens_total"] > 0
    assert got == check.hf_greedy(hf_model, prompt, 20)
    if name == "mistral":  # (Qwen2's layer 0 attends to everything: it keeps every block)
        # The prompt's prefill writes all its blocks at once; later, a verify pass writes its
        # 3 drafts past the window before the rollback drops what fell out of it.
        bound = max(math.ceil(len(prompt) / BLOCK), math.ceil((WINDOW + 3) / BLOCK) + 1)
        assert stats["kv_blocks_peak_used"] <= bound
        assert stats["kv_block_window_frees_total"] > 0


@pytest.mark.parametrize("name, change, message", [
    ("mistral", {"sliding_window": 0},
     "mistral config: sliding_window=0 is not supported (supported: a positive number"),
    ("qwen2", {"sliding_window": -1},
     "qwen2 config: sliding_window=-1 is not supported (supported: a positive number"),
    ("qwen2", {"layer_types": ["full_attention", "chunked_attention"]},
     "qwen2 config: layer_types=['full_attention', 'chunked_attention'] is not supported "
     "(supported: 2 entries of ['full_attention', 'sliding_attention'])"),
    ("qwen2", {"layer_types": ["sliding_attention"]},
     "layer_types=['sliding_attention'] is not supported (supported: 2 entries"),
])
def test_window_fields_tessera_cannot_honour_are_refused(name, change, message):
    with pytest.raises(ConversionError, match=re.escape(message)):
        config_from_hf({**_hf_config(name).to_dict(), **change})


def test_qwen2_window_needs_use_sliding_window():
    # transformers ignores sliding_window unless use_sliding_window: so does the import.
    config = config_from_hf(_hf_config("qwen2", use_sliding_window=False).to_dict())
    assert config.sliding_window is None and config.sliding_window_layers is None


def test_a_window_covering_every_position_is_no_window():
    # The plain causal path (no mask to build) serves it, as transformers computes the same.
    assert config_from_hf(_hf_config("qwen2", sliding_window=128).to_dict()).sliding_window is None
    assert config_from_hf(_hf_config("mistral", sliding_window=128).to_dict()).sliding_window \
        is None


def test_export_refuses_a_window_the_hf_model_cannot_hold():
    from tessera.converters.hf_mapping import check_exportable
    from tessera.core.config import ModelConfig

    check_exportable(ModelConfig(family="llama", sliding_window=WINDOW))
    check_exportable(ModelConfig(family="qwen2", qkv_bias=True, sliding_window=WINDOW,
                                 sliding_window_layers=(1,)))
    refused = {
        "'sliding_window_layers': (1,)": ModelConfig(family="llama", sliding_window=WINDOW,
                                                     sliding_window_layers=(1,)),
        "'bias': True": ModelConfig(family="llama", sliding_window=WINDOW, bias=True),
        "'sliding_window_layers': (0,)": ModelConfig(family="phi3", sliding_window=WINDOW,
                                                     sliding_window_layers=(0,)),
        "sliding_window_layers=[1]: Qwen3-MoE's window covers every layer":
            ModelConfig.from_name("qwen3-moe-tiny", sliding_window=WINDOW,
                                  sliding_window_layers=(1,)),
    }
    for message, config in refused.items():
        with pytest.raises(ConversionError, match=re.escape(message)):
            check_exportable(config)


def test_mixtral_window_imports_and_exports_with_its_logits(tmp_path):
    config = transformers.MixtralConfig(**{**_COMMON, "num_local_experts": 4,
                                           "sliding_window": WINDOW})
    torch.manual_seed(0)
    hf_model = check.perturbed(transformers.AutoModelForCausalLM.from_config(config))
    hf_model.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    model = load_checkpoint(tmp_path / "ckpt").eval()
    assert model.config.sliding_window == WINDOW
    tokens = check.ids(VOCAB, 40, batch=2)
    assert check.logit_diff(hf_model, model, tokens) <= 1e-4
    check.convert("--to", "hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert reloaded.config.sliding_window == WINDOW
    assert check.logit_diff(reloaded, model, tokens) <= 1e-4
