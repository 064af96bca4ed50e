"""Serving converted Qwen3 models: random-weight `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM`
(per-head q/k norm, head_dim 12 != hidden 32 / 4 heads), saved by transformers and imported with
`tessera convert --from hf`, run in the engine (batched, chunked prefill, paged and slot KV
caches); greedy continuations equal the argmax of the full forward pass step by step, so the
cached keys are the normalized, rotated ones. The compiled decode step (dense model) is slow on
CPU and runs with `-m slow`."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.engine.kv_config import KVCacheConfig  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.serving_helper import collect, full_forward_greedy  # noqa: E402

_COMMON = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=12, max_position_embeddings=128,
               initializer_range=0.1)
_MODELS = {
    "qwen3": ("Qwen3Config", dict(**_COMMON, intermediate_size=48)),
    # Layer 0 dense, layer 1 MoE (decoder_sparse_step 2).
    "qwen3_moe": ("Qwen3MoeConfig", dict(**_COMMON, intermediate_size=48, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16,
                                         decoder_sparse_step=2, norm_topk_prob=True)),
}
PROMPTS = [[1, 17, 42], list(range(5, 35)), [7, 200, 9]]


@pytest.fixture(scope="module", params=list(_MODELS))
def checkpoint(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    cls, fields = _MODELS[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**fields))
    with torch.no_grad():  # the q/k norm weights start at 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(root / "hf")
    return import_hf(root / "hf", root / "ckpt")


def _greedy(model, **engine_kw) -> list[list[int]]:
    # 3 requests on 2 slots (one waits), one prompt prefilled in 3 chunks (budget 12 tokens).
    with LLMEngine(model, max_batch=2, max_step_tokens=12, **engine_kw) as engine:
        results = collect(engine, [GenerationRequest(f"r{i}", p, SamplingParams(
            max_tokens=8, temperature=0)) for i, p in enumerate(PROMPTS)])
    return [r.token_ids for r in results]


def test_greedy_equals_argmax_of_the_full_forward_pass(checkpoint):
    model = load_checkpoint(checkpoint).eval()
    assert model.config.qk_norm and model.config.head_dim == 12
    expected = [full_forward_greedy(model, p, 8)[0] for p in PROMPTS]
    assert _greedy(model) == expected  # paged KV cache (the default)
    assert _greedy(model, kv=KVCacheConfig(kind="slots")) == expected


@pytest.mark.slow
def test_compiled_decode_equals_the_full_forward_pass(checkpoint):
    model = load_checkpoint(checkpoint).eval()
    if model.config.moe.num_experts:
        pytest.skip("compiled decode is refused for MoE models (test_engine_moe.py)")
    expected = [full_forward_greedy(model, p, 8)[0] for p in PROMPTS]
    assert _greedy(model, compile_decode=True) == expected
