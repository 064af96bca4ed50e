"""`bench/gpu_check.py` runs its stages on a CPU (`--device cpu --tiny`), so the script a GPU
session depends on cannot rot between the rare sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "gpu_check.py"


def _run(tmp_path: Path, *args: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess,
                                                                    dict]:
    # Fused kernels off: their first compile costs a CPU tens of seconds and is not under test.
    env = {**os.environ, "TESSERA_FUSED_KERNELS": "off"}
    out = subprocess.run([sys.executable, str(CHECK), "--device", "cpu", "--tiny", "--out",
                          str(tmp_path), *args], capture_output=True, text=True,
                         timeout=timeout, env=env)
    report = json.loads((tmp_path / "gpu_check-cpu.json").read_text())
    return out, report


# Every stage in turn: a minute and a half on 2 cores, so `make test-slow` runs it; the stage
# machinery itself is checked in the default run by the out-of-time case below.
@pytest.mark.slow
@pytest.mark.timeout(600)  # as the run's own limit: minutes of stages on a busy 2-core CPU
def test_cpu_tiny_check_measures_every_stage_and_reports(tmp_path):
    out, report = _run(tmp_path, "--stages", "env", "tests", "calibrate", "train", "loss",
                       "decode", "serve", "fp8", "fp8-train")
    stages = {s["name"]: s for s in report["stages"]}
    assert out.returncode == 0, out.stdout[-3000:]
    assert list(stages) == ["env", "tests", "calibrate", "train", "loss", "decode", "serve",
                            "fp8", "fp8-train"]
    assert all(s["status"] == "ok" for s in stages.values()), {
        k: (s["status"], s["log_tail"]) for k, s in stages.items()}
    # Rows are streamed as measured ("ROW name {json}") and collected per stage.
    assert "ROW train " in out.stdout
    assert stages["env"]["rows"][0]["torch"]
    sides = {r["side"] for r in stages["train"]["rows"]}
    assert sides == {"tessera", "hf"}
    assert all(r["tok/s"] > 0 for r in stages["train"]["rows"])
    assert all(stages[name]["rows"] for name in ("calibrate", "loss", "decode", "serve", "fp8",
                                                 "fp8-train"))
    # The static-shape decode step ran (Dynamo only, on the tiny CPU run) beside the eager one.
    assert "single stream, compiled decode" in {r["case"] for r in stages["decode"]["rows"]}
    assert [r["completed"] for r in stages["serve"]["rows"]] == [4.0]
    markdown = (tmp_path / "gpu_check-cpu.md").read_text()
    assert "## Stages" in markdown and "## train" in markdown


def test_a_stage_out_of_time_keeps_its_rows_and_the_next_stage_runs(tmp_path):
    # A 3 s budget kills the train stage mid-way; env (before) and the report survive.
    out, report = _run(tmp_path, "--stages", "env", "train", "--stage-budget", "train=3",
                       timeout=120)
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["train"]["status"].startswith("out of time"), stages["train"]
    assert stages["env"]["status"] == "ok"
    assert out.returncode == 1


@pytest.mark.slow
def test_cpu_tiny_smoke_pretrains_and_serves(tmp_path):
    out, report = _run(tmp_path, "--stages", "smoke", timeout=900)
    smoke = report["stages"][0]
    assert smoke["status"] == "ok", smoke["log_tail"]
    assert [r["ok"] for r in smoke["rows"]] == [True, True]
