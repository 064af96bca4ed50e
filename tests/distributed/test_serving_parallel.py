"""Tensor- and pipeline-parallel serving on gloo ranks through the engine's step protocol (no
HTTP): greedy (and seeded) outputs equal the single-process engine's, for a checkpoint saved
under another layout; a signal on a worker rank stops every rank. The paged KV cache (the
default) and wave 1's slots give the same outputs, on one rank and on several, also with a
pool small enough that requests are preempted and recomputed (tp2 x pp2)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist

from tessera.core import ModelConfig, build_model
from tessera.core.checkpoint import save_checkpoint
from tessera.serving.engine.distributed import start_rank
from tessera.serving.engine.kv_config import KVCacheConfig
from tests.distributed_helper import run_ranks
from tests.serving_helper import collect

# Grouped-query attention, and a vocabulary that tp 2 must pad.
LLAMA = dict(vocab_size=1003, init_std=0.1)
GPT2 = dict(init_std=0.1)  # tied embeddings: the last stage keeps its own copy under pp


def _requests():
    from tessera.serving.types import GenerationRequest, SamplingParams

    prompts = [[1, 17, 42], list(range(5, 45)), [7], [1, *range(100, 130, 3)], [3, 3, 3]]
    settings = [dict(temperature=0), dict(temperature=0), dict(temperature=0, task="alpha"),
                dict(temperature=0.8, seed=5), dict(temperature=0, repetition_penalty=1.2)]
    out = []
    for i, (prompt, s) in enumerate(zip(prompts, settings)):
        s = dict(s)
        task = s.pop("task", None)
        out.append(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=10, **s), task))
    return out


SLOTS = KVCacheConfig(kind="slots")
# 15 usable blocks of 4 tokens for 3 running requests of up to 50: preemption and recompute.
TIGHT = KVCacheConfig(block_size=4, num_blocks=16)


def _serve(path: str, tp: int, pp: int, kv: KVCacheConfig | None = None, **engine_kwargs):
    """Every rank: serve the requests. Rank 0 returns its engine and the outputs, others None."""
    tables = {"alpha": torch.randn(4, 64, generator=torch.Generator().manual_seed(0))}
    engine = start_rank(path, tp=tp, pp=pp, max_batch=3, max_step_tokens=16, tasks=tables,
                        tokenizer=None, kv=kv, **engine_kwargs)
    if engine is None:
        return None
    results = collect(engine, _requests())
    return engine, [(r.token_ids, r.finish_reason) for r in results]


def _body(rank: int, world: int, checkpoints: dict[str, str], layout: tuple[int, int]):
    tp, pp = layout
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    out = {}
    runs = [(name, path, None) for name, path in checkpoints.items()]
    runs.append(("llama_slots" if world == 2 else "llama_tight", checkpoints["llama"],
                 SLOTS if world == 2 else TIGHT))
    for name, path, kv in runs:
        served = _serve(path, tp, pp, kv)
        if served is not None:
            engine, out[name] = served
            if name == "llama_tight":
                out["preempted"] = engine.stats()["preemptions_total"]
            engine.shutdown()
    if world == 2:  # speculative rows (1 + k tokens, every logit kept) over tensor parallelism
        from tessera.serving.engine.speculative import SpeculativeConfig

        served = _serve(checkpoints["llama"], tp, pp, speculative=SpeculativeConfig("ngram", 3))
        if served is not None:
            engine, out["llama_ngram"] = served
            out["spec_rows"] = engine.stats()["spec_verify_steps_total"]
            engine.shutdown()
    if world == 2:  # a SIGTERM on a worker stops every rank, rank 0's engine included
        served = _serve(checkpoints["llama"], tp, pp)
        if served is None:
            return None  # worker: its loop returned after voting to stop
        engine, _ = served
        stopped = threading.Event()
        engine.on_stop(stopped.set)
        os.kill(pids[1], signal.SIGTERM)
        assert stopped.wait(20), "rank 0 did not hear the worker's stop vote"
        assert not engine.alive and engine.stats()["healthy"] == 0.0
        out["stopped_by_worker"] = True
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoints saved single-process, and the single-process engine's outputs for them."""
    root = tmp_path_factory.mktemp("serving")
    paths, reference = {}, {}
    for name, preset, overrides in (("llama", "llama-tiny", LLAMA), ("gpt2", "gpt2-tiny", GPT2)):
        model = build_model(ModelConfig.from_name(preset, **overrides), seed=3)
        paths[name] = str(save_checkpoint(root / name, model))
        engine, reference[name] = _serve(paths[name], 1, 1)
        engine.shutdown()
    engine, slots = _serve(paths["llama"], 1, 1, SLOTS)  # wave 1's engine
    engine.shutdown()
    assert slots == reference["llama"]
    return paths, reference


def test_tp2_serving_matches_one_process_and_stops_on_a_worker_signal(checkpoints):
    paths, reference = checkpoints
    out = run_ranks(_body, 2, {"llama": paths["llama"]}, (2, 1), timeout=120)[0]
    assert out["llama"] == out["llama_slots"] == reference["llama"]
    # Speculation: greedy (and penalized, not speculated) outputs unchanged; the seeded sampled
    # request (r3) draws differently under speculation, so it is left out.
    assert [o for i, o in enumerate(out["llama_ngram"]) if i != 3] == \
        [o for i, o in enumerate(reference["llama"]) if i != 3]
    assert out["spec_rows"] > 0
    assert out["stopped_by_worker"]


def test_tp2_pp2_serving_matches_one_process(checkpoints):
    paths, reference = checkpoints
    out = run_ranks(_body, 4, paths, (2, 2), timeout=150)[0]
    assert out.pop("preempted") > 0
    assert out.pop("llama_tight") == reference["llama"]
    assert out == reference
