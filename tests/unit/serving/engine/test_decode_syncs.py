"""A decode step reads the device on the host at most once (its sampled ids, with logprobs):
counted on the CPU with `tests.host_syncs`, which counts every call that would wait for a GPU.
"""

from __future__ import annotations

import asyncio

import pytest

from tessera.core import ModelConfig, build_model
from tessera.serving.engine import LLMEngine
from tessera.serving.types import GenerationRequest, SamplingParams
from tests.host_syncs import HostSyncs

GREEDY = [dict(temperature=0), dict(temperature=0, logprobs=2)]
SAMPLED = [dict(temperature=0), dict(temperature=0.9, seed=7),
           dict(temperature=0.8, top_k=20, top_p=0.9, seed=3),
           dict(temperature=1.1, top_p=0.5, seed=5, logprobs=3),
           dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.4)]


def _decode_step_syncs(settings: list[dict], new: int = 12) -> list[int]:
    """Host syncs of every decode-only step of a paged, prefix-caching engine serving one
    request per entry of `settings` (two of them share a prompt prefix)."""
    model = build_model(ModelConfig.from_name("llama-tiny", init_std=0.1), seed=0).eval()
    prompts = [[5 + (i * 7 + j) % 400 for j in range(9 + 3 * i)] for i in range(len(settings))]
    prompts[-1] = prompts[0] + [11, 12]  # shares prompt 0's first block
    counts: list[int] = []

    async def main() -> None:
        with LLMEngine(model, max_batch=8, background=False) as engine:
            assert engine.blocks is not None and engine.blocks.prefix_caching
            streams = [engine.generate(GenerationRequest(
                f"r{i}", p, SamplingParams(max_tokens=new, ignore_eos=True, **s)))
                for i, (p, s) in enumerate(zip(prompts, settings))]
            scheduler = engine.scheduler
            while engine.core.has_requests:
                decode_only = scheduler.num_waiting == 0 and all(
                    s.cached == len(s.tokens) - 1 for s in scheduler.running)
                if not decode_only:
                    engine.core.step()
                    continue
                with HostSyncs() as syncs:
                    engine.core.step()
                counts.append(syncs.total)
            for stream in streams:
                async for _ in stream:
                    pass

    asyncio.run(main())
    assert len(counts) >= new - 2, counts  # the test measured the decode steps it meant to
    return counts


@pytest.mark.parametrize("settings", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_decode_step_syncs_with_the_host_at_most_once(settings):
    counts = _decode_step_syncs(settings)
    assert max(counts) <= 1, counts
