"""Shared pieces of the serving tests: a tiny tokenizer, running requests, full-forward references.

    results = collect(engine, [GenerationRequest(...), ...])   # all submitted at once
    results[0].token_ids, results[0].text, results[0].finish_reason, results[0].events
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessera.core.tokenizer import Tokenizer, train_tokenizer
from tessera.serving.types import GenerationOutput, GenerationRequest, TokenLogprob

# Non-ASCII text, so that some characters fall back to byte pieces (multi-byte decoding).
_UNICODE = ["café naïve façade — déjà vu", "Grüße aus Köln: 20 €", "日本語のテキスト", "emoji 🙂 ok"]


def train_tiny_tokenizer(directory: Path, vocab_size: int = 512) -> Tokenizer:
    """A sentencepiece model trained on Python's own sources (no download), `vocab_size` pieces."""
    texts = [Path(m.__file__).read_text() for m in (argparse, json)] + _UNICODE * 3
    return train_tokenizer([], vocab_size, directory / "tokenizer.model", texts=texts,
                           num_threads=1)


@dataclass
class Result:
    events: list[GenerationOutput] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return [lp for e in self.events for lp in (e.logprobs or [])]

    @property
    def final(self) -> GenerationOutput:
        return self.events[-1]

    @property
    def finish_reason(self) -> str | None:
        return self.final.finish_reason


async def _drain(engine, request: GenerationRequest) -> Result:
    result = Result()
    async for out in engine.generate(request):
        result.events.append(out)
    return result


def collect(engine, requests: list[GenerationRequest]) -> list[Result]:
    """Submit all `requests` at once and gather each one's events."""
    async def main():
        return await asyncio.gather(*(_drain(engine, r) for r in requests))

    return asyncio.run(main())


def one_at_a_time(engine, requests: list[GenerationRequest]) -> list[Result]:
    return [collect(engine, [r])[0] for r in requests]


@torch.no_grad()
def full_forward_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by argmax of the full forward pass (no KV cache), and the logits
    `(len(prompt) + n - 1, V)` of the final sequence."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], model(torch.tensor([ids[:-1]]))[0]


@contextlib.contextmanager
def running_server(app, **config) -> Iterator[int]:
    """A real uvicorn server for `app` on 127.0.0.1 and a free port, in a thread; yields the
    port once it accepts connections and stops the server afterwards. `config` goes to
    `serving.http.connections.server_config` (timeouts, connection limits)."""
    import uvicorn

    from tessera.serving.http.connections import server_config

    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=0, log_level="error",
                                          **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def run_decode_steps(engine, requests: list[GenerationRequest],
                     decode_step: Callable[[Callable[[], None]], None]) -> int:
    """Serve `requests` on `engine` (built with `background=False`) step by step in this thread,
    running every step in which all requests decode (no prefill, none waiting) through
    `decode_step(step)`, which must call `step()` once; returns how many such steps ran."""
    n = 0

    async def main() -> None:
        nonlocal n
        streams = [engine.generate(r) for r in requests]
        scheduler = engine.scheduler
        while engine.core.has_requests:
            if scheduler.num_waiting == 0 and all(
                    s.cached == len(s.tokens) - 1 for s in scheduler.running):
                decode_step(engine.core.step)
                n += 1
            else:
                engine.core.step()
        for stream in streams:
            async for _ in stream:
                pass

    asyncio.run(main())
    return n
