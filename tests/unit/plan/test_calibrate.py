"""`tessera plan --calibrate`: the ISA read from /proc/cpuinfo, and a (quick) calibration that
writes a file the planner's `cpu` profile loads, with this machine's numbers in it."""

from __future__ import annotations

import json

import pytest

from tessera.plan import calibrate as calibration
from tessera.plan import load_hardware
from tessera.plan.calibrate import calibrate, cpu_isa, default_path, memory_gib

FLAGS = "processor\t: 0\nflags\t\t: fpu sse sse2 avx {extra} fma\nbogomips\t: 1\n"


def test_isa_is_the_widest_matrix_or_vector_extension():
    assert cpu_isa(FLAGS.format(extra="avx2")) == "AVX2"
    assert cpu_isa(FLAGS.format(extra="avx2 avx512f avx512bw")) == "AVX512"
    assert cpu_isa(FLAGS.format(extra="avx2 avx512f amx_tile amx_bf16")) == "AMX"
    assert cpu_isa(FLAGS.format(extra="")) == "AVX"


def test_default_path_follows_tessera_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    assert default_path() == tmp_path / "plan-cpu.json"
    monkeypatch.delenv("TESSERA_CACHE")
    assert default_path().parts[-3:] == (".cache", "tessera", "plan-cpu.json")


def _fake_allreduce(world, sizes, seconds):
    return [(n, 1e-4 + n / 1e9) for n in sizes]  # 100 us latency, 1 GB/s


def test_quick_calibration_writes_a_profile_the_planner_loads(tmp_path, monkeypatch):
    """GEMMs and copy measured for real (tiny shapes); the all-reduce timings stubbed (spawning
    ranks costs ~10 s here; the slow test below runs them)."""
    monkeypatch.setattr(calibration, "measure_allreduce", _fake_allreduce)
    result = _check_calibration(tmp_path / "sub" / "cpu.json")
    assert result["link_latency_us"] == pytest.approx((1e-4 + 4096 / 1e9) / 2 * 1e6)
    assert result["allreduce_gbps"] == pytest.approx(262144 / (1e-4 + 262144 / 1e9) / 1e9)


@pytest.mark.slow
def test_quick_calibration_with_real_gloo_ranks(tmp_path):
    _check_calibration(tmp_path / "cpu.json")


def _check_calibration(path):
    lines: list[str] = []
    result = calibrate(path, quick=True, progress=lines.append)
    assert json.loads(path.read_text()) == result
    assert result["isa"] == cpu_isa() and result["threads_per_rank"] == 1
    assert result["memory_gib"] == memory_gib()
    # Every GEMM measured is a real rate: positive, below a 10 TFLOP/s single thread.
    rates = [r["tflops"] for rows in result["gemm"].values() for r in rows]
    assert rates and all(0 < r < 10 for r in rates)
    # fp32: a linear layer's forward and both gradient GEMMs per shape, all FLOPs over all time.
    assert [(r["tokens"], r["h"], r["n"]) for r in result["gemm"]["fp32"]] == list(
        calibration.QUICK_LAYER_GEMM_SHAPES)
    assert result["gemm_tflops"] == calibration.layer_gemm_rate(result["gemm"]["fp32"])
    # The loss per logit: real (a few ns on any CPU; under a microsecond), and in the profile.
    assert 0 < result["loss_ns_per_logit"] < 1e3
    assert load_hardware("cpu", path).loss_ns_per_logit == result["loss_ns_per_logit"]
    # A tiny model's layer costs its ops' dispatch: milliseconds here, measured, never zero
    # (three more layers' forward and backward); the micro-batch's own cost is >= 0.
    assert 0 < result["layer_overhead_us"] < 1e6
    assert 0 <= result["microbatch_overhead_us"] < 1e6
    hw = load_hardware("cpu", path)
    assert hw.layer_overhead_us == result["layer_overhead_us"]
    assert hw.microbatch_overhead_us == result["microbatch_overhead_us"]
    assert [r["bytes"] for r in result["allreduce"]] == [4096, 262144]
    assert all(r["seconds"] > 0 for r in result["allreduce"])
    hw = load_hardware("cpu", path)
    assert hw.peak("fp32") == result["gemm_tflops"]
    assert hw.intra_node_gbps == result["allreduce_gbps"]
    assert hw.link_latency_us == result["link_latency_us"] > 0
    assert hw.memory_gbps == result["memory_gbps"] > 0
    # The attention kernel's rate, relative to the GEMMs', is the profile's efficiency.
    assert 0 < result["attention_tflops"] < 10
    assert hw.attention_efficiency == pytest.approx(
        min(1.0, result["attention_tflops"] / result["gemm_tflops"]))
    # Progress names the ISA and what was measured, one line each.
    assert result["isa"] in lines[0] and any("all-reduce 256 KiB" in line for line in lines)
    assert str(path) in lines[-1]
    return result


def test_one_thread_rates_are_timed_on_the_cpu_clock(monkeypatch):
    # The rank's core, not the wall: time that passes while this process does not run (here a
    # sleep, on a shared machine the other processes' turns) does not count.
    import time

    start = calibration.cpu_clock()
    time.sleep(0.05)
    assert calibration.cpu_clock() - start < 0.02
    # gemm_tflops reads that clock: 2 m k n FLOPs over the best CPU interval.
    ticks = iter([0.0, 1.0, 1.5, 2.0])  # the deadline at 1.0, one run of 0.5 s, past it
    monkeypatch.setattr(calibration, "cpu_clock", lambda: next(ticks))
    assert calibration.gemm_tflops(8, 8, 8, "fp32", 1.0) == pytest.approx(2 * 8**3 / 0.5 / 1e12)


def test_layer_gemm_rate_weighs_each_shape_by_its_work():
    # 6 x 2 x 3 x 4 = 144 FLOPs at 1 TFLOP/s (144 ps) and 6 x 1 x 1 x 4 = 24 at 0.5 (48 ps):
    # 168 FLOPs in 192 ps, 0.875 TFLOP/s (the rates' plain mean would say 0.75).
    rows = [{"tokens": 2, "h": 3, "n": 4, "tflops": 1.0},
            {"tokens": 1, "h": 1, "n": 4, "tflops": 0.5}]
    assert calibration.layer_gemm_rate(rows) == pytest.approx(168 / 192)


def test_rates_are_the_median_run_not_the_best(monkeypatch):
    # Runs of 0.5, 0.1 and 0.3 s of CPU (the deadline passed after the third): the median
    # 0.3 s is the rate, not the best 0.1 s (a step runs each op once, at its typical rate).
    ticks = iter([0.0, 0.0, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6, 0.9, 1.0])
    monkeypatch.setattr(calibration, "cpu_clock", lambda: next(ticks))
    assert calibration.gemm_tflops(8, 8, 8, "fp32", 1.0) == pytest.approx(2 * 8**3 / 0.3 / 1e12)


def test_the_loss_costs_the_slower_of_its_bytes_and_its_measured_time(tmp_path):
    """A cpu profile with `loss_ns_per_logit` charges the last rank T x V x that per micro-batch
    where it exceeds the loss's memory passes; GPU profiles (0) keep the passes exactly."""
    import dataclasses

    from tessera.core.config import ModelConfig
    from tessera.plan import PROFILES, TrainingJob, evaluate

    model = ModelConfig.from_name("llama-tiny")
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"gemm_tflops": 0.08, "allreduce_gbps": 1.0, "memory_gib": 8.0,
                                "memory_gbps": 10.0}))
    hw = load_hardware("cpu", path)
    assert PROFILES["h100-80gb"].loss_ns_per_logit == 0.0 and hw.loss_ns_per_logit == 0.0

    def step(hardware):
        job = TrainingJob(model=model, gpus=1, hardware=hardware, global_batch=4, seq_len=64,
                          gpus_per_node=1, precision="fp32")
        return evaluate(job, {"tp": 1, "pp": 1, "micro_batch": 2, "recompute": "none"})

    T, V = 2 * 64, model.vocab_size
    passes = 3 * 4 * T * V / 10e9  # estimate.LOGITS_PASSES fp32 passes at 10 GB/s: 1.2 ns a logit
    base = step(hw)
    slow = step(dataclasses.replace(hw, loss_ns_per_logit=9.0))
    fast = step(dataclasses.replace(hw, loss_ns_per_logit=0.5))  # below the passes: no change
    assert fast.step_time_s == base.step_time_s
    assert slow.step_time_s - base.step_time_s == pytest.approx(2 * (T * V * 9e-9 - passes))
    # Four ranks on two cores share the loss's core like the other one-thread costs.
    import argparse

    from tessera.plan.commands import _hardware

    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "cores": 2, "loss_ns_per_logit": 9.0}))
    args = argparse.Namespace(gpu="cpu", calibration_file=str(path))
    assert _hardware(args, 2).loss_ns_per_logit == 9.0
    assert _hardware(args, 4).loss_ns_per_logit == pytest.approx(18.0)
