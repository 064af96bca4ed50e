"""What a training run reports: a progress bar, a compact line every N steps, `metrics.jsonl`
(one JSON object per step, for plotting), TensorBoard events when tensorboard is installed, and a
summary table at the end. Only rank 0 reports; the others construct a disabled logger.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


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
        self.jsonl = open(out / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        if loop_cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except (ImportError, ModuleNotFoundError):
                self.tb = None
        if loop_cfg.progress:
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step",
                            dynamic_ncols=True, leave=False)
        if resumed_from is not None:
            self.write(f"resumed from {resumed_from} at step {initial}")

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

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
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}")
        if step % self.cfg.log_interval == 0 or "valid_loss" in m or step == self.initial + 1:
            line = (f"step {step:>6} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | "
                    f"grad norm {m['grad_norm']:.3f} | {m['tokens_per_s']:,.0f} tok/s | "
                    f"{m['tflops']:.3f} TFLOP/s | MFU {100 * m['mfu']:.1f}% | "
                    f"mem {m['memory_gb']:.2f} GB")
            if "valid_loss" in m:
                line += f" | valid loss {m['valid_loss']:.4f} ppl {math.exp(m['valid_loss']):.1f}"
            self.write(line)

    def saved(self, path: Path, step: int) -> None:
        self.write(f"saved checkpoint {path} (step {step})")

    def finish(self, *, losses: list[float], valid_loss: float, stopped: bool,
               checkpoint: Path | None, peak_tflops: float,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Print the summary table; `extra` (e.g. per-task results) joins the JSONL summary."""
        elapsed = time.perf_counter() - self.start_time
        summary = {
            "steps": self.initial + len(losses), "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None, "valid_loss": valid_loss,
            "valid_ppl": math.exp(valid_loss) if math.isfinite(valid_loss) else None,
            "seconds": elapsed, "stopped_early": stopped,
            "checkpoint": str(checkpoint) if checkpoint else None,
            "peak_tflops": peak_tflops, **(extra or {}),
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
                ("matmul peak used for MFU", f"{peak_tflops:.3f} TFLOP/s"),
                ("stopped early (signal)", "yes" if stopped else "no"),
                ("checkpoint", summary["checkpoint"] or "-")]
        width = max(len(k) for k, _ in rows)
        print("\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows), flush=True)
        return summary


def _fmt(value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else \
        f"{value:.4f}"


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value
