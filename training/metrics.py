"""What a training run reports: a progress bar, a compact line every N steps, `metrics.jsonl`
(one JSON object per step, for plotting), TensorBoard events when tensorboard is installed, and a
summary table at the end. Only rank 0 reports; the others construct a disabled logger.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from tessera.core.config import ConfigError
from tessera.core.progress import Progress
from tessera.training.stragglers import straggler_note


def measure_peak_tflops(device: torch.device | str, dtype: torch.dtype | None = None,
                        seconds: float = 0.5, n: int | None = None) -> float:
    """Dense `n x n` matmul TFLOP/s this device reaches (best of the runs that fit in `seconds`,
    after a warm-up): the MFU denominator of the training log and of `bench/`."""
    device, dtype = torch.device(device), dtype or torch.float32
    n = n or (4096 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 / (time.perf_counter() - tic) / 1e12)
    return best


# Dense (no sparsity) datasheet peaks in TFLOP/s per GPU, by the name CUDA reports:
# (16-bit tensor cores, TF32 tensor cores, plain fp32). A key matches whole words of the name
# ("NVIDIA A100-SXM4-80GB" holds A100, "NVIDIA A10G" does not hold A10); the first match wins,
# so the more specific names come first.
CUDA_PEAKS: dict[str, tuple[float, float, float]] = {
    "H100 PCIe": (756.0, 378.0, 51.2),
    "H100 NVL": (835.0, 418.0, 60.0),
    "H100": (989.4, 494.7, 66.9),  # SXM ("NVIDIA H100 80GB HBM3")
    "GH200": (989.4, 494.7, 66.9),
    "H200": (989.4, 494.7, 66.9),
    "A100": (312.0, 156.0, 19.5),
    "L40S": (362.0, 183.0, 91.6),
    "L4": (121.0, 60.0, 30.3),
    "A10": (125.0, 62.5, 31.2),
    "V100": (125.0, 0.0, 15.7),  # 16-bit is fp16 only
    "T4": (65.0, 0.0, 8.1),
}


def known_peak_tflops(device_name: str, dtype: torch.dtype | None, tf32: bool = False
                      ) -> float | None:
    """The datasheet dense peak of a CUDA device for matmuls in `dtype` (None: fp32), or None
    when the device is not in `CUDA_PEAKS`. fp32 matmuls count at the TF32 rate when `tf32`."""
    words = " " + " ".join(re.split(r"[\s\-_]+", device_name)) + " "
    for key, (half, tf32_peak, fp32) in CUDA_PEAKS.items():
        if f" {key} " in words:
            if dtype in (torch.bfloat16, torch.float16):
                return half
            return tf32_peak if tf32 and tf32_peak else fp32
    return None


def resolve_peak(spec: str | float, device: torch.device, dtype: torch.dtype | None
                 ) -> tuple[float | None, str]:
    """The per-device peak TFLOP/s that MFU is reported against, and where it comes from.

    `spec` is `--peak-tflops`: a number (the user's), "measure" (a matmul timed now, which
    reads low on a busy machine), or "auto": the datasheet peak of a known CUDA device for the
    run's compute dtype, else None (MFU is then reported as n/a rather than against a guess).
    """
    text = str(spec).strip().lower()
    if text not in ("auto", "measure", ""):
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"--peak-tflops expects a number, auto or measure; got {spec!r}"
                              ) from None
        if value > 0:
            return value, "--peak-tflops"
        if value < 0:
            raise ConfigError(f"--peak-tflops must be positive, got {spec!r}")
        text = "auto"  # 0 meant "work it out" before auto existed
    if text == "measure":
        return measure_peak_tflops(device, dtype), f"measured at start-up on {device.type}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        peak = known_peak_tflops(name, dtype, tf32)
        if peak is not None:
            kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "tf32" if tf32
                                                                         else "fp32")
            return peak, f"{name} {kind} datasheet (dense)"
        return None, f"{name} is not in the table of known peaks"
    return None, f"no known peak for {device.type}"


class StepWindow:
    """The steps since the last logging step, their metrics kept as the steps returned them.

    A training step returns its loss and gradient norm as device tensors (`loop.train_step`);
    reading one makes the host wait for the device. The window keeps them and `resolve` reads
    the whole window's in one device-to-host copy, so a run waits for its device once per
    logging step rather than once or twice per step. It also times the window: the wall time
    from `restart` to `resolve`, which, taken after that one wait, covers the window's device
    work too (per-step host timings would only time the kernel launches).
    """

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.tic = time.perf_counter()

    def restart(self) -> None:
        """Start timing the next window (after a logging step's evaluation and saving)."""
        self.tic = time.perf_counter()

    def add(self, step: int, metrics: dict[str, Any]) -> None:
        """Keep step `step`'s metrics (tensors stay on their device, unread)."""
        self.rows.append((step, metrics))

    def resolve(self) -> tuple[list[dict[str, Any]], float]:
        """Every kept step's metrics with its tensors as floats, oldest first, each with its
        `step`, and the seconds since `restart`; the window is then empty."""
        tensors = [v.float() for _, m in self.rows for v in m.values()
                   if isinstance(v, torch.Tensor)]
        values = iter(torch.stack(tensors).tolist() if tensors else [])  # the one wait
        elapsed = time.perf_counter() - self.tic
        rows = [{**{k: next(values) if isinstance(v, torch.Tensor) else v for k, v in m.items()},
                 "step": step} for step, m in self.rows]
        self.rows = []
        return rows, elapsed


def checked_losses(rows: list[dict[str, Any]], step: int) -> list[float]:
    """The losses of a resolved window ending at `step`; a non-finite one is an error naming
    the first step it appeared at."""
    losses = [row["loss"] for row in rows]
    for row in rows:
        if not math.isfinite(row["loss"]):
            raise FloatingPointError(
                f"loss became {row['loss']} at step {row['step']} (found at step {step}, "
                "where the losses are read); lower --lr or use --precision fp32")
    return losses


def drop_rows_after(path: Path, step: int) -> None:
    """Remove from the metrics file at `path` (if any) the rows of steps after `step`, and a
    torn last line: what an attempt that died logged past the checkpoint a run resumes from
    (`step`; 0 for a fresh start), so each step is logged once. Atomic: a crash leaves the old
    file or the new one."""
    if not path.is_file():
        return
    kept, lines = [], path.read_text().splitlines(keepends=True)
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not (isinstance(row, dict) and row.get("step", 0) > step):
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept == lines:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class MetricsLogger:
    """Progress, JSONL metrics, optional TensorBoard and the final summary of one run."""

    def __init__(self, loop_cfg: Any, *, enabled: bool, total: int, initial: int = 0,
                 resumed_from: Path | None = None, desc: str = "pretrain"):
        self.enabled, self.cfg, self.start_time = enabled, loop_cfg, time.perf_counter()
        self.initial, self.bar, self.tb, self.jsonl = initial, None, None, None
        if not enabled:
            return
        out = Path(loop_cfg.output)
        out.mkdir(parents=True, exist_ok=True)
        drop_rows_after(out / "metrics.jsonl", initial)
        self.jsonl = open(out / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        if loop_cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except (ImportError, ModuleNotFoundError):
                self.tb = None
        if loop_cfg.progress:  # a bar on a terminal, a plain line now and then in a log
            self.bar = Progress(desc, total=total, initial=initial, unit="step")
        if resumed_from is not None:
            self.write(f"resumed from {resumed_from} at step {initial}")

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def due(self, step: int) -> bool:
        """Whether `step` prints a metrics line: every `log_interval` steps and the first step
        of the run. The same on every rank (the logger of a non-zero rank is disabled)."""
        return step % self.cfg.log_interval == 0 or step == self.initial + 1

    def step(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = m["step"]
        self.jsonl.write(json.dumps({k: _plain(v) for k, v in m.items()}) + "\n")
        if self.tb is not None:
            for key, value in m.items():
                if key != "step" and isinstance(value, float) and math.isfinite(value):
                    self.tb.add_scalar(f"train/{key}", value, step)
        if self.bar is not None:
            self.bar.update(1, loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}")
        if self.due(step) or "valid_loss" in m:
            line = (f"step {step:>6} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | "
                    f"grad norm {m['grad_norm']:.3f} | {m['tokens_per_s']:,.0f} tok/s | "
                    f"{m['tflops']:.3f} TFLOP/s | MFU {_percent(m['mfu'])} | "
                    f"mem {m['memory_gb']:.2f} GB")
            if m.get("skipped_steps"):
                line += f" | skipped {m['skipped_steps']}"
            line += straggler_note(m)
            if "valid_loss" in m:
                line += f" | valid loss {m['valid_loss']:.4f} ppl {math.exp(m['valid_loss']):.1f}"
            self.write(line)

    def saved(self, path: Path, step: int) -> None:
        self.write(f"saved checkpoint {path} (step {step})")

    def finish(self, *, losses: list[float], valid_loss: float, stopped: bool,
               checkpoint: Path | None, peak_tflops: float | None, peak_source: str = "",
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Print the summary table; `extra` (e.g. per-task results) joins the JSONL summary.
        `peak_tflops` (None: unknown) is what MFU was measured against, `peak_source` where it
        came from (see `resolve_peak`)."""
        elapsed = time.perf_counter() - self.start_time
        summary = {
            "steps": self.initial + len(losses), "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None, "valid_loss": valid_loss,
            "valid_ppl": math.exp(valid_loss) if math.isfinite(valid_loss) else None,
            "seconds": elapsed, "stopped_early": stopped,
            "checkpoint": str(checkpoint) if checkpoint else None,
            "peak_tflops": peak_tflops, "peak_source": peak_source, **(extra or {}),
        }
        if not self.enabled:
            return summary
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.jsonl.write(json.dumps({"summary": {k: _plain(v) for k, v in summary.items()}})
                         + "\n")
        self.jsonl.close()
        rows = [("steps", summary["steps"]),
                ("loss (first -> last)", f"{_fmt(summary['first_loss'])} -> "
                                         f"{_fmt(summary['final_loss'])}"),
                ("valid loss / ppl", f"{_fmt(valid_loss)} / {_fmt(summary['valid_ppl'])}"),
                ("wall time", f"{elapsed:.1f} s"),
                ("MFU measured against", describe_peak(peak_tflops, peak_source)),
                ("stopped early (signal)", "yes" if stopped else "no"),
                *([("skipped steps / rollbacks", f"{summary['skipped_steps']} / "
                                                 f"{summary.get('rollbacks', 0)}")]
                  if summary.get("skipped_steps") or summary.get("rollbacks") else []),
                ("checkpoint", summary["checkpoint"] or "-")]
        width = max(len(k) for k, _ in rows)
        print("\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows), flush=True)
        return summary


def describe_peak(peak: float | None, source: str) -> str:
    """'989.4 TFLOP/s per device (NVIDIA H100 ... datasheet)', or why MFU is n/a."""
    if peak is None:
        return (f"n/a ({source}; pass --peak-tflops N, or --peak-tflops measure to time a "
                "matmul)" if source else "n/a")
    return f"{peak:,.3g} TFLOP/s per device ({source})" if source else f"{peak:,.3g} TFLOP/s"


def _percent(value: float) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{100 * value:.1f}%"


def _fmt(value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else \
        f"{value:.4f}"


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value
