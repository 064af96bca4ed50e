"""bench/bench_generate.py runs end to end on tiny sizes, prints each row as it is measured,
and stops starting rows once its budget is spent."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).parents[2] / "bench"
TINY = ["--hidden", "64", "--layers", "1", "--vocab", "256", "--prompt", "8", "--new", "3",
        "--concurrency", "2", "--no-compile", "--no-hf-compile", "--no-int8"]


@pytest.fixture
def bench(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import _common

    monkeypatch.setattr(_common, "RESULTS", tmp_path)
    spec = importlib.util.spec_from_file_location("bench_generate", BENCH / "bench_generate.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_generate", module)
    spec.loader.exec_module(module)
    return module


def test_the_generate_bench_prints_the_eager_rows_first(bench, tmp_path, capsys):
    rows = bench.main(TINY + ["--name", "gen-test"])
    assert [r["case"] for r in rows] == [
        "single stream", "single stream, same request again (lengths seen)",
        "2 concurrent (HF: static batch 2)"]
    assert all(r["tessera tok/s"] > 0 and r["HF tok/s"] > 0 for r in rows)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ROW ")]
    assert len(printed) == 3
    assert len((tmp_path / "gen-test.jsonl").read_text().splitlines()) == 3


def test_a_spent_budget_keeps_the_first_row_only(bench):
    rows = bench.main(TINY + ["--name", "gen-budget", "--budget-s", "0"])
    assert [r["case"] for r in rows] == ["single stream"]


def test_the_quantized_rows_report_their_logit_error(bench):
    rows = bench.main(TINY + ["--name", "gen-quantized", "--int8", "--fp8", "--concurrency", "1"])
    quantized = {r["case"]: r for r in rows if "weights vs HF" in r["case"]}
    assert list(quantized) == ["single stream, Tessera int8 weights vs HF fp32",
                               "single stream, Tessera fp8 weights vs HF fp32"]
    for method, row in zip(("int8", "fp8"), quantized.values()):
        assert row["tessera tok/s"] > 0
        assert 0 < row[f"{method} logit error"] < 2.0 ** -3  # bound: tests/unit/core/test_quantize_fp8.py
