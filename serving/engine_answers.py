"""Greedy answers of a model held in memory, through the engine `tessera serve` runs
(`LLMEngine`: paged KV cache, continuous batching, its sampler), for callers that may not import
serving: the root command hands `greedy_answers` to `tessera tune --eval-engine`, so validation
generates as the server will.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tessera.core.models.decoder.model import GPTModel
from tessera.core.tokenizer import Tokenizer
from tessera.serving.engine import LLMEngine
from tessera.serving.types import GenerationRequest, SamplingParams


def greedy_answers(model: GPTModel, tokenizer: Tokenizer, prompts: Sequence[list[int]],
                   max_tokens: Sequence[int], max_batch: int = 8) -> list[list[int]]:
    """Each prompt's greedy continuation (at most its `max_tokens`, ending at EOS, which is
    dropped). The model is used as it is (adapters merged beforehand, in eval mode)."""
    if len(prompts) != len(max_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    if not prompts:
        return []
    engine = LLMEngine(model, tokenizer, max_batch=max(1, min(max_batch, len(prompts))), seed=0)

    async def answer(i: int) -> list[int]:
        request = GenerationRequest(f"eval-{i}", list(prompts[i]),
                                    SamplingParams(max_tokens=max(1, max_tokens[i]),
                                                   temperature=0.0))
        return [t async for out in engine.generate(request) for t in out.token_ids]

    async def every() -> list[list[int]]:
        return list(await asyncio.gather(*(answer(i) for i in range(len(prompts)))))

    try:
        answers = asyncio.run(every())
    finally:
        engine.shutdown()
    eos = tokenizer.eos_id
    return [a[: a.index(eos)] if eos is not None and eos in a else a for a in answers]
