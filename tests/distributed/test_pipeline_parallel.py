"""Pipeline parallelism on 2 and 4 gloo ranks with `torch.distributed.pipelining` schedules:
1F1B, interleaved 1F1B (2 virtual stages), the zero-bubble schedules (interleaved ZB, ZBV) and
DualPipeV, against the single-process model (loss and every gathered gradient). Tied GPT-2
embeddings exercise the gradient sync over the embedding group (looped placement) and the local
sum (V placement, first and last stage on pp rank 0); Llama and Nemotron are untied. A short
SGD run reuses one schedule for several steps and checks that the tied copies stay equal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tessera.core.config import ConfigError, ModelConfig
from tessera.core.init import build_model
from tessera.core.parallel.groups import ParallelGroups, init_groups
from tessera.core.parallel.pipeline import (
    broadcast_loss,
    build_schedule,
    build_stages,
    pipeline_loss_fn,
    pipeline_step,
    schedule_problems,
    split_layout_and_schedule,
    sync_tied_embedding_grads,
)
from tessera.core.parallel.sharding import last_stage_pp_rank
from tests.distributed._parity import Case, check_case, make_batch, spawn_cases
from tests.distributed_helper import run_ranks

MB4 = {"micro_batches": 4}
V2 = {"virtual_stages": 2, **MB4}
EIGHT = {"num_layers": 8}

PP2 = [
    Case("gpt2-tied-1f1b", "gpt2-tiny", {"pp": 2, **MB4}),
    Case("llama-1f1b", "llama-tiny", {"pp": 2, **MB4}, model={"num_kv_heads": 2}),
    Case("llama-interleaved", "llama-tiny", {"pp": 2, "schedule": "interleaved-1f1b", **V2}),
    Case("gpt2-tied-zero-bubble", "gpt2-tiny", {"pp": 2, "schedule": "zero-bubble", **V2}),
    Case("gpt2-tied-zbv", "gpt2-tiny", {"pp": 2, "schedule": "zbv", **V2}),
    Case("nemotron-dualpipev", "nemotron-tiny", {"pp": 2, "schedule": "dualpipev", **V2}),
    Case("llama-gpipe", "llama-tiny", {"pp": 2, "schedule": "gpipe", **MB4}),
    Case("nemotron-looped-bfs", "nemotron-tiny", {"pp": 2, "schedule": "looped-bfs", **V2}),
]
PP4 = [
    Case("llama-1f1b", "llama-tiny", {"pp": 4, **MB4}),
    Case("gpt2-tied-interleaved", "gpt2-tiny", {"pp": 4, "schedule": "interleaved-1f1b", **V2},
         model=EIGHT),
    Case("llama-zero-bubble", "llama-tiny", {"pp": 4, "schedule": "zero-bubble", **V2},
         model=EIGHT),
    Case("nemotron-zbv", "nemotron-tiny", {"pp": 4, "schedule": "zbv", **V2}, model=EIGHT),
]


@pytest.fixture(scope="module")
def pp2_results():
    return spawn_cases(PP2, 2)


@pytest.fixture(scope="module")
def pp4_results():
    return spawn_cases(PP4, 4)


@pytest.mark.parametrize("case", PP2, ids=lambda c: c.name)
def test_pp2_matches_single_process(case, pp2_results):
    check_case(case, pp2_results[case.name])


@pytest.mark.parametrize("case", PP4, ids=lambda c: c.name)
def test_pp4_matches_single_process(case, pp4_results):
    check_case(case, pp4_results[case.name])


# ------------------------------------------------------------------ layout and validation


def _tiny(**overrides) -> ModelConfig:
    return ModelConfig.from_name("gpt2-tiny", num_layers=8, hidden_size=32,
                                 vocab_size=96, **overrides)


@pytest.mark.parametrize(
    ("schedule", "virtual", "want"),
    [("1f1b", 1, [[0], [1]]), ("interleaved-1f1b", 2, [[0, 2], [1, 3]]),
     ("zbv", 2, [[0, 3], [1, 2]]), ("dualpipev", 2, [[0, 3], [1, 2]])],
)
def test_build_stages_places_chunks(schedule, virtual, want):
    par, _ = split_layout_and_schedule(dict(pp=2, virtual_stages=virtual, schedule=schedule,
                                            micro_batches=4))
    for pp_rank, ids in enumerate(want):
        stages = build_stages(_tiny(), par, ParallelGroups(pp_rank=pp_rank, pp_size=2))
        assert [m.stage_id for m in stages] == ids
        assert all(m.num_stages == 2 * virtual for m in stages)
    last = 2 * virtual - 1
    assert want[last_stage_pp_rank(par)][-1] == last


@pytest.mark.parametrize(
    ("parallel", "message"),
    [({"pp": 2, "schedule": "dualpipev", "virtual_stages": 2, "micro_batches": 2},
      "dualpipev' needs micro_batches >= stages"),
     ({"pp": 4, "schedule": "1f1b", "micro_batches": 2}, "micro_batches >= stages"),
     ({"pp": 2, "schedule": "zero-bubble", "virtual_stages": 2, "micro_batches": 5},
      "multiple of"),
     ({"pp": 1, "micro_batches": 2}, "pp >= 2")],
)
def test_schedule_problems_are_named(parallel, message):
    lay, sched = split_layout_and_schedule(parallel)
    assert any(message in p for p in schedule_problems(lay, sched))
    with pytest.raises(ConfigError, match="cannot build the pipeline schedule"):
        build_schedule([], lay, sched, ParallelGroups(pp_size=lay.pp), loss_fn=None)


def test_batch_must_split_into_equal_micro_batches():
    schedule = SimpleNamespace(_n_microbatches=3)
    stage = SimpleNamespace(is_first=True, is_last=False)
    ids = torch.zeros(8, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="does not split into 3 equal micro-batches"):
        pipeline_step(schedule, [stage], ParallelGroups(pp_size=2), ids, None)
    with pytest.raises(ValueError, match="needs labels"):
        last = SimpleNamespace(is_first=False, is_last=True)
        pipeline_step(schedule, [last], ParallelGroups(pp_rank=1, pp_size=2), None, None)


# ------------------------------------------------------------- several steps on one schedule

TRAIN = [Case("gpt2-tied-1f1b", "gpt2-tiny", {"pp": 2, **MB4}),
         Case("gpt2-tied-zbv", "gpt2-tiny", {"pp": 2, "schedule": "zbv", **V2})]
STEPS, LR = 3, 0.5


def _train(rank: int, world_size: int, cases: list[Case]) -> list[tuple]:
    """SGD steps through one schedule; the broadcast losses and the final tied copies."""
    out = []
    for case in cases:
        config, (par, sched) = case.model_config(), case.parallel_config()
        groups = init_groups(par)
        ids, labels = make_batch(case, config.vocab_size)
        stages = build_stages(config, par, groups, schedule=sched, seed=case.seed)
        schedule = build_schedule(stages, par, sched, groups, pipeline_loss_fn(config, groups))
        opt = torch.optim.SGD([p for m in stages for p in m.parameters()], lr=LR)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = pipeline_step(schedule, stages, groups, ids, labels)
            losses.append(broadcast_loss(loss, par, groups).item())
            sync_tied_embedding_grads(stages, groups)
            opt.step()
        copies = [p.detach().clone() for m in stages for n, p in m.named_parameters()
                  if m.global_name(n) == "tok_embeddings.weight"]
        out.append((losses, copies))
    return out


def _reference_losses(case: Case) -> list[float]:
    config, (_, par) = case.model_config(), case.parallel_config()
    model = build_model(config, seed=case.seed)
    ids, labels = make_batch(case, config.vocab_size)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        step = []
        for i, lab in zip(ids.chunk(par.micro_batches), labels.chunk(par.micro_batches)):
            loss = model(i, labels=lab)
            (loss / par.micro_batches).backward()
            step.append(loss.item())
        opt.step()
        losses.append(sum(step) / len(step))
    return losses


def test_training_steps_reuse_the_schedule_and_keep_tied_copies_equal():
    per_rank = run_ranks(_train, 2, TRAIN, timeout=120)
    for i, case in enumerate(TRAIN):
        want = _reference_losses(case)
        copies = [t for r in per_rank for t in r[i][1]]
        assert len(copies) == 2, case.name
        assert torch.equal(copies[0], copies[1]), f"{case.name}: tied copies drifted apart"
        for r in per_rank:
            assert r[i][0] == pytest.approx(want, rel=1e-5), case.name
