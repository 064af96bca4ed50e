"""`bench/bench_fp8.py --device cpu --tiny`: every mode measured on every layer shape, the fused
mode the FP8 layer's own bits, and a spent budget measures nothing."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[3] / "bench"


@pytest.fixture
def bench(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    common = importlib.import_module("_common")
    monkeypatch.setattr(common, "RESULTS", tmp_path)  # leave bench/results alone
    yield importlib.import_module("bench_fp8")
    sys.modules.pop("bench_fp8", None)


def test_tiny_cpu_run_measures_every_mode_on_every_layer(bench, tmp_path, capsys):
    bench.main(["--device", "cpu", "--tiny"])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ROW fp8")]
    rows = (tmp_path / "fp8.jsonl").read_text().splitlines()
    assert len(printed) == len(rows) == 4  # qkv, o, gate/up, down of llama-demo
    rows = [json.loads(r) for r in rows]
    assert [r["layer"] for r in rows] == ["qkv", "o", "gate/up", "down"]
    assert rows[2]["N"] == 2 * 512  # gate/up as the model runs it: N = 2 x ffn
    for r in rows:
        assert all(r[f"{mode} TFLOP/s"] > 0 for mode in ("bf16", "gemm", "quant+gemm", "fused"))
        assert r["same as Fp8 layer"] is True
        assert 0.01 < r["fp8 relative error"] < 0.06  # e4m3: 3 mantissa bits
        assert r["bf16 relative error"] < r["fp8 relative error"]


def test_a_spent_budget_measures_nothing(bench, tmp_path, capsys):
    bench.main(["--device", "cpu", "--tiny", "--budget-s", "0"])
    assert (tmp_path / "fp8.jsonl").read_text() == ""
    assert "budget of 0 s spent" in capsys.readouterr().out


def test_bad_arguments_are_named(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--models", "llama-9z"])
    assert "unknown model preset(s) llama-9z" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_train_mode_times_both_steps_from_the_same_start(bench, tmp_path, monkeypatch, recipe):
    from tessera.core import fused

    fused.set_mode("off")  # eager kernels: no compile time in this test
    try:
        bench.main(["--device", "cpu", "--train", "--tiny", "--steps", "3", "--seq", "32",
                    "--fp8-recipe", recipe])
    finally:
        fused.set_mode(None)
    (row,) = [json.loads(r) for r in (tmp_path / "fp8_train.jsonl").read_text().splitlines()]
    assert row["fp8"] == f"emulated {recipe}" and row["batch x seq"] == "2x32"
    assert row["bf16 step ms"] > 0 and row["fp8 step ms"] > 0
    # the same start: one step of FP8 noise apart (see tests/unit/training/test_fp8_pretrain.py
    # for the bound over a longer run)
    assert 0 < row["max loss relative diff"] < 1e-2
    assert row["loss last fp8"] < row["loss first"]
