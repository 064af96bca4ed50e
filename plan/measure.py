"""`tessera plan --measure`: run planned candidates for a few real steps and time them.

All candidates run in one world of `--nproc-per-node` local ranks started by torch's launcher
(`core.parallel.launch.launch_local_ranks`, as `tessera pretrain --nproc-per-node` starts its
ranks), so the ranks' start-up (seconds per rank on a busy CPU) is paid once, not per candidate.
Each rank loads each candidate's run config (`plan.run_config`, the YAML `--output` writes) with
the pretraining config loader and trains it with the pretraining loop's own functions
(`plan_for_world`, `build_rank_model`, `make_job`, `local_batch`, `train_step`): the same
checks, groups, schedules and optimizer a user's run gets, on a synthetic corpus of random
tokens (timing does not depend on what the tokens say). A candidate that fails (a rule it
breaks, running out of memory) is reported with the reason and the next one still runs.

Each step is timed between two barriers, so it lasts as long as the slowest rank's; the first
`warmup` steps (kernel compilation, first allocations, gloo connections) are left out and the
median of the rest is the candidate's measured step time. Peak memory is the largest over the
ranks of the peak resident set (CPU; reset per candidate through /proc/self/clear_refs) or of
the peak allocated (CUDA).

On a CPU each rank also reports the CPU time it ran in its timed steps; their sum over the
ranks' wall time is the candidate's `cpu_share`, how much of a core a rank had on average
(1.0: a core each, never waiting). The planner predicts a core per rank (shared only among its
own ranks, `commands._hardware`); on a machine other people load, the measured step is about
the predicted one over this share (a rank waiting for its peers in a collective lowers it too).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class Measurement:
    """One candidate's measured run (`ok` False: `error` says why, times are None)."""

    ok: bool
    step_time_s: float | None = None  # median over the timed steps
    tokens_per_s: float | None = None
    peak_memory_gib: float | None = None  # rank 0: peak RSS on CPU, peak allocated on GPU
    step_times_s: list[float] = field(default_factory=list)  # every timed step
    error: str | None = None
    cpu_share: float | None = None  # CPU: a rank's CPU time over wall time, mean of the ranks
    # CPU: the busiest rank's median CPU seconds per timed step (`cpu_step_time`), what the
    # prediction (a core per rank) is to be compared with on a machine others load.
    cpu_step_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "peak_memory_gib": self.peak_memory_gib, "step_times_s": self.step_times_s,
                "error": self.error, "cpu_share": self.cpu_share,
                "cpu_step_time_s": self.cpu_step_time_s}


def synthetic_data(directory: Path, vocab_size: int, tokens: int, seed: int = 0) -> Path:
    """An indexed dataset of `tokens` uniform random token ids in documents of 64-512 tokens;
    returns its prefix (no tokenizer: the vocabulary comes with the data)."""
    import numpy as np

    from tessera.training.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 513, size=tokens // 64 + 1)
    lengths = lengths[np.cumsum(lengths) <= tokens + 512]
    prefix = Path(directory) / "random_tokens"
    with IndexedDatasetWriter(prefix, vocab_size) as writer:
        writer.add_documents(rng.integers(0, vocab_size, size=int(lengths.sum())), lengths)
    return prefix


def measure_all(configs: Sequence[dict[str, Any]], workdir: Path, data: Path, *, nproc: int,
                steps: int, warmup: int, device: str = "cpu",
                labels: Sequence[str] | None = None) -> list[Measurement]:
    """Time each run config in `configs` for `steps` steps on `nproc` local ranks (one launch
    of torch's launcher for all of them; the ranks run `measure_worker`). Blocks until done;
    a candidate that fails is a `Measurement` with `ok` False, as is every one left unrun when
    the ranks themselves stop."""
    from tessera.core.parallel.launch import launch_local_ranks

    workdir.mkdir(parents=True, exist_ok=True)
    files = []
    for i, config in enumerate(configs):
        files.append(str(workdir / f"candidate-{i + 1}.yaml"))
        Path(files[-1]).write_text(yaml.safe_dump(config, sort_keys=False))
    spec = {"configs": files, "labels": list(labels or files), "data": str(data),
            "steps": steps, "warmup": warmup, "device": device}
    (workdir / "spec.json").write_text(json.dumps(spec, indent=1))
    results = workdir / "results.json"
    results.unlink(missing_ok=True)
    # One thread per rank, as `--calibrate` measures; torch's deprecation notices from every
    # rank would bury the progress lines.
    ranks_env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::FutureWarning"}
    saved = {k: os.environ.get(k) for k in ranks_env}
    os.environ.update(ranks_env)
    try:
        code = launch_local_ranks("plan", ["--measure-worker", str(workdir)], nproc)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    done = json.loads(results.read_text()) if results.is_file() else []
    out = [Measurement(**row) for row in done]
    reason = f"not run: the ranks stopped with exit code {code} (see the messages above)"
    return out + [Measurement(False, error=reason) for _ in configs[len(out):]]


def measure_worker(workdir: Path) -> int:
    """One rank's part of `measure_all`: train each candidate of `workdir/spec.json` in turn
    with the pretraining loop's own setup and step, time every step between barriers, and
    (rank 0) append each result to `workdir/results.json`."""
    from datetime import timedelta

    import torch.distributed as dist

    from tessera.core.parallel.groups import resolve_device
    from tessera.core.parallel.launch import init_distributed

    spec = json.loads((Path(workdir) / "spec.json").read_text())
    # A rank that fails inside a collective leaves its peers waiting: bound the wait, so the
    # failure is reported and the next candidate still runs.
    init_distributed(resolve_device(spec["device"]), timeout=timedelta(seconds=120))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    results: list[dict[str, Any]] = []
    for i, (config_file, label) in enumerate(zip(spec["configs"], spec["labels"])):
        if rank0:
            print(f"measure {i + 1}/{len(spec['configs'])}: {label}", file=sys.stderr,
                  flush=True)
        times, cpu, peak, error, tokens_per_step = _run_candidate(config_file, spec)
        m = _agree(times, cpu, peak, error, spec["warmup"], tokens_per_step, spec["device"])
        if rank0:
            share = (f", {m.cpu_share:.0%} of a core per rank, {m.cpu_step_time_s:.3f} s of CPU"
                     if m.cpu_share else "")
            print(f"  {m.step_time_s:.3f} s/step (median of {len(m.step_times_s)} steps{share})"
                  if m.ok else f"  failed: {m.error}", file=sys.stderr, flush=True)
            results.append(m.to_dict())
            from tessera.core.files import atomic_file

            with atomic_file(Path(workdir) / "results.json") as tmp:
                Path(tmp).write_text(json.dumps(results, indent=1))
    return 0


def _run_candidate(config_file: str, spec: dict[str, Any]
                   ) -> tuple[list[float], list[float], float | None, str | None, int]:
    """This rank's step times, CPU seconds per step, peak memory (GiB), error (None when it
    ran) and tokens per step for one config."""
    import gc
    import time

    from tessera.training.config import load_config
    from tessera.training.gpt_dataset import build_datasets
    from tessera.training.loop import (
        build_rank_model,
        local_batch,
        make_job,
        plan_for_world,
        train_step,
    )

    steps, times, cpu, job, tokens_per_step = spec["steps"], [], [], None, 0
    try:
        cfg, _ = load_config(["--config", config_file, "--data", spec["data"], "--steps",
                              str(steps), "--device", spec["device"]])
        plan, device = plan_for_world(cfg)
        data = plan.data
        tokens_per_step = data.global_batch * data.seq_len
        train_ds = build_datasets(list(data.data), data.seq_len, "100,0,0",
                                  [data.train_samples, 0, 0], data.seed)[0]
        groups, stages = build_rank_model(plan, device)
        for m in stages:
            m.train()
        job = make_job(plan, device, groups, stages)
        _reset_peak_memory(device)
        for step in range(steps):
            _barrier()
            tic, cpu_tic = time.perf_counter(), time.process_time()
            tokens, labels = local_batch(train_ds, step, data, job.groups, job.device)
            train_step(job, step, tokens, labels)
            _wait_for_device(device)  # train_step returns with its kernels queued, not run
            _barrier()  # the step ends when the slowest rank's does
            times.append(time.perf_counter() - tic)
            cpu.append(time.process_time() - cpu_tic)
        return times, cpu, _peak_memory_gib(device), None, tokens_per_step
    except Exception as exc:  # reported per candidate; the next one still runs
        text = [line.strip(" -") for line in str(exc).strip().splitlines() if line.strip()]
        reason = f"{type(exc).__name__}: {' '.join(text[:2])}"[:300]
        return times, cpu, None, reason, tokens_per_step
    finally:
        del job  # the next candidate's model starts from a clean heap
        gc.collect()


def _agree(times: list[float], cpu: list[float], peak: float | None, error: str | None,
           warmup: int, tokens_per_step: int, device: str = "cpu") -> Measurement:
    """One `Measurement` from every rank's results (all ranks get the same one)."""
    import torch.distributed as dist

    reports = [(times, cpu, peak, error)]
    if dist.is_initialized():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (times, cpu, peak, error))
    errors = [f"rank {r}: {e}" for r, (_, _, _, e) in enumerate(reports) if e]
    if errors:
        return Measurement(False, error=errors[0])
    timed = times[warmup:] or times[-1:]
    median = statistics.median(timed)
    peaks = [p for _, _, p, _ in reports if p is not None]
    cpu = device == "cpu"
    return Measurement(True, median, tokens_per_step / median, max(peaks) if peaks else None,
                       timed, cpu_share=cpu_share(reports, warmup) if cpu else None,
                       cpu_step_time_s=cpu_step_time(reports, warmup) if cpu else None)


def cpu_share(reports: Sequence[tuple[list[float], list[float], Any, Any]], warmup: int
              ) -> float | None:
    """Mean over the ranks of CPU seconds over wall seconds in the timed steps (the first
    `warmup` left out): how much of a core a rank had. `reports`: each rank's (step wall
    times, step CPU times, ...). None when nothing was timed."""
    shares = [sum(c[warmup:] or c[-1:]) / sum(t[warmup:] or t[-1:])
              for t, c, *_ in reports if t and sum(t[warmup:] or t[-1:]) > 0]
    return sum(shares) / len(shares) if shares else None


def cpu_step_time(reports: Sequence[tuple[list[float], list[float], Any, Any]], warmup: int
                  ) -> float | None:
    """The largest over the ranks of a rank's median CPU seconds per timed step (the first
    `warmup` left out): the step time the ranks would have with a core each and no other
    load, which is what the planner predicts. A rank blocked in a gloo collective sleeps, so
    its wait is not counted; the busiest rank sets the pace. None when nothing was timed."""
    medians = [statistics.median(c[warmup:] or c[-1:]) for t, c, *_ in reports if c]
    return max(medians) if medians else None


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _wait_for_device(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak_memory(device: Any) -> None:
    """Start a new peak: CUDA's allocator statistics, or Linux's peak RSS (VmHWM)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS to the current
    except OSError:
        pass  # not Linux: the peak is the process's since it started


def _peak_memory_gib(device: Any) -> float:
    """Peak memory since `_reset_peak_memory`: allocated on CUDA, resident set on a CPU."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, smallest first; tied values share the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of two equally long sequences: the Pearson correlation of
    their ranks (ties averaged). None with fewer than 2 pairs or when either is constant."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs equally long sequences, got {len(xs)} and {len(ys)}")
    if len(xs) < 2:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if not sxx or not syy:
        return None
    return sxy / (sxx * syy) ** 0.5
