"""A deterministic stand-in for `LLMEngine`, implementing the `serving.types.Engine` protocol.

Characters are tokens (id = code point + 3; BOS = 1, EOS = 2), and the "model" answers with
the prompt reversed, repeated up to `max_tokens`:

    "abc" -> "cbacba..."        task "t" -> "[t]cba..."        seed s (temperature > 0) ->
                                                               the answer rotated by s

Prompts containing these words misbehave on purpose:
    FAIL  -> two tokens, then a final output with finish_reason "error"
    RAISE -> one token, then the iterator raises RuntimeError
    SLOW  -> 0.2 s per token           HANG -> no output at all (for timeouts)

Each generated token i has logprob -(i+1)/10 and top alternatives (token+j: logprob - j).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tessera.serving.types import (
    GenerationOutput,
    GenerationRequest,
    Overloaded,
    RequestError,
    TokenLogprob,
)

BOS, EOS, OFFSET = 1, 2, 3
VOCAB = 0x110000 + OFFSET


class FakeEngine:
    model_name = "fake"
    vocab_size = VOCAB

    def __init__(self, *, tasks: tuple[str, ...] = ("qa", "sentiment"), context: int = 256,
                 capacity: int = 1000, delay_s: float = 0.0) -> None:
        self._tasks, self.context, self.capacity, self.delay_s = list(tasks), context, capacity, delay_s
        self.active: set[str] = set()
        self.started: list[GenerationRequest] = []
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.alive = True

    # ------------------------------------------------------------------------ protocol

    def tasks(self) -> list[str]:
        return list(self._tasks)

    def max_context(self) -> int:
        return self.context

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([BOS] if add_bos else []) + [ord(c) + OFFSET for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i - OFFSET) for i in ids if i >= OFFSET)

    def validate(self, request: GenerationRequest) -> None:
        p, ids = request.params, request.prompt_ids
        if not ids:
            raise RequestError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= VOCAB:
            raise RequestError("a prompt token id is outside the vocabulary")
        if request.task is not None and request.task not in self._tasks:
            raise RequestError(f"unknown task {request.task!r}")
        if len(ids) >= self.context:
            raise RequestError(f"the prompt has {len(ids)} tokens, the context is {self.context}")
        if p.max_tokens < 0 or (p.logprobs is not None and not 0 <= p.logprobs <= 20):
            raise RequestError("bad max_tokens or logprobs")

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        self.validate(request)
        if len(self.active) >= self.capacity:
            raise Overloaded(f"{len(self.active)} requests running")
        self.active.add(request.request_id)
        self.started.append(request)
        return self._run(request)

    def stats(self) -> dict[str, float]:
        return {"running": len(self.active), "waiting": 0,
                "kv_cache_usage": len(self.active) / self.capacity, "steps_total": 7}

    # --------------------------------------------------------------------------- model

    def answer(self, request: GenerationRequest) -> str:
        """The text this engine generates for `request` before stops and lengths."""
        source = self.decode(request.prompt_ids)[::-1] or "."
        p = request.params
        if p.temperature > 0 and p.seed:
            k = p.seed % len(source)
            source = source[k:] + source[:k]
        prefix = f"[{request.task}]" if request.task else ""
        text = prefix + source * (p.max_tokens // len(source) + 1)
        return text[:p.max_tokens]

    async def _run(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        p, rid, prompt = request.params, request.request_id, self.decode(request.prompt_ids)
        text, reason = self.answer(request), "length"
        cuts = [text.find(s) for s in p.stop if s in text]
        if cuts:
            text, reason = text[:min(cuts)], "stop"
        delay = 0.2 if "SLOW" in prompt else self.delay_s
        prompt_lps = None
        if p.prompt_logprobs:
            prompt_lps = [None] + [TokenLogprob(t, -0.5, {}) for t in request.prompt_ids[1:]]
        done = False
        try:
            if "HANG" in prompt:
                await asyncio.sleep(3600)
            if not text:
                done = True
                yield GenerationOutput(rid, [], "", prompt_logprobs=prompt_lps, finished=True,
                                       finish_reason=reason, prompt_tokens=len(request.prompt_ids))
                return
            for i, char in enumerate(text):
                await asyncio.sleep(delay)
                if "FAIL" in prompt and i == 2:
                    done = True
                    yield GenerationOutput(rid, [], "", finished=True, finish_reason="error",
                                           prompt_tokens=len(request.prompt_ids),
                                           completion_tokens=i, error="injected failure")
                    return
                if "RAISE" in prompt and i == 1:
                    raise RuntimeError("injected exception")
                token = ord(char) + OFFSET
                lp = None
                if p.logprobs is not None:
                    value = -(i + 1) / 10
                    lp = [TokenLogprob(token, value, {token + j: value - j for j in range(p.logprobs)})]
                last = i == len(text) - 1
                done = last
                yield GenerationOutput(
                    rid, [token], char, logprobs=lp, prompt_logprobs=prompt_lps if i == 0 else None,
                    finished=last, finish_reason=reason if last else None,
                    prompt_tokens=len(request.prompt_ids), completion_tokens=i + 1)
        finally:
            self.active.discard(rid)
            (self.finished if done else self.aborted).add(rid)
