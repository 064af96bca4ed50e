"""The engine over FP8 weights (`quantize_with="fp8"`) decodes what the same quantized model's
full forward pass picks, through the paged KV cache, in both FP8 products."""

from __future__ import annotations

import pytest
import torch

from tessera.core import ModelConfig, build_model, save_checkpoint
from tessera.core.fp8 import Fp8
from tessera.serving.engine import LLMEngine, run_beside
from tessera.serving.types import GenerationRequest, SamplingParams
from tests.serving_helper import full_forward_greedy


@pytest.mark.parametrize("scaled_mm", [False, True], ids=["W8A16", "W8A8"])
def test_fp8_engine_matches_the_quantized_full_forward(tmp_path, scaled_mm):
    config = ModelConfig.from_name("llama-tiny", hidden_size=128, ffn_hidden_size=256,
                                   init_std=0.1)
    path = save_checkpoint(tmp_path / "ckpt", build_model(config, seed=0))
    engine = LLMEngine.from_checkpoint(path, quantize_with="fp8", max_batch=2, background=False)
    model = engine.executor.runner.stages[0]
    fp8 = [m for m in model.modules() if isinstance(getattr(m, "format", None), Fp8)]
    assert len(fp8) == 4 * config.num_layers
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.scale.shape == (m.weight.shape[0], 1)
               for m in fp8)
    for m in fp8:  # the Hopper product, through torch's CPU _scaled_mm
        m.format = Fp8(use_scaled_mm=scaled_mm)
    prompt = torch.randint(3, config.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    request = GenerationRequest("r", prompt.tolist(),
                                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))

    async def tokens():
        return [t async for out in engine.generate(request) for t in out.token_ids]

    with torch.no_grad():
        expected = full_forward_greedy(model, prompt.tolist(), 8)[0]
    assert run_beside(engine, tokens) == expected
    engine.shutdown()
