"""`tessera plan --measure --gpu cpu`: the planned candidates really run, on local gloo ranks,
through the pretraining loop, and the measured ranking is printed beside the predicted one.

Step times are data here, never asserted on: this machine is shared and small. What is
asserted is that every candidate ran its steps, that the report is consistent with its own
numbers (ranks, Spearman), and that the measured best candidate is
among the predicted top 3. The candidates differ clearly (tensor parallelism adds gloo
collectives to every layer, which cost far more than the compute of a tiny model), so that
check is not at the mercy of timing noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.plan.measure import measure_all, spearman, synthetic_data
from tessera.plan.run_config import run_config

# Eager kernels: compiling the fused ones would cost each rank ~20 s of a few-step run.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_FUSED_KERNELS": "off"}
# A stand-in calibration with this machine's orders of magnitude (`--calibrate` measures them;
# tests/unit/plan/test_calibrate.py checks that).
CALIBRATION = {"gemm_tflops": 0.08, "allreduce_gbps": 1.0, "memory_gib": 16.0, "cores": 2,
               "link_latency_us": 200.0, "memory_gbps": 10.0, "layer_overhead_us": 4000.0,
               "microbatch_overhead_us": 2000.0}


def _plan(tmp_path: Path, nproc: int, *argv: str) -> subprocess.CompletedProcess:
    calibration = tmp_path / "cpu.json"
    calibration.write_text(json.dumps(CALIBRATION))
    cmd = [sys.executable, "-m", "tessera", "plan", "--measure", "--gpu", "cpu",
           "--nproc-per-node", str(nproc), "--calibration-file", str(calibration),
           "--model", "llama-tiny", "--seq-len", "32", "--micro-batch", "4", "--pp", "1",
           "--measure-steps", "3", "--measure-warmup", "1", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.timeout(600)
def test_measure_two_candidates_on_two_ranks(tmp_path):
    """The cheap default-run version: 2 ranks, the 2 best predicted (tp1 dp2 and tp2 sp)."""
    done = _plan(tmp_path, 2, "--global-batch", "8", "--recompute", "none", "--top", "2",
                 "--json")
    data = json.loads(done.stdout)
    cands = data["candidates"]
    assert [(c["tp"], c["dp"]) for c in cands] == [(1, 2), (2, 1)]
    for c in cands:
        m = c["measured"]
        assert m["ok"] and m["error"] is None, m
        assert len(m["step_times_s"]) == 2  # 3 steps, the first left out
        assert m["step_time_s"] == pytest.approx(sum(m["step_times_s"]) / 2)  # median of 2
        assert m["tokens_per_s"] == pytest.approx(8 * 32 / m["step_time_s"])
        assert 0 < m["peak_memory_gib"] < 16
        assert m["cpu_share"] > 0  # CPU seconds over wall seconds of the timed steps
    assert data["spearman"] == spearman([c["step_time_s"] for c in cands],
                                        [c["measured"]["step_time_s"] for c in cands])
    assert "measure 1/2: tp1 pp1 dp2, micro-batch 4, recompute none" in done.stderr
    print({(c["tp"], c["dp"]): (c["step_time_s"], c["measured"]["step_time_s"]) for c in cands})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_measure_on_four_ranks_prints_both_rankings(tmp_path):
    """Must-show 4: four ranks, the four best predicted candidates, the text report."""
    done = _plan(tmp_path, 4, "--global-batch", "16", "--top", "4", "--measure-steps", "4")
    out = done.stdout
    print(out)
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("measured: 4 CPU ranks")))
    head = lines[start + 2].split()
    assert head[:2] == ["predicted", "#"] and "measured" in head
    rows = [line.split() for line in lines[start + 4:start + 8]]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    measured_rank = [int(r[-4]) for r in rows]  # every candidate ran: a rank, not "failed"
    assert sorted(measured_rank) == [1, 2, 3, 4]
    times = [float(r[-3]) for r in rows]
    assert [sorted(times).index(t) + 1 for t in times] == measured_rank
    best = measured_rank.index(1) + 1
    assert f"measured best: predicted #{best} " in out
    assert best <= 3, out  # the measured best is among the predicted top 3
    rho = spearman([1, 2, 3, 4], times)  # rows are in predicted order (distinct predictions)
    assert f"Spearman rank correlation, predicted vs measured step time: {rho:+.2f} over 4 " \
           "candidates" in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_failing_candidate_is_reported_and_the_next_still_runs(tmp_path):
    base = {"tp": 1, "pp": 1, "virtual_stages": 1, "dp": 2, "sequence_parallel": False,
            "schedule": "1f1b", "recompute": "none", "recompute_layers": None,
            "data_parallel": "ddp"}
    configs = [run_config({**base, "micro_batches": mb, **extra}, model="llama-tiny",
                          model_fields={}, global_batch=8, seq_len=32, precision="fp32")
               for mb, extra in ((1, {}), (3, {}), (2, {"tp": 2, "dp": 1}))]
    data = synthetic_data(tmp_path, 512, 20_000)
    old = os.environ.get("TESSERA_FUSED_KERNELS")
    os.environ["TESSERA_FUSED_KERNELS"] = "off"
    try:
        got = measure_all(configs, tmp_path / "work", data, nproc=2, steps=2, warmup=1)
    finally:
        os.environ.pop("TESSERA_FUSED_KERNELS")
        if old is not None:
            os.environ["TESSERA_FUSED_KERNELS"] = old
    assert [m.ok for m in got] == [True, False, True]
    assert "does not split into 3 micro-batches" in got[1].error
    assert got[0].step_time_s > 0 and got[2].step_time_s > 0
