"""Serving a converted Mixtral: a random-weight `MixtralForCausalLM` saved by transformers and
imported with `tessera convert --from hf` runs in the engine (batched, chunked prefill, KV
cache), its greedy continuations equal the argmax of the full forward pass step by step, and
the OpenAI endpoint answers. A compiled decode step (`--compile`) is refused for MoE models."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.http.app import create_app  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.serving_helper import collect, full_forward_greedy, train_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.1)
    transformers.MixtralForCausalLM(config).save_pretrained(root / "hf")
    train_tiny_tokenizer(root / "hf")
    return import_hf(root / "hf", root / "ckpt")


def test_greedy_equals_argmax_of_the_full_forward_pass(checkpoint):
    model = load_checkpoint(checkpoint).eval()
    # 3 requests on 2 slots (one waits), one prompt prefilled in 3 chunks (budget 12 tokens).
    prompts = [[1, 17, 42], list(range(5, 35)), [7, 300, 9]]
    with LLMEngine(model, max_batch=2, max_step_tokens=12) as engine:
        results = collect(engine, [GenerationRequest(f"r{i}", p, SamplingParams(
            max_tokens=8, temperature=0)) for i, p in enumerate(prompts)])
    for prompt, result in zip(prompts, results):
        assert result.token_ids == full_forward_greedy(model, prompt, 8)[0]


def test_openai_completions_answer(checkpoint):
    engine = LLMEngine.from_checkpoint(checkpoint, model_name="mixtral", max_batch=2, seed=0)
    try:
        with TestClient(create_app(engine, model_name="mixtral")) as client:
            reply = client.post("/v1/completions", json={
                "model": "mixtral", "prompt": "def parse", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"]
    finally:
        engine.shutdown()


def test_compiled_decode_is_refused_with_the_reason(checkpoint):
    model = load_checkpoint(checkpoint).eval()
    with pytest.raises(ValueError, match=r"Mixture-of-Experts models \(num_experts 4\).*"
                                         r"serve without --compile"):
        LLMEngine(model, max_batch=2, compile_decode=True)
