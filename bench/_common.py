"""Shared helpers of the benchmarks: timing, peak matmul, peak RSS, and the results table.

Every benchmark measures Tessera and its peer in the same run on the same machine and reports
the ratio, because absolute times on shared machines drift. Results are appended to
`bench/results/latest.json` (one entry per row) and rendered as a Markdown table.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def best_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Best wall time of `fn` in seconds over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        _sync()
        tic = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - tic)
    return best


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_time(fn: Callable[[], object], steps: int = 5, warmup: int = 2,
                device: str = "cpu") -> float:
    """Mean seconds per call of `fn` over `steps` calls after `warmup` calls. On CUDA it is
    timed with CUDA events around all `steps` (one synchronisation at the end, so launch
    overhead overlaps as it does in a real loop); elsewhere with the wall clock."""
    for _ in range(warmup):
        fn()
    if device == "cuda" or (device.startswith("cuda:")):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / steps
    tic = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - tic) / steps


class Budget:
    """A wall-clock allowance in seconds for a benchmark (`--budget-s`): rows are measured while
    `left()` is positive, and what was measured is still reported when it runs out."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    def left(self) -> float:
        if self.seconds is None:
            return float("inf")
        return self.seconds - (time.monotonic() - self.start)

    def spent(self) -> bool:
        return self.left() <= 0

    def skips(self, what: str) -> bool:
        """Whether the budget is spent; if so, says on stderr that `what` is not measured."""
        if not self.spent():
            return False
        print(f"budget of {self.seconds:g} s spent: {what} not measured", file=sys.stderr,
              flush=True)
        return True


class Rows:
    """The rows of one benchmark, each printed and saved the moment it is measured: a line on
    stdout (`ROW {json}`), appended to `bench/results/<name>.jsonl`; `finish()` writes the table
    (`record`). A killed run keeps every row it printed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rows: list[dict] = []
        RESULTS.mkdir(exist_ok=True)
        self._jsonl = RESULTS / f"{name}.jsonl"
        self._jsonl.write_text("")

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        line = json.dumps(row, default=str)
        with self._jsonl.open("a") as f:
            f.write(line + "\n")
        print(f"ROW {self.name} {line}", flush=True)
        return row

    def finish(self) -> list[dict]:
        record(self.rows, self.name)
        return self.rows


def matmul_peak_tflops(dtype: torch.dtype, device: str = "cpu", n: int | None = None) -> float:
    """The best dense matmul TFLOP/s of this device in `dtype` (the MFU denominator), measured
    as training does, on larger matrices."""
    from tessera.training.metrics import measure_peak_tflops

    return measure_peak_tflops(device, dtype, seconds=2.0,
                               n=n or (8192 if device == "cuda" else 2048))


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> str:
    """The host in one line, with the CPU's ISA: CPU figures differ by it (core/cpu_isa.py)."""
    from tessera.core.cpu_isa import cpu_isa

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{platform.processor() or platform.machine()}, {cpu_isa()}, {os.cpu_count()} CPU "
            f"cores, {gpu}, torch {torch.__version__}")


def record(rows: list[dict], name: str) -> None:
    """Print rows as a table and save them under `bench/results/` (JSON and Markdown)."""
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    payload = {"benchmark": name, "date": stamp, "machine": machine(), "rows": rows}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    table = markdown_table(rows)
    (RESULTS / f"{name}.md").write_text(f"{name} — {stamp} — {machine()}\n\n{table}\n")
    print(f"\n{name} ({stamp}; {machine()})\n{table}\n", flush=True)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def answer_only_batch(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random ids `(batch, seq)` and labels that score only the last 8 tokens, as tuning
    scores only an answer."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq - 8] = -100
    return ids, labels


def run_child(script: str, *argv: str) -> dict:
    """Run `python script --child *argv` in a fresh process (so each side's peak memory is its
    own) and return the JSON object its last stdout line holds."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, script, "--child", *argv], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
