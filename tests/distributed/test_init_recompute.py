"""Layout-independent initialization and activation recomputation.

- Init: every tp2 and pp2 rank's parameters are exact slices (`torch.equal`) of the
  single-process model built with the same seed, including the tied output copy.
- Recompute: `full` (whole layers) and `selective` (core attention) give the same loss and
  gradients as `none`, with dropout on (the replay must redraw the same masks), in one process
  and under tp2 with sequence parallelism.
"""

from __future__ import annotations

import pytest
import torch

from tessera.core.config import Layout, ModelConfig, TrainSchedule
from tessera.core.init import build_model
from tessera.core.parallel.groups import init_groups
from tessera.core.parallel.pipeline import build_stages, sync_sequence_parallel_grads
from tessera.core.parallel.random import tracker
from tessera.core.parallel.sharding import shard_tensor, unshard_tensors
from tests.distributed_helper import run_ranks

SEED = 7
MODES = ("none", "full", "selective")


def _config(preset: str, **overrides) -> ModelConfig:
    base = {"hidden_size": 32, "num_layers": 4, "num_heads": 4, "ffn_hidden_size": 64,
            "vocab_size": 1003, "max_position_embeddings": 64}
    return ModelConfig.from_name(preset, **{**base, **overrides})


def _batch(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, config.vocab_size, (4, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _step(config: ModelConfig, layout: Layout, schedule: TrainSchedule | None = None,
          groups=None):
    """Loss and local gradients (by global name) of one forward/backward with dropout on."""
    model = build_model(config, layout, groups, schedule=schedule, seed=SEED)
    model.train()
    tp_rank = 0 if groups is None else groups.tp_rank
    torch.manual_seed(SEED)
    tracker.seed(SEED, tp_rank)
    ids, labels = _batch(config)
    loss = model(ids, labels=labels)
    loss.backward()
    if groups is not None and layout.sequence_parallel:
        sync_sequence_parallel_grads([model], groups)
    grads = {model.global_name(n): p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads


# ------------------------------------------------------------------------------ rank body


def _body(rank: int, world_size: int) -> dict:
    out: dict = {}
    # tp2: each rank's shards
    config = _config("llama-tiny", num_kv_heads=2)
    tp = Layout(tp=2)
    groups = init_groups(tp)
    model = build_model(config, tp, groups, seed=SEED)
    out["tp2"] = (groups.tp_rank, {n: p.detach().clone() for n, p in model.named_parameters()})
    # pp2, V placement: rank 0 holds stages 0 and 3 (with the tied output copy)
    gpt2 = _config("gpt2-tiny")
    pp = Layout(pp=2, virtual_stages=2, placement="v")  # as schedule zbv runs it
    groups = init_groups(pp)
    stages = build_stages(gpt2, pp, groups, seed=SEED)
    out["pp2"] = [(m.stage_id, [(m.global_name(n), p.detach().clone())
                                for n, p in m.named_parameters()]) for m in stages]
    # tp2 + sequence parallel, recompute modes, dropout on
    nemotron = _config("nemotron-tiny", num_kv_heads=2, dropout=0.1)
    groups = init_groups(Layout(tp=2, sequence_parallel=True))
    out["recompute"] = {
        mode: _step(nemotron, Layout(tp=2, sequence_parallel=True),
                    TrainSchedule(recompute=mode), groups)
        for mode in MODES
    }
    return out


@pytest.fixture(scope="module")
def rank_results():
    return run_ranks(_body, 2, timeout=180)


# ---------------------------------------------------------------------------------- tests


def test_tp2_shards_are_slices_of_the_single_process_model(rank_results):
    config = _config("llama-tiny", num_kv_heads=2)
    full = dict(build_model(config, seed=SEED).named_parameters())
    for tp_rank, params in (r["tp2"] for r in rank_results):
        assert params.keys() == full.keys()
        for name, local in params.items():
            want = shard_tensor(name, full[name].detach(), config, tp_rank, 2)
            assert torch.equal(local, want), f"tp rank {tp_rank}: {name}"


def test_pp2_stages_are_slices_of_the_single_process_model(rank_results):
    config = _config("gpt2-tiny")
    full = dict(build_model(config, seed=SEED).named_parameters())
    seen = set()
    for stages in (r["pp2"] for r in rank_results):
        for stage_id, params in stages:
            for name, local in params:
                assert torch.equal(local, full[name]), f"stage {stage_id}: {name}"
                seen.add(name)
    assert seen == set(full)


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny", "nemotron-tiny"])
def test_recompute_matches_none_single_process(preset):
    config = _config(preset, dropout=0.1)
    ref_loss, ref = _step(config, Layout())
    for mode in ("full", "selective"):
        loss, grads = _step(config, Layout(), TrainSchedule(recompute=mode))
        assert loss == pytest.approx(ref_loss, rel=1e-6), mode
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[name], rtol=0, atol=1e-6, msg=f"{mode} {name}")


def test_recompute_partial_layers_matches_none():
    config = _config("llama-tiny", dropout=0.1)
    _, ref = _step(config, Layout())
    _, grads = _step(config, Layout(), TrainSchedule(recompute="full", recompute_layers=2))
    for name, g in grads.items():
        torch.testing.assert_close(g, ref[name], rtol=0, atol=1e-6, msg=name)


def test_recompute_matches_none_under_tp2_sequence_parallel(rank_results):
    config = _config("nemotron-tiny", num_kv_heads=2, dropout=0.1)
    per_rank = [r["recompute"] for r in rank_results]
    for mode in ("full", "selective"):
        for r in per_rank:
            assert r[mode][0] == pytest.approx(r["none"][0], rel=1e-6), mode
        for name in per_rank[0]["none"][1]:
            ref = unshard_tensors(name, [r["none"][1][name] for r in per_rank], config)
            got = unshard_tensors(name, [r[mode][1][name] for r in per_rank], config)
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-6, msg=f"{mode} {name}")
