"""Every bench under bench/ takes `--budget-s`, and a spent budget keeps what was measured: the
rows before the first budget check are printed (`ROW name {json}`) and saved, and no further
case starts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[2] / "bench"
BENCHES = ["bench_async_save", "bench_compile", "bench_convert", "bench_convert_experts",
           "bench_cp", "bench_cross_entropy", "bench_fp8", "bench_fp8_export", "bench_generate",
           "bench_lora", "bench_lora_batched",
           "bench_memory", "bench_mm_layout", "bench_moe", "bench_parallel",
           "bench_serving_paged", "bench_speculative", "bench_structured", "bench_train",
           "bench_tune", "gpu_check",
           "serve_check", "serve_load"]

# Every script's `--help` in one interpreter: one torch import instead of one per script.
_HELP = """
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv, text, code = [path, "--help"], io.StringIO(), None
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    out[path] = {"code": code, "help": text.getvalue()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    paths = [str(BENCH / f"{name}.py") for name in BENCHES]
    out = subprocess.run([sys.executable, "-c", _HELP, *paths], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_takes_a_budget(helps, name):
    result = helps[str(BENCH / f"{name}.py")]
    assert result["code"] == 0, result
    assert "--budget-s" in result["help"]


def test_no_bench_is_left_out_of_the_list():
    scripts = {p.stem for p in BENCH.glob("*.py")} - {"_common", "run_all", "gpu_smoke"}
    assert scripts == set(BENCHES)


@pytest.fixture
def load(tmp_path, monkeypatch):
    """Import a bench script with its results directed to `tmp_path`; torch's thread count is
    restored afterwards (some benches set it)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import _common

    monkeypatch.setattr(_common, "RESULTS", tmp_path)
    threads = torch.get_num_threads()

    def _load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    yield _load
    torch.set_num_threads(threads)


def _saved(tmp_path: Path, name: str, capsys) -> tuple[list[dict], list[str]]:
    """The rows `name` saved, checked against its jsonl and the `ROW` lines it printed."""
    rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
    streamed = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    out, err = capsys.readouterr()
    printed = [line for line in out.splitlines() if line.startswith(f"ROW {name} ")]
    assert len(printed) == len(streamed) == len(rows)
    return rows, err.splitlines()


TINY = {  # results name: (script, tiny arguments, (key, value) of the first row)
    "mm_layout": ("bench_mm_layout", ["--in", "64", "--out", "64"], ("rows", 1)),
    "lora_batched": ("bench_lora_batched", [], ("hidden", 256)),
    "parallel": ("bench_parallel", ["--layers", "1", "--hidden", "64", "--seq", "16",
                                    "--batch", "2", "--micro-batches", "1", "--steps", "1"],
                 ("layout", "1 process (1 thread)")),
}


@pytest.mark.parametrize("name", list(TINY))
def test_a_spent_budget_keeps_the_first_row_only(load, tmp_path, capsys, name):
    script, argv, (key, value) = TINY[name]
    load(script).main([*argv, "--budget-s", "0"])
    rows, err = _saved(tmp_path, name, capsys)
    assert [r[key] for r in rows] == [value]
    assert any(line.startswith("budget of 0 s spent: ") for line in err), err


def test_without_a_budget_every_case_is_measured(load, tmp_path, capsys):
    load("bench_mm_layout").main(TINY["mm_layout"][1])
    rows, _ = _saved(tmp_path, "mm_layout", capsys)
    assert [(r["rows"], r["dtype"]) for r in rows] == [
        (m, dtype) for m in (1, 2, 16) for dtype in ("bfloat16", "float32")]
