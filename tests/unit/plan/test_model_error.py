"""`search.MODEL_ERROR`, the band within which `tessera plan` calls candidates too close to
rank, is the model's largest error on the published runs it is checked against: PTD-P Table 1's
ten rows as launched and PTD-P Fig. 12's two schedules (the same runs and settings as
test_search.py). Recomputed here, so the constant follows the model when it is refined."""

from __future__ import annotations

import pytest

from tessera.plan import TrainingJob, evaluate
from tessera.plan.search import MODEL_ERROR
from tests.unit.plan.test_search import (
    A100,
    FIG12,
    PAPER_FIXED,
    ROWS,
    SC21_RUNS,
    gpt_2021,
    ptdp_job,
)

_PAPER = {f: getattr(PAPER_FIXED, f) for f in ("recompute", "sequence_parallel",
                                               "sharded_optimizer", "cp")}


def _table1_errors() -> dict[str, float]:
    out = {}
    for billions, (_, _, _, L, tp, pp, _, _, measured) in ROWS.items():
        mb, per_virtual = SC21_RUNS[billions]
        v = 1 if per_virtual is None else L // pp // per_virtual
        c = evaluate(ptdp_job(billions), dict(tp=tp, pp=pp, virtual_stages=v, micro_batch=mb,
                                              **_PAPER))
        out[f"Table 1 {billions}B"] = c.tflops_per_gpu / measured - 1
    return out


def _figure12_errors() -> dict[str, float]:
    out = {}
    for batch, measured in FIG12.items():
        job = TrainingJob(gpt_2021(12288, 96, 96), 96, A100, batch, 2048, flash_attention=False,
                          overlap_grad_reduce=True, overlap_grad_reduce_in_pipeline=False,
                          grad_reduce_bytes=2)
        for v, paper in zip((1, 4), measured):
            c = evaluate(job, dict(tp=8, pp=12, virtual_stages=v, micro_batch=1, **_PAPER))
            out[f"Fig. 12 batch {batch} v{v}"] = c.tflops_per_gpu / paper - 1
    return out


def test_model_error_is_the_largest_error_on_published_runs():
    errors = {**_table1_errors(), **_figure12_errors()}
    worst = max(errors, key=lambda k: abs(errors[k]))
    # The band covers every checked run, and is no wider than the worst of them (rounded up
    # to 0.1%): the 1T row of Table 1, under-predicted by 6.45%.
    assert abs(errors[worst]) <= MODEL_ERROR < abs(errors[worst]) + 0.001, (worst, errors)
    assert worst == "Table 1 1008.0B" and errors[worst] == pytest.approx(-0.0645, abs=0.0005)
    assert max(errors.values()) == pytest.approx(0.054, abs=0.001)  # interleaved, batch 12
