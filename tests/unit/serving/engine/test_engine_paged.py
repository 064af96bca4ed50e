"""The paged engine (the default) against wave 1's slot engine and the full forward pass;
prefix caching, eviction and preemption never change an output; priorities order the queue.

References: the slot-cache engine (`KVCacheConfig(kind="slots")`, wave 1's engine, which
`test_engine.py` checks against the full forward pass) and the model's own full forward pass.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.paged_kv_cache import PagedKVCache
from tessera.serving.engine import LLMEngine
from tessera.serving.engine.kv_config import KVCacheConfig
from tessera.serving.http.metrics import ServingMetrics
from tessera.serving.types import GenerationRequest, SamplingParams
from tests.serving_helper import collect, full_forward_greedy

FAMILIES = ["gpt2-tiny", "llama-tiny", "nemotron-tiny"]
SLOTS = KVCacheConfig(kind="slots")


def _model(name: str, seed: int = 0):
    return build_model(ModelConfig.from_name(name, init_std=0.1), seed=seed).eval()


def _req(prompt, rid, task=None, salt=None, **params) -> GenerationRequest:
    params.setdefault("ignore_eos", True)
    return GenerationRequest(rid, list(prompt), SamplingParams(**params), task=task,
                             cache_salt=salt)


def _mixed(n: int, seed: int = 0, vocab: int = 512) -> list[GenerationRequest]:
    """Greedy, seeded and penalized requests of mixed prompt and output lengths."""
    g = torch.Generator().manual_seed(seed)
    settings = [dict(temperature=0), dict(temperature=0.9, seed=7),
                dict(temperature=0.8, top_k=20, top_p=0.9, seed=3),
                dict(temperature=0, repetition_penalty=1.3, presence_penalty=0.4)]
    out = []
    for i in range(n):
        length = int(torch.randint(3, 60, (), generator=g))
        prompt = torch.randint(1, vocab, (length,), generator=g).tolist()
        out.append(_req(prompt, f"r{i}", max_tokens=4 + (7 * i) % 21, **settings[i % 4]))
    return out


def _outputs(model, requests, **engine_kwargs) -> tuple[list, dict]:
    with LLMEngine(model, **engine_kwargs) as engine:
        results = collect(engine, requests)
        stats = engine.stats()
    assert all(r.finish_reason == "length" for r in results), [r.final.error for r in results]
    return [r.token_ids for r in results], stats


def _track_running(engine: LLMEngine) -> list[int]:
    """Record the number of running requests at every forward pass."""
    seen, run = [], engine.executor.run

    def counting(batch):
        seen.append(len(engine.scheduler.running))
        return run(batch)

    engine.executor.run = counting
    return seen


# --------------------------------------------------------------------------- (1) parity


@pytest.mark.parametrize("name", FAMILIES)
def test_paged_equals_slots_and_the_full_forward_pass_under_churn(name):
    model = _model(name)
    requests = _mixed(7, seed=1)
    # 7 requests through 3 running places; blocks of 4 tokens: many blocks per row, chunked
    # prefill (16-token budget) across block boundaries.
    slots, _ = _outputs(model, requests, max_batch=3, max_step_tokens=16, kv=SLOTS)
    paged, stats = _outputs(model, requests, max_batch=3, max_step_tokens=16,
                            kv=KVCacheConfig(block_size=4))
    assert paged == slots
    assert stats["kv_blocks_used"] == 0 and stats["requests_finished_length_total"] == 7
    # (test_engine.py checks the default engine, paged, against the full forward pass at length)
    greedy = requests[0]
    assert greedy.params.temperature == 0 and greedy.params.repetition_penalty == 1.0
    assert paged[0] == full_forward_greedy(model, greedy.prompt_ids, len(paged[0]))[0]


# --------------------------------------------------------------------------- (2) prefix cache


def test_a_shared_200_token_prefix_is_computed_once_and_changes_nothing():
    model = _model("llama-tiny", seed=1)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(1, 512, (200,), generator=g).tolist()
    suffixes = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 9, 14, 3)]
    requests = [_req(prefix + s, f"s{i}", max_tokens=6, temperature=0 if i % 2 else 0.7, seed=i)
                for i, s in enumerate(suffixes)]
    cold, cold_stats = _outputs(model, requests, max_batch=4,
                                kv=KVCacheConfig(prefix_caching=False))
    with LLMEngine(model, max_batch=4) as engine:  # paged, prefix caching on: the default
        first = collect(engine, requests[:1])  # fills the cache with the prefix's blocks
        rest = collect(engine, requests[1:])  # these three start on it
        stats = engine.stats()
        metrics = ServingMetrics(engine, "m", lambda: 0).render().decode()
    assert [r.token_ids for r in first + rest] == cold
    hit = 3 * (200 // 16) * 16  # full blocks of the shared prefix, for each later request
    assert stats["prefix_cache_hits_tokens_total"] == hit
    assert stats["prefix_cache_queries_tokens_total"] == sum(len(r.prompt_ids) for r in requests)
    assert stats["computed_tokens_total"] == cold_stats["computed_tokens_total"] - hit
    assert cold_stats["prefix_cache_hits_tokens_total"] == 0
    assert f'tessera:prefix_cache_hits_total{{model_name="m"}} {float(hit)}' in metrics
    assert 'tessera:kv_cache_blocks_used{model_name="m"} 0.0' in metrics


def test_salts_and_tasks_never_share_blocks():
    model = _model("llama-tiny", seed=3)
    tables = {n: torch.randn(3, 64, generator=torch.Generator().manual_seed(i))
              for i, n in enumerate(("alpha", "beta"))}
    prompt = list(range(1, 60))
    variants = [dict(salt="tenant-a"), dict(salt="tenant-b"), dict(), dict(task="alpha"),
                dict(task="beta"), dict(task="alpha", salt="tenant-a")]
    with LLMEngine(model, tasks=tables, max_batch=2) as engine:
        hits, outputs = [], []
        for v in variants:  # one at a time: each could only hit the ones before it
            outputs.append(collect(engine, [_req(prompt, "x", max_tokens=4, temperature=0,
                                                 **v)])[0].token_ids)
            hits.append(engine.stats()["prefix_cache_hits_tokens_total"])
        assert hits == [0] * len(variants)
        again = collect(engine, [_req(prompt, "y", max_tokens=4, temperature=0, task="beta")])
        assert engine.stats()["prefix_cache_hits_tokens_total"] == (59 // 16) * 16
    assert again[0].token_ids == outputs[4]
    assert outputs[0] == outputs[1] == outputs[2] != outputs[3]  # salts change nothing else


def test_eviction_under_memory_pressure_loses_no_request():
    model = _model("gpt2-tiny", seed=4)
    requests = _mixed(10, seed=5)
    reference, _ = _outputs(model, requests, max_batch=4, kv=SLOTS)
    # 12 usable blocks of 8 (96 tokens) for 10 requests of up to 80 tokens, 4 at a time:
    # cached blocks are evicted and running requests preempted all along.
    paged, stats = _outputs(model, requests, max_batch=4,
                            kv=KVCacheConfig(block_size=8, num_blocks=13))
    assert paged == reference
    assert stats["kv_block_evictions_total"] > 0 and stats["preemptions_total"] > 0


# --------------------------------------------------------------------------- (3) memory


def test_same_memory_admits_several_times_more_requests_and_a_burst_completes():
    model = _model("nemotron-tiny", seed=6)
    requests = _mixed(24, seed=7)  # 3-59 prompt tokens, 4-24 new tokens
    c = model.config
    with LLMEngine(model, max_batch=4, kv=SLOTS) as slots:
        slot_bytes = slots.executor.runner.cache.nbytes()
        slot_peak = _track_running(slots)
        reference = [r.token_ids for r in collect(slots, requests)]
    per_block = PagedKVCache.block_bytes(c.num_layers, 16, c.num_kv_heads, c.head_dim,
                                         torch.float32)
    same_memory = KVCacheConfig(num_blocks=slot_bytes // per_block)  # scratch block included
    with LLMEngine(model, max_batch=64, max_step_tokens=2048, kv=same_memory) as paged:
        assert paged.executor.runner.cache.nbytes() == slot_bytes
        paged_peak = _track_running(paged)
        outputs = [r.token_ids for r in collect(paged, requests)]
        stats = paged.stats()
    ratio = max(paged_peak) / max(slot_peak)
    print(f"\nsame KV memory ({slot_bytes} bytes): slots ran {max(slot_peak)} requests at once, "
          f"paged {max(paged_peak)} ({ratio:.1f}x), {stats['preemptions_total']:.0f} preempted")
    assert max(slot_peak) == 4 and ratio >= 3
    assert outputs == reference
    assert stats["requests_finished_length_total"] == 24 and stats["kv_blocks_used"] == 0


def test_priorities_run_first_and_equal_ones_in_arrival_order():
    model = _model("llama-tiny", seed=8)
    with LLMEngine(model, max_batch=1) as engine:
        entered, release = threading.Event(), threading.Event()
        run = engine.executor.run

        def gated(batch):  # hold the first pass until every request has queued
            entered.set()
            release.wait(10)
            return run(batch)

        engine.executor.run = gated
        finished: list[str] = []

        async def drain(stream, rid):
            async for out in stream:
                if out.finished:
                    finished.append(rid)

        async def main():
            tasks = [asyncio.create_task(drain(engine.generate(_req([1, 2], "first",
                                                                     max_tokens=2)), "first"))]
            await asyncio.to_thread(entered.wait, 10)
            for rid, priority in (("late", 0), ("urgent", -1), ("later", 0), ("low", 3)):
                request = _req([1, 3], rid, max_tokens=2)
                request.priority = priority
                tasks.append(asyncio.create_task(drain(engine.generate(request), rid)))
            await asyncio.sleep(0.05)
            release.set()
            await asyncio.gather(*tasks)

        asyncio.run(main())
    assert finished == ["first", "urgent", "late", "later", "low"]
