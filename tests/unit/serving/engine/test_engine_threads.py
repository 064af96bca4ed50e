"""Where the engine's step loop runs: a background thread, or the caller's (`run`, `run_beside`).

The caller's thread is the fast one on CPU (see `serving.engine.bridge`); both must give the same
tokens, and an engine driven by `run_beside` must stay usable between calls.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.serving.engine import LLMEngine, run_beside
from tessera.serving.types import GenerationRequest, SamplingParams
from tests.serving_helper import full_forward_greedy


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.from_name("llama-tiny", init_std=0.1), seed=0).eval()


def _requests(n: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(3)
    return [GenerationRequest(f"r{i}", torch.randint(3, 500, (5 + i,), generator=gen).tolist(),
                              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            for i in range(n)]


async def _tokens(engine: LLMEngine, requests: list[GenerationRequest]) -> list[list[int]]:
    async def one(request):
        return [t async for out in engine.generate(request) for t in out.token_ids]
    return list(await asyncio.gather(*(one(r) for r in requests)))


def test_run_beside_steps_on_the_calling_thread_and_matches_the_reference(model):
    engine = LLMEngine(model, max_batch=4, background=False)
    threads = set()
    engine.add_observer(lambda name, value: threads.add(threading.current_thread().name))
    requests = _requests(3)
    first = run_beside(engine, lambda: _tokens(engine, requests))
    again = run_beside(engine, lambda: _tokens(engine, _requests(3)))  # still usable
    assert threads == {threading.current_thread().name}
    for request, tokens in zip(requests, first):
        assert tokens == full_forward_greedy(model, request.prompt_ids, 6)[0]
    assert again == first and engine.alive
    engine.shutdown()
    assert not engine.alive


def test_background_engine_gives_the_same_tokens(model):
    with LLMEngine(model, max_batch=4) as background:
        expected = asyncio.run(_tokens(background, _requests(3)))
    engine = LLMEngine(model, max_batch=4, background=False)
    assert run_beside(engine, lambda: _tokens(engine, _requests(3))) == expected
    with pytest.raises(RuntimeError, match="background=False"):
        with LLMEngine(model, max_batch=2) as other:
            run_beside(other, lambda: _tokens(other, []))


def test_run_returns_after_shutdown_from_another_thread(model):
    engine = LLMEngine(model, max_batch=2, background=False)
    timer = threading.Timer(0.2, engine.shutdown)
    timer.start()
    engine.run()  # blocks until the timer shuts it down
    assert not engine.alive
    with pytest.raises(RuntimeError, match="background thread"):
        LLMEngine(model, max_batch=2).run()


def test_errors_in_the_work_reach_the_caller(model):
    engine = LLMEngine(model, max_batch=2, background=False)

    async def broken():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        run_beside(engine, broken)
    assert engine.alive
