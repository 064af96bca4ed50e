"""The generation engine against the full forward pass, and its behaviour under batching.

References are the model's own full forward pass (no KV cache, one sequence at a time) and the
same requests sent one at a time. Models are tiny with random weights; the tokenizer is trained
here on Python's own sources.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import tessera.serving.engine.outputs as engine_module
from tessera.core import ModelConfig, build_model
from tessera.core.prompts import FixedPrompt, VirtualPrompts, attach_prompts
from tessera.serving.engine import LLMEngine
from tessera.serving.types import GenerationRequest, Overloaded, RequestError, SamplingParams
from tests.serving_helper import collect, full_forward_greedy, one_at_a_time, train_tiny_tokenizer

FAMILIES = ["gpt2-tiny", "llama-tiny", "nemotron-tiny"]


def _model(name: str, seed: int = 0):
    # init_std 0.1: peakier distributions than the default, so greedy choices are clear-cut.
    return build_model(ModelConfig.from_name(name, init_std=0.1), seed=seed).eval()


def _req(prompt: list[int], rid: str = "r", **params) -> GenerationRequest:
    timeout = params.pop("timeout_s", None)
    task = params.pop("task", None)
    return GenerationRequest(rid, list(prompt), SamplingParams(**params), task=task,
                             timeout_s=timeout)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def llama():
    return _model("llama-tiny", seed=1)


@pytest.fixture(scope="module")
def engine(llama, tokenizer):
    with LLMEngine(llama, tokenizer, max_batch=4, max_step_tokens=24, seed=0) as eng:
        yield eng


# --------------------------------------------------------------------------- (a) exactness


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_argmax_of_the_full_forward_pass(name):
    model = _model(name)
    # 4 requests on 3 slots (one waits), one prompt prefilled in 3 chunks (budget 16 tokens).
    prompts = [[1, 17, 42], list(range(5, 45)), [7], [1, *range(100, 130, 3)]]
    with LLMEngine(model, max_batch=3, max_step_tokens=16) as engine:
        results = collect(engine, [_req(p, f"r{i}", max_tokens=10, temperature=0)
                                   for i, p in enumerate(prompts)])
    for prompt, result in zip(prompts, results):
        expected, _ = full_forward_greedy(model, prompt, 10)
        assert result.token_ids == expected
        assert result.finish_reason == "length" and result.final.completion_tokens == 10
        assert result.final.prompt_tokens == len(prompt)


# --------------------------------------------------------------------------- (b) batching


def _mixed_requests(tokenizer) -> list[GenerationRequest]:
    texts = ["def parse(self, args", "import json", "Grüße aus", "the parser", "class Namespace:",
             "return", "日本", "    if not"]
    settings = [
        dict(temperature=0),
        dict(temperature=0.8, seed=1),
        dict(temperature=1.0, top_k=20, seed=2),
        dict(temperature=0.7, top_p=0.8, seed=3),
        dict(temperature=0, repetition_penalty=1.3),
        dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.7, seed=4),
        dict(temperature=0, stop=["e", "\n"]),
        dict(temperature=1.2, top_k=50, top_p=0.95, seed=5, stop=["s"], min_tokens=2),
    ]
    out = []
    for i in range(16):
        prompt = tokenizer.encode(texts[i % len(texts)] * (1 + i % 4), bos=True)
        out.append(_req(prompt, f"r{i}", max_tokens=4 + (5 * i) % 19, ignore_eos=i % 2 == 0,
                        **settings[i % len(settings)]))
    return out


def test_continuous_batching_gives_the_same_outputs_as_one_at_a_time(engine, tokenizer):
    requests = _mixed_requests(tokenizer)
    together = collect(engine, requests)  # 16 requests on 4 slots: join and leave mid-flight
    alone = one_at_a_time(engine, requests)
    for a, b in zip(together, alone):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.final.completion_tokens == b.final.completion_tokens
    assert {r.finish_reason for r in together} <= {"stop", "length"}
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["requests_finished_error_total"] == 0


def test_seeded_sampling_is_reproducible_and_seeds_matter(engine, tokenizer):
    prompt = tokenizer.encode("import json", bos=True)
    runs = collect(engine, [_req(prompt, str(s), max_tokens=12, temperature=1.0, seed=s,
                                 ignore_eos=True) for s in (7, 7, 8)])
    assert runs[0].token_ids == runs[1].token_ids != runs[2].token_ids


# --------------------------------------------------------------------------- (c) outputs


def test_stop_strings_are_cut_and_never_streamed(engine, tokenizer):
    prompt = tokenizer.encode("def parse(self, args", bos=True)
    free = collect(engine, [_req(prompt, max_tokens=40, temperature=0, ignore_eos=True)])[0]
    text = free.text
    start = next(i for i in range(len(text) // 3, len(text) - 3)
                 if "\ufffd" not in text[i:i + 3] and text.find(text[i:i + 3]) == i)
    stop = text[start:start + 3]
    stopped = collect(engine, [_req(prompt, max_tokens=40, temperature=0, ignore_eos=True,
                                    stop=["never-there", stop])])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:start]
    assert all(stop not in e.text for e in stopped.events)
    assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)]
    sent = ""
    for event in stopped.events:  # what was streamed so far is always final text
        sent += event.text
        assert text[:start].startswith(sent)


def _greedy_with_ban(model, prompt, n, banned_token, min_tokens):
    """Full-forward greedy where `banned_token` may not come before `min_tokens` tokens and
    ends the sequence (as its last token: no text, but its id and logprob) when it comes."""
    ids = list(prompt)
    for j in range(n):
        logits = model(torch.tensor([ids]))[0, -1]
        if j < min_tokens:
            logits[banned_token] = float("-inf")
        token = int(logits.argmax())
        if token == banned_token:
            return ids[len(prompt):] + [token], "stop"
        ids.append(token)
    return ids[len(prompt):], "length"


@torch.no_grad()
def test_min_tokens_ignore_eos_and_stop_token_ids(llama, tokenizer):
    prompt = tokenizer.encode("class Namespace:", bos=True)
    first, _ = full_forward_greedy(llama, prompt, 1)
    x = first[0]  # the token greedy decoding wants first: make it the EOS / a stop id
    with LLMEngine(llama, tokenizer, eos_id=x, max_batch=4) as eng:
        plain, ignore, at_least = collect(eng, [
            _req(prompt, "a", max_tokens=8, temperature=0),
            _req(prompt, "b", max_tokens=8, temperature=0, ignore_eos=True),
            _req(prompt, "c", max_tokens=8, temperature=0, min_tokens=4)])
    assert (plain.token_ids, plain.finish_reason, plain.final.completion_tokens) == ([x], "stop", 1)
    assert plain.text == ""
    assert ignore.token_ids == full_forward_greedy(llama, prompt, 8)[0]
    assert ignore.finish_reason == "length" and ignore.token_ids[0] == x
    expected, reason = _greedy_with_ban(llama, prompt, 8, x, 4)
    assert (at_least.token_ids, at_least.finish_reason) == (expected, reason)
    assert len(at_least.token_ids) >= 4
    with LLMEngine(llama, tokenizer, max_batch=2) as eng:  # the same through stop_token_ids
        stopped, late = collect(eng, [
            _req(prompt, "d", max_tokens=8, temperature=0, stop_token_ids=[x]),
            _req(prompt, "e", max_tokens=8, temperature=0, stop_token_ids=[x], min_tokens=4,
                 ignore_eos=True)])
    assert (stopped.token_ids, stopped.finish_reason, stopped.text) == ([x], "stop", "")
    assert (late.token_ids, late.finish_reason) == (expected, reason)


@torch.no_grad()
def test_logprobs_and_prompt_logprobs_equal_the_full_forward_pass(engine, llama, tokenizer):
    prompt = tokenizer.encode("def parse(self, args, namespace=None):\n" * 2, bos=True)
    assert len(prompt) > 24  # prefilled in chunks: prompt logprobs come from several steps
    greedy, sampled, echo = collect(engine, [
        _req(prompt, "g", max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=True,
             ignore_eos=True),
        _req(prompt, "s", max_tokens=6, temperature=0.9, seed=3, logprobs=2, ignore_eos=True),
        _req(prompt, "e", max_tokens=0, prompt_logprobs=True)])
    for result, k in ((greedy, 5), (sampled, 2)):
        generated = result.token_ids
        assert len(generated) == 6 and len(result.logprobs) == 6
        full = llama(torch.tensor([prompt + generated]))[0].float().log_softmax(-1)
        for j, lp in enumerate(result.logprobs):
            row = full[len(prompt) + j - 1]
            assert lp.token_id == generated[j]
            assert lp.logprob == pytest.approx(float(row[generated[j]]), abs=1e-4)
            values, ids = row.topk(k)
            assert list(lp.top) == ids.tolist()
            assert list(lp.top.values()) == pytest.approx(values.tolist(), abs=1e-4)
    full = llama(torch.tensor([prompt]))[0].float().log_softmax(-1)
    for result in (greedy, echo):
        scored = result.events[0].prompt_logprobs
        assert len(scored) == len(prompt) and scored[0] is None
        for i in range(1, len(prompt)):
            assert scored[i].token_id == prompt[i]
            assert scored[i].logprob == pytest.approx(float(full[i - 1, prompt[i]]), abs=1e-4)
    assert greedy.events[0].prompt_logprobs[1].top.keys() == set(full[0].topk(5).indices.tolist())
    assert (echo.token_ids, echo.finish_reason, len(echo.events)) == ([], "length", 1)


# --------------------------------------------------------------------------- (d) failures


@pytest.mark.parametrize("fields, message", [
    (dict(prompt=list(range(256))), "context is 256"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[1, 600]), "outside the vocabulary"),
    (dict(task="nope"), "unknown task 'nope'"),
    (dict(max_tokens=-1), "max_tokens must be >= 0"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(logprobs=50), "logprobs"),
    (dict(stop_token_ids=[9999]), "stop_token_ids"),
    (dict(stop=[""]), "stop strings"),
    (dict(timeout_s=0), "timeout_s"),
])
def test_bad_requests_are_refused_up_front(engine, fields, message):
    fields = dict(fields)
    prompt = fields.pop("prompt", [1, 2, 3])
    request = _req(prompt, **fields)
    with pytest.raises(RequestError, match=message):
        engine.validate(request)

    async def submit():
        engine.generate(request)

    with pytest.raises(RequestError, match=message):
        asyncio.run(submit())


def _gate(engine: LLMEngine) -> tuple[threading.Event, threading.Event]:
    """Make the engine's forward pass wait for `release`; `entered` is set once it waits."""
    entered, release = threading.Event(), threading.Event()
    run = engine.executor.run

    def gated(batch):
        entered.set()
        release.wait(10)
        return run(batch)

    engine.executor.run = gated
    return entered, release


def test_overloaded_when_the_queue_is_full(llama):
    with LLMEngine(llama, max_batch=1, max_queue=2) as eng:
        entered, release = _gate(eng)

        async def main():
            streams = [eng.generate(_req([1, 2], "a", max_tokens=3, temperature=0))]
            await asyncio.to_thread(entered.wait, 10)  # "a" holds the only slot
            streams += [eng.generate(_req([1, 2], r, max_tokens=3)) for r in "bc"]
            assert eng.stats()["waiting"] == 2
            with pytest.raises(Overloaded):
                eng.generate(_req([1, 2], "d"))
            release.set()
            results = []
            for stream in streams:
                results.append([o async for o in stream])
            return results

        results = asyncio.run(main())
        assert [r[-1].finish_reason for r in results] == ["length"] * 3
        assert eng.stats()["requests_rejected_total"] == 1


def test_one_failing_request_does_not_affect_the_others(engine, tokenizer, monkeypatch):
    prompt = tokenizer.encode("return", bos=True)
    good = [_req(prompt, "g0", max_tokens=8, temperature=0, ignore_eos=True),
            _req(prompt, "g1", max_tokens=8, temperature=0.8, seed=11, ignore_eos=True),
            _req(prompt, "g2", max_tokens=8, temperature=0.5, seed=12, stop=["a"])]
    reference = one_at_a_time(engine, good)
    choose = engine_module.choose_tokens

    def failing_for_one(logits, settings, uniforms=None, banned=None):
        if bool(((settings.temperature - 0.123).abs() < 1e-6).any()):
            raise RuntimeError("injected sampler failure")
        return choose(logits, settings, uniforms, banned)

    monkeypatch.setattr(engine_module, "choose_tokens", failing_for_one)
    bad = _req(prompt, "bad", max_tokens=8, temperature=0.123, seed=1)
    results = collect(engine, [good[0], bad, good[1], good[2]])
    assert results[1].finish_reason == "error"
    assert "injected sampler failure" in results[1].final.error
    for got, want in zip([results[0], results[2], results[3]], reference):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text,
                                                                 want.finish_reason)
    monkeypatch.undo()
    assert collect(engine, [good[0]])[0].token_ids == reference[0].token_ids  # still serving


async def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_closing_or_cancelling_a_stream_aborts_and_frees_its_slot(llama):
    with LLMEngine(llama, max_batch=1) as eng:
        async def main():
            stream = eng.generate(_req([1, 5], "closed", max_tokens=200, temperature=0))
            await stream.__anext__()
            await stream.aclose()  # the client went away
            await _wait_for(lambda: eng.stats()["requests_finished_abort_total"] == 1)

            async def drain(s):
                return [o async for o in s]

            task = asyncio.create_task(drain(eng.generate(_req([1, 6], "cancelled",
                                                              max_tokens=200))))
            await _wait_for(lambda: eng.stats()["running"] == 1)
            task.cancel()  # what the HTTP layer does on disconnect
            await _wait_for(lambda: eng.stats()["requests_finished_abort_total"] == 2)
            # the only slot is free again
            return await drain(eng.generate(_req([1, 7], "next", max_tokens=3)))

        events = asyncio.run(main())
        assert events[-1].finish_reason == "length" and eng.stats()["running"] == 0


def test_timeout_finishes_the_request(llama):
    with LLMEngine(llama, max_batch=2) as eng:
        run = eng.executor.run

        def slow(batch):
            time.sleep(0.01)
            return run(batch)

        eng.executor.run = slow
        slow_one, quick = collect(eng, [
            _req([1, 2], "slow", max_tokens=200, temperature=0, timeout_s=0.15),
            _req([1, 3], "quick", max_tokens=3, timeout_s=30)])
        assert slow_one.finish_reason == "timeout" and 0 < len(slow_one.token_ids) < 200
        assert quick.finish_reason == "length"


# --------------------------------------------------------------------------- (e) tasks


@torch.no_grad()
def test_prompt_tuned_tasks_batch_with_each_other_and_plain_requests():
    model = _model("llama-tiny", seed=2)
    g = torch.Generator().manual_seed(0)
    tables = {"alpha": torch.randn(3, 64, generator=g), "beta": torch.randn(5, 64, generator=g)}
    p, q = [1, 40, 41, 42], [1, 90, 7]
    requests = [_req(p, "a", task="alpha", max_tokens=8, temperature=0),
                _req(p, "b", task="beta", max_tokens=8, temperature=0),
                _req(p, "plain", max_tokens=8, temperature=0),
                _req(q, "a2", task="alpha", max_tokens=8, temperature=0.9, seed=4)]
    with LLMEngine(model, tasks=tables, max_batch=4) as eng:
        assert eng.tasks() == ["alpha", "beta"]
        together = collect(eng, requests)
        alone = one_at_a_time(eng, requests)
        with pytest.raises(RequestError, match="context"):  # virtual tokens count
            eng.validate(_req(list(range(1, 254)), task="alpha"))
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids
    assert len({tuple(r.token_ids) for r in together[:3]}) == 3  # each task changes the output
    assert together[0].final.prompt_tokens == len(p)  # virtual tokens are not prompt tokens
    # Reference: the full forward pass with the task's rows at positions < n_virtual.
    prompts = {n: FixedPrompt(tables[n]) for n in sorted(tables)}
    hook = attach_prompts(model, VirtualPrompts(prompts, rows_from_ids=False))
    for index, name, result in ((0, "alpha", together[0]), (1, "beta", together[1])):
        hook.set_rows(torch.tensor([index]))
        n_virtual = tables[name].shape[0]
        expected, _ = full_forward_greedy(model, [0] * n_virtual + p, 8)
        assert result.token_ids == expected
    model.embedding_hook = None
    assert together[2].token_ids == full_forward_greedy(model, p, 8)[0]


# --------------------------------------------------------------------------- metrics


def test_stats_and_observers(llama):
    seen: list[tuple[str, float]] = []
    with LLMEngine(llama, max_batch=2) as eng:
        eng.add_observer(lambda name, value: seen.append((name, value)))
        collect(eng, [_req([1, 2, 3], "a", max_tokens=4), _req([1, 2], "b", max_tokens=2)])
        stats = eng.stats()
    names = [n for n, _ in seen]
    assert names.count("time_to_first_token_seconds") == 2
    assert names.count("inter_token_latency_seconds") == 3 + 1
    assert names.count("e2e_request_latency_seconds") == 2
    assert stats["prompt_tokens_total"] == 5 and stats["generation_tokens_total"] == 6
    assert stats["requests_finished_length_total"] == 2 and stats["kv_cache_usage"] == 0.0
    assert stats["healthy"] == 1.0
    assert not eng.stats()["healthy"]  # shut down
