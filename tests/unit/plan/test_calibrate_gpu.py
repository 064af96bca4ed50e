"""`tessera plan --calibrate --device cuda` (`plan.calibrate_gpu`): the profile it writes is
one `--gpu PATH.json` plans with, its efficiencies reproduce the measured times in the
planner's own formulas, a slower measurement predicts a slower step, an exhausted budget keeps
the datasheet, and bad profile files are refused naming the field. Runs on the CPU: the
measurements are faked where a test needs exact figures, and run for real at QUICK sizes."""

from __future__ import annotations

import json

import pytest

from tessera.__main__ import main
from tessera.plan import PROFILES, PlanError, load_hardware
from tessera.plan import calibrate_gpu as cg

H100_NAME = "NVIDIA H100 80GB HBM3"
JOB = ["--model", "llama-1b", "--gpus", "1", "--global-batch", "4", "--seq-len", "2048",
       "--micro-batch", "4", "--recompute", "none", "--json"]


def _fake_device(monkeypatch, gemm_tflops: float, name: str = H100_NAME) -> None:
    """A device that runs every GEMM at `gemm_tflops`, fused attention at 300 TFLOP/s in the
    planner's count (math at 50, cudnn unavailable) and copies at 3,000 GB/s."""
    monkeypatch.setattr(cg, "device_description", lambda device: (name, 79.2))
    monkeypatch.setattr(cg, "gemm_seconds",
                        lambda clock, m, n, k, s, runs: 6 * m * n * k / (gemm_tflops * 1e12))

    def attention(clock, backend, shape, seconds, runs):
        if backend == "cudnn":
            return "No available kernel"
        return cg.attention_flops(shape) / ((50 if backend == "math" else 300) * 1e12)

    monkeypatch.setattr(cg, "attention_seconds", attention)
    monkeypatch.setattr(cg, "copy_seconds", lambda clock, nbytes, s, runs: 2 * nbytes / 3e12)


def _plan_json(capsys, profile) -> dict:
    code = main(["plan", *JOB, "--gpu", str(profile)])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)["candidates"][0]


def test_profile_reproduces_the_measured_rates_and_plans(monkeypatch, tmp_path, capsys):
    _fake_device(monkeypatch, gemm_tflops=600.0)
    lines: list[str] = []
    path = tmp_path / "h100.json"
    result = cg.calibrate_device(path, "cpu", sizes=cg.FULL, say=lines.append)
    assert json.loads(path.read_text()) == result
    hw = load_hardware(str(path))
    h100 = PROFILES["h100-80gb"]
    # The datasheet's peaks and links stay; the measured figures replace the fitted ones.
    assert hw.name == "h100-80gb-measured" and hw.peak_tflops == h100.peak_tflops
    assert (hw.intra_node_gbps, hw.inter_node_gbps) == (h100.intra_node_gbps,
                                                        h100.inter_node_gbps)
    assert hw.memory_gbps == 3000 and hw.memory_gib == 79.2
    assert hw.attention_efficiency == pytest.approx(300 / 989.5, rel=1e-3)
    # gemm_efficiency: the planner's shape rule at it gives back the measured 600 TFLOP/s.
    rows = result["measured"]["gemm"]
    planned = sum(6 * r["m"] * r["n"] * r["k"] / (989.5e12 * hw.gemm_fraction(r["m"], r["n"],
                                                                               r["k"]))
                  for r in rows)
    assert planned == pytest.approx(sum(r["seconds"] for r in rows), rel=1e-3)
    assert result["measured"]["gemm_tflops"] == pytest.approx(600)
    # Every layer of both models measured, each reported as it was measured.
    assert [(r["model"], r["layer"]) for r in rows] == [
        (m, layer) for m in ("llama-1b", "llama2-7b")
        for layer in ("qkv", "o", "gate+up", "down", "lm head")]
    assert rows[0]["m"] == 8192 and rows[0]["n"] == (16 + 2 * 8) * 128 and rows[0]["k"] == 2048
    assert any("llama-1b lm head: 8192 x 2048 -> 32000" in line and "600 TFLOP/s" in line
               for line in lines)
    assert any("cudnn: unavailable (No available kernel)" in line for line in lines)
    assert result["measured"]["attention_backends"] == {"4x16x2048x128": "flash",
                                                        "4x32x2048x64": "flash"}
    assert result["measured"]["device"] == H100_NAME and result["measured"]["date"]
    assert str(path) in lines[-1]
    plan = _plan_json(capsys, path)
    assert plan["mfu"] > 0 and plan["step_time_s"] > 0


def test_half_the_gemm_rate_predicts_a_slower_step(monkeypatch, tmp_path, capsys):
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    _fake_device(monkeypatch, gemm_tflops=600.0)
    cg.calibrate_device(fast, "cpu", say=lambda line: None)
    _fake_device(monkeypatch, gemm_tflops=300.0)
    cg.calibrate_device(slow, "cpu", say=lambda line: None)
    assert load_hardware(str(slow)).gemm_efficiency == pytest.approx(
        load_hardware(str(fast)).gemm_efficiency / 2, rel=1e-3)
    fast_step = _plan_json(capsys, fast)["step_time_s"]
    slow_step = _plan_json(capsys, slow)["step_time_s"]
    # Most of llama-1b's step is its GEMMs: slower, though by less than 2x (attention,
    # memory-bound ops and the optimizer are unchanged).
    assert fast_step < slow_step < 2 * fast_step


def test_an_unknown_card_takes_its_fastest_gemm_as_its_peak(monkeypatch, tmp_path):
    _fake_device(monkeypatch, gemm_tflops=400.0, name="Some Accelerator 9000")
    result = cg.calibrate_device(tmp_path / "x.json", "cpu", say=lambda line: None)
    hw = load_hardware(str(tmp_path / "x.json"))
    assert hw.name == "some-accelerator-9000" and hw.peak("bf16") == pytest.approx(400)
    assert hw.gemm_efficiency == pytest.approx(1.0) and hw.gemm_half_size == 0
    assert result["measured"]["datasheet"] is None
    assert "peak_tflops" not in result["measured"]["kept_from_datasheet"]


def test_a_spent_budget_keeps_the_datasheet_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(cg, "device_description", lambda device: (H100_NAME, 79.2))
    lines: list[str] = []
    result = cg.calibrate_device(tmp_path / "h.json", "cpu", budget_s=0, sizes=cg.QUICK,
                                 say=lines.append)
    hw, h100 = load_hardware(str(tmp_path / "h.json")), PROFILES["h100-80gb"]
    assert (hw.gemm_efficiency, hw.attention_efficiency, hw.memory_gbps) == (
        h100.gemm_efficiency, h100.attention_efficiency, h100.memory_gbps)
    assert {"gemm_efficiency", "attention_efficiency", "memory_gbps"} <= set(
        result["measured"]["kept_from_datasheet"])
    assert sum("skipped (budget spent)" in line for line in lines) == len(lines) - 2
    monkeypatch.setattr(cg, "device_description", lambda device: ("Some CPU", 8.0))
    with pytest.raises(PlanError, match="no GEMM finished within the budget on Some CPU"):
        cg.calibrate_device(tmp_path / "c.json", "cpu", budget_s=0, sizes=cg.QUICK,
                            say=lambda line: None)


def test_quick_run_on_this_cpu_through_the_script_entry(tmp_path, capsys, monkeypatch):
    # The real measurements, tiny: every figure positive, and the file plans.
    path = tmp_path / "cpu-device.json"
    assert cg.main(["--device", "cpu", "--quick", "--out", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    sizes = cg.QUICK
    assert len(out) == 2 + 5 * len(sizes.models) + 4 * len(sizes.attention) + 1
    data = json.loads(path.read_text())
    measured = data["measured"]
    assert all(r["tflops"] > 0 for r in measured["gemm"])
    assert measured["memory_copy_gbps"] > 0 and measured["device_kind"] == "cpu"
    assert measured["torch"] and measured["attention_backends"]
    hw = load_hardware(str(path))
    assert hw.memory_gbps == pytest.approx(measured["memory_copy_gbps"], rel=1e-3)
    code = main(["plan", "--model", "llama-tiny", "--gpus", "1", "--global-batch", "2",
                 "--seq-len", "64", "--gpu", str(path)])
    assert code == 0 and "llama-tiny on 1 x " in capsys.readouterr().out


def test_bad_profile_files_name_the_field(tmp_path):
    path = tmp_path / "p.json"
    good = PROFILES["h100-80gb"].to_dict()

    def refused(data: dict, match: str) -> None:
        path.write_text(json.dumps(data))
        with pytest.raises(PlanError, match=match):
            load_hardware(str(path))

    refused({k: v for k, v in good.items() if k != "memory_gbps"},
            r"p.json lacks memory_gbps: every field without a default is required")
    refused({**good, "memory_gbps": "fast"}, "memory_gbps must be a positive number, got 'fast'")
    refused({**good, "gemm_efficiency": 0}, "gemm_efficiency must be a positive number, got 0")
    refused({**good, "link_latency_us": -1}, "link_latency_us must be a non-negative number")
    refused({**good, "peak_tflops": 989.5}, "peak_tflops must map precisions to positive")
    refused({**good, "peak_tflops": {"bf16": None}}, "peak_tflops must map precisions")
    refused({**good, "name": 7}, "name must be a non-empty string")
    # A `measured` block is a record for people: read past, not refused.
    path.write_text(json.dumps({**good, "name": "mine", "measured": {"device": "x"}}))
    assert load_hardware(str(path)).name == "mine"


def test_device_flag_belongs_to_calibrate(capsys):
    code = main(["plan", "--device", "cuda", *JOB])
    assert code == 2
    assert "--device cuda chooses what --calibrate measures" in capsys.readouterr().err


def test_calibrate_cuda_without_a_gpu_says_so(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["plan", "--calibrate", "--device", "cuda", "--calibration-file",
                 str(tmp_path / "g.json")])
    assert code == 2
    assert "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()
