"""A decode step reads the device on the host at most once (its sampled ids, with logprobs):
counted on the CPU with `tests.host_syncs`, which counts every call that would wait for a GPU.
Eagerly, and through the static-shape decode step (`serving.engine.compiled`): uncompiled, and
with its block compiled (a dispatch mode runs a compiled frame's code eagerly, so what is counted
there is the same bucketed code's every operation).
"""

from __future__ import annotations

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.serving.engine import LLMEngine
from tessera.serving.types import GenerationRequest, SamplingParams
from tests.host_syncs import HostSyncs
from tests.serving_helper import run_decode_steps

GREEDY = [dict(temperature=0), dict(temperature=0, logprobs=2)]
SAMPLED = [dict(temperature=0), dict(temperature=0.9, seed=7),
           dict(temperature=0.8, top_k=20, top_p=0.9, seed=3),
           dict(temperature=1.1, top_p=0.5, seed=5, logprobs=3),
           dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.4)]


def decode_requests(settings: list[dict], new: int = 12) -> list[GenerationRequest]:
    """One request per entry of `settings`, prompts of mixed lengths; the last one shares the
    first one's prompt prefix (a prefix-cache hit)."""
    prompts = [[5 + (i * 7 + j) % 400 for j in range(9 + 3 * i)] for i in range(len(settings))]
    prompts[-1] = prompts[0] + [11, 12]
    return [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=new, ignore_eos=True, **s))
            for i, (p, s) in enumerate(zip(prompts, settings))]


def tiny_engine(device: str = "cpu", dtype: torch.dtype = torch.float32,
                compile_decode: bool | str = False) -> LLMEngine:
    """A paged, prefix-caching engine of a tiny Llama, stepped by the caller."""
    model = build_model(ModelConfig.from_name("llama-tiny", init_std=0.1,
                                              max_position_embeddings=64), seed=0)
    engine = LLMEngine(model.to(device=device, dtype=dtype).eval(), max_batch=8,
                       background=False, compile_decode=compile_decode)
    assert engine.blocks is not None and engine.blocks.prefix_caching
    return engine


@pytest.mark.parametrize("compile_decode", [False, "static", "eager"],
                         ids=["eager", "bucketed", "bucketed-compiled"])
@pytest.mark.parametrize("settings", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_decode_step_syncs_with_the_host_at_most_once(settings, compile_decode):
    counts: list[int] = []

    def counted(step) -> None:
        with HostSyncs() as syncs:
            step()
        counts.append(syncs.total)

    with tiny_engine(compile_decode=compile_decode) as engine:
        assert (engine.executor.runner.decode is not None) == bool(compile_decode)
        steps = run_decode_steps(engine, decode_requests(settings), counted)
    assert steps >= 10, steps  # the test measured the decode steps it meant to
    assert max(counts) <= 1, counts
