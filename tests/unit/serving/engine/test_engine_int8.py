"""The engine over int8 weights decodes what the same quantized model's full forward pass picks."""

from __future__ import annotations

import torch

from tessera.core import ModelConfig, build_model, save_checkpoint
from tessera.core.quantize import Int8
from tessera.serving.engine import LLMEngine, run_beside
from tessera.serving.types import GenerationRequest, SamplingParams
from tests.serving_helper import full_forward_greedy


def test_int8_engine_matches_the_quantized_full_forward(tmp_path):
    # hidden 128 and ffn 256: every product takes torch's int8 kernel (in_features % 16 == 0)
    config = ModelConfig.from_name("llama-tiny", hidden_size=128, ffn_hidden_size=256,
                                   init_std=0.1)
    path = save_checkpoint(tmp_path / "ckpt", build_model(config, seed=0))
    engine = LLMEngine.from_checkpoint(path, dtype="bf16", quantize_with="int8", max_batch=2,
                                       background=False)
    model = engine.executor.runner.stages[0]
    int8 = [m for m in model.modules() if isinstance(getattr(m, "format", None), Int8)]
    assert len(int8) == 4 * config.num_layers and all(m.weight.dtype == torch.int8 for m in int8)
    prompt = torch.randint(3, config.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    request = GenerationRequest("r", prompt.tolist(),
                                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))

    async def tokens():
        return [t async for out in engine.generate(request) for t in out.token_ids]

    with torch.no_grad():
        expected = full_forward_greedy(model, prompt.tolist(), 8)[0]
    assert run_beside(engine, tokens) == expected
    engine.shutdown()
