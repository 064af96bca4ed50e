"""`tessera plan --calibrate`: measure this machine so the planner's `cpu` profile is its own.

One rank of `tessera pretrain --nproc-per-node N` on a CPU is one process running one thread
(the launcher sets OMP_NUM_THREADS=1), so that is what is measured:

- fp32 GEMM throughput of one thread as a training step runs its linear layers: the forward,
  input-gradient and weight-gradient GEMMs of a few layer shapes (`layer_gemm_tflops`); bf16
  at a few plain shapes (only to tell whether this CPU has native bf16);
- the training loss's cost per logit (cross-entropy forward + backward: exp and log bound on
  a CPU, not memory bound as on a GPU);
- gloo all-reduce between two local ranks (`core.parallel.spawn.run_ranks`): the bus bandwidth
  at the largest message, 2(n-1)/n x bytes / time as nccl-tests reports it, and the latency of
  a small message (tiny models are latency-bound);
- the instruction set the kernels can use (AVX2 / AVX512 / AMX, from /proc/cpuinfo), the core
  count and the memory size;
- the bandwidth of a one-thread memory copy (what the memory-bound ops see);
- the rate of a causal attention kernel (`scaled_dot_product_attention`, forward + backward),
  which on this AVX2 CPU runs at 38-62 GFLOP/s against the GEMMs' 78 (the profile's
  `attention_efficiency` is their ratio; it was taken as 1);
- the fixed cost of a layer and of a micro-batch (eager PyTorch's per-op dispatch, which
  dominates the step of a small model): forward + backward of a tiny model at two depths.

Every rate is the MEDIAN run within a short CPU-time budget, after a warm-up, not the best:
see `_median` for why and what it changed.

The one-thread measurements are timed on the process's CPU clock (`cpu_clock`), not the wall
clock: they are the rate of the core while the rank runs, which is what the profile means. On
a shared machine the best wall time of a short op is the core's rate but a long op is cut by
the scheduler: at a load average of ~9 on this 2-core AMD EPYC (AVX2), one thread measured
1024x1024x1024 at 23.5 GFLOP/s on the wall clock against 76 on its CPU clock, and 81 for a
short 256x256x1024 either way, so the calibration mixed two machines (and it measured a tiny
model's per-layer cost at 3.3-4.3 ms on the wall clock against 1.2 ms on the CPU clock). How
much of a core each rank then gets is the run's business: `tessera plan` shares the cores
among its own ranks, and `--measure` reports the CPU share its ranks got (`Measurement`).

The result is a flat JSON object (`hardware.CALIBRATION_KEYS` at least) that
`tessera.plan.hardware.load_hardware("cpu", path)` reads; `default_path()` (that is,
`hardware.default_calibration()`) is where it goes.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.plan.hardware import default_calibration as default_path  # the CLI names it so

# (tokens, h, n) linear layers whose training-step GEMMs (`layer_gemm_tflops`) give the fp32
# rate: a small model's projection and MLP, and a wider layer.
LAYER_GEMM_SHAPES = ((2048, 256, 1024), (2048, 512, 512), (2048, 1024, 1024))
QUICK_LAYER_GEMM_SHAPES = ((64, 64, 64), (128, 64, 256))
# (m, k, n) plain GEMMs for the bf16 rate (only to tell whether bf16 is native here).
GEMM_SHAPES = ((256, 256, 1024), (512, 512, 512), (1024, 1024, 1024), (512, 1024, 4096))
QUICK_GEMM_SHAPES = ((64, 64, 64), (128, 128, 256))
# (tokens, vocabulary) of the loss measured: 32 MiB of fp32 logits, more than a core's share
# of the L3, as any real vocabulary's logits are (7 ns per logit at 2048 x 1024, 10 at 4096).
LOSS_SHAPE = (2048, 4096)
QUICK_LOSS_SHAPE = (64, 512)
ALLREDUCE_BYTES = (4 * 2**10, 4 * 2**20, 32 * 2**20)  # latency, middle, bandwidth
QUICK_ALLREDUCE_BYTES = (4 * 2**10, 256 * 2**10)
# (batch, heads, sequence, head dim) of the attention measured: a small model's layer.
ATTENTION_SHAPE = (2, 8, 512, 64)
QUICK_ATTENTION_SHAPE = (1, 2, 64, 16)


def cpu_isa(cpuinfo: str | None = None) -> str:
    """The widest matrix/vector instruction set the CPU reports: AMX, AVX512, AVX2, AVX, or
    the machine name when /proc/cpuinfo is absent (not Linux). `cpuinfo` is the file's text."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.machine() or "unknown"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    if {"amx_bf16", "amx_tile"} & flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX512"
    for isa in ("avx2", "avx"):
        if isa in flags:
            return isa.upper()
    return platform.machine() or "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float:
    """Physical memory of the machine in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_clock() -> float:
    """Seconds of CPU this process has run (all its threads; one here), the clock the
    one-thread measurements use (see the module doc)."""
    return time.process_time()


def cpu_times(run: Callable[[], object], seconds: float) -> list[float]:
    """CPU seconds (`cpu_clock`) of each of the runs of `run` that fit in `seconds` of CPU time
    (at least one), after one warm-up run (first-call dispatch, packing, compilation)."""
    run()
    times, deadline = [], cpu_clock() + seconds
    while True:
        tic = cpu_clock()
        run()
        times.append(cpu_clock() - tic)
        if cpu_clock() >= deadline:
            return times


# Why the median and not the best run: a training step runs each of its ops once, at the
# typical rate of the core, and the step time is their sum. The best of many back-to-back runs
# of one op is that op in the best case (operands still in cache, no neighbour on the shared
# L3). Measured on this 2-core AMD EPYC (AVX2, no AMX): in one rank's step of a llama-tiny
# widened to hidden 256 (4 layers, vocabulary 4096, 8 x 256 tokens), torch.profiler put the
# step's 51 GEMMs at 54 GFLOP/s in all, against 79-89 for the best runs of the calibration's
# square GEMMs; the same shapes alone ran 45-73 GFLOP/s at their median.
def _median(times: list[float]) -> float:
    return statistics.median(times)


def gemm_tflops(m: int, k: int, n: int, dtype_name: str, seconds: float) -> float:
    """Median TFLOP/s of an (m x k) @ (k x n) matmul on one thread within `seconds` of its CPU
    time (`cpu_clock`)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    with _one_thread():
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        return 2 * m * k * n / _median(cpu_times(lambda: a @ b, seconds)) / 1e12


def layer_gemm_tflops(tokens: int, h: int, n: int, seconds: float) -> float:
    """TFLOP/s of one linear layer's three GEMMs in an fp32 training step on one thread: the
    forward X @ W (tokens x h by h x n), the input gradient dY @ W^T and the weight gradient
    X^T @ dY (the tokens as its inner dimension), each at its median CPU time within
    `seconds`, their FLOPs over the sum. The backward's transposed operands and the weight
    gradient's long inner dimension run slower than a square GEMM: measured here (AVX2), a
    2048 x 256 x 4096 forward ran at 45-55 GFLOP/s where 512^3 ran at 74-89. The operands
    rotate over a few copies so that a run does not find the previous one's in cache, as an
    op of a step does not."""
    import torch

    copies = 3
    with _one_thread():
        x = [torch.randn(tokens, h) for _ in range(copies)]
        w = [torch.randn(h, n) for _ in range(copies)]
        dy = [torch.randn(tokens, n) for _ in range(copies)]
        total = 0.0
        for op in (lambda i: x[i] @ w[i], lambda i: dy[i] @ w[i].t(),
                   lambda i: x[i].t() @ dy[i]):
            turn = itertools.count()
            total += _median(cpu_times(lambda op=op, turn=turn: op(next(turn) % copies),
                                       seconds))
    return 3 * 2 * tokens * h * n / total / 1e12


def layer_gemm_rate(rows: list[dict[str, Any]]) -> float:
    """The profile's fp32 rate from `layer_gemm_tflops` rows (`tokens`, `h`, `n`, `tflops`):
    all their FLOPs over all their time, so that each shape counts by its work."""
    flops = [6 * r["tokens"] * r["h"] * r["n"] for r in rows]
    return sum(flops) / sum(f / r["tflops"] for f, r in zip(flops, rows))


class _one_thread:
    """Run the body on one torch thread, as a `tessera pretrain` rank on a CPU does."""

    def __enter__(self) -> None:
        import torch

        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self.threads)


def copy_gbps(nbytes: int, seconds: float) -> float:
    """Median GB/s of one thread copying `nbytes` (read + write counted): the bandwidth the
    memory-bound ops (norms, activations, the optimizer step) see."""
    import torch

    with _one_thread():
        src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        return 2 * nbytes / _median(cpu_times(lambda: dst.copy_(src), seconds)) / 1e9


def attention_tflops(batch: int, heads: int, seq: int, head_dim: int, seconds: float) -> float:
    """Median TFLOP/s of a causal `scaled_dot_product_attention` forward + backward on one
    thread within `seconds` of CPU time, in the FLOPs the planner counts for it
    (`estimate._layer_times`: 4 b s^2 a d forward over the whole score matrix, the backward
    twice that), so that its ratio to the GEMM rate is the profile's attention efficiency."""
    import torch
    import torch.nn.functional as F

    with _one_thread():
        q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True)
                   for _ in range(3))

        def run() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        typical = _median(cpu_times(run, seconds))
    return 3 * 4 * batch * seq * seq * heads * head_dim / typical / 1e12


def loss_ns_per_logit(tokens: int, vocab: int, seconds: float) -> float:
    """Median CPU nanoseconds per logit of the training loss, forward and backward, on one
    thread: Tessera's cross-entropy (`core.fused.cross_entropy`, compiled or eager as the
    environment selects, as the ranks run it) over (tokens x vocab) fp32 logits. On this AVX2
    CPU it is 7-10 ns per logit (its exp and log, not its bytes: the memory passes the
    planner charges for it came to 0.75 ns); in the widened llama-tiny step above it took
    85-114 ms of the step, against 6 ms predicted."""
    import torch

    from tessera.core.fused import cross_entropy

    with _one_thread():
        logits = torch.randn(tokens, vocab, requires_grad=True)
        target = torch.randint(0, vocab, (tokens,))

        def run() -> None:
            cross_entropy(logits, target, -100).mean().backward()

        return _median(cpu_times(run, seconds)) / (tokens * vocab) * 1e9


# The model whose forward + backward times the fixed per-op costs: tiny, so that its FLOPs
# and bytes are negligible next to dispatching its ops (what dominates small models on CPUs).
OVERHEAD_MODEL = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 172,
                  "vocab_size": 512}
OVERHEAD_TOKENS = (4, 32)  # micro-batch, sequence
OVERHEAD_LAYERS = (1, 4)


def framework_overheads(seconds: float) -> tuple[float, float]:
    """(per-layer, per-micro-batch) fixed costs in microseconds of one rank's forward +
    backward, as `Hardware.layer_overhead_us` / `microbatch_overhead_us` count them: the median
    time of a tiny `GPTModel`'s step at 1 and 4 layers (one thread, in the fused-kernel mode
    the environment selects, as the training ranks run) gives the cost of a layer (slope, a
    forward and a backward of twice its ops, so three forward units) and of the rest of a
    micro-batch (intercept: embedding, output layer, loss)."""
    import dataclasses as dc

    import torch

    from tessera.core.config import ModelConfig
    from tessera.core.models.decoder.model import GPTModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    try:
        torch.manual_seed(0)
        for layers in OVERHEAD_LAYERS:
            cfg = dc.replace(ModelConfig.from_name("llama-tiny"), num_layers=layers,
                             **OVERHEAD_MODEL)
            model = GPTModel(cfg)
            tokens = torch.randint(0, cfg.vocab_size, OVERHEAD_TOKENS)

            def step(model: torch.nn.Module = model, tokens: torch.Tensor = tokens) -> None:
                out = model(tokens)
                (out if torch.is_tensor(out) else out[0]).float().mean().backward()

            step()  # warm-up (and compilation, with fused kernels); cpu_times runs one more
            times.append(_median(cpu_times(step, seconds)))
    finally:
        torch.set_num_threads(threads)
    (l1, t1), (l2, t2) = zip(OVERHEAD_LAYERS, times)
    per_layer = max(0.0, (t2 - t1) / (l2 - l1))  # forward + backward of one layer
    return per_layer / 3 * 1e6, max(0.0, t1 - l1 * per_layer) * 1e6


def _allreduce_body(rank: int, world: int, sizes: tuple[int, ...], seconds: float
                    ) -> list[tuple[int, float]]:
    """(bytes, best seconds) of a float32 gloo all-reduce at each size (spawned by run_ranks)."""
    import torch
    import torch.distributed as dist

    out = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)  # warm-up: connects the pair
        best, repeats = float("inf"), 0
        deadline = time.perf_counter() + seconds
        while True:
            dist.barrier()
            tic = time.perf_counter()
            dist.all_reduce(x)
            best = min(best, time.perf_counter() - tic)
            repeats += 1
            # Every rank runs the same number of repeats: rank 0 decides when to stop.
            more = torch.tensor(float(time.perf_counter() < deadline and repeats < 50))
            dist.broadcast(more, 0)
            if not more:
                break
        best_all = torch.tensor(best)
        dist.all_reduce(best_all, op=dist.ReduceOp.MAX)  # the pair is as slow as its slower rank
        out.append((nbytes, float(best_all)))
    return out


def measure_allreduce(world: int, sizes: tuple[int, ...], seconds: float
                      ) -> list[tuple[int, float]]:
    """(bytes, best seconds) of a gloo all-reduce over `world` fresh local ranks per size."""
    from tessera.core.parallel.spawn import run_ranks

    return run_ranks(_allreduce_body, world, sizes, seconds)[0]


def calibrate(path: Path | None = None, *, quick: bool = False,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure this machine, write the calibration JSON to `path` (default `default_path()`),
    and return it. `quick` uses tiny shapes (seconds; for tests, not for planning).
    `progress` receives one line per measurement (default: stderr)."""
    say = progress or (lambda text: print(text, file=sys.stderr, flush=True))
    path = Path(path) if path else default_path()
    isa, cores = cpu_isa(), cpu_cores()
    say(f"calibrating {cpu_name()} ({isa}, {cores} cores) for the planner's cpu profile")
    budget = 0.05 if quick else 0.4
    gemms: dict[str, list[dict[str, Any]]] = {"fp32": []}
    for tokens, h, n in (QUICK_LAYER_GEMM_SHAPES if quick else LAYER_GEMM_SHAPES):
        tflops = layer_gemm_tflops(tokens, h, n, budget)
        say(f"  GEMM fp32 linear {tokens} tokens x {h} -> {n}, forward + both gradients "
            f"(1 thread): {tflops * 1e3:.1f} GFLOP/s")
        gemms["fp32"].append({"tokens": tokens, "h": h, "n": n, "tflops": tflops})
    for dtype_name in ("bf16",):
        rows: list[dict[str, Any]] = []
        for m, k, n in (QUICK_GEMM_SHAPES if quick else GEMM_SHAPES):
            # Without AMX (or AVX512-BF16) bf16 matmuls are emulated and ~100x slower: a shape
            # whose few runs would overrun the budget is skipped, not waited for.
            best = max((r["tflops"] for r in rows), default=0.0)
            if best and 2 * m * k * n / (best * 1e12) > budget / 2:
                say(f"  GEMM {dtype_name} {m}x{k}x{n}: skipped (too slow on this CPU)")
                continue
            tflops = gemm_tflops(m, k, n, dtype_name, budget)
            say(f"  GEMM {dtype_name} {m}x{k}x{n} (1 thread): {tflops * 1e3:.1f} GFLOP/s")
            rows.append({"m": m, "k": k, "n": n, "tflops": tflops})
        gemms[dtype_name] = rows
    memory_gbps = copy_gbps(2**20 if quick else 64 * 2**20, budget)
    say(f"  memory copy (1 thread): {memory_gbps:.1f} GB/s")
    shape = QUICK_ATTENTION_SHAPE if quick else ATTENTION_SHAPE
    attention = attention_tflops(*shape, budget)
    say(f"  causal attention {'x'.join(map(str, shape))} forward + backward (1 thread): "
        f"{attention * 1e3:.1f} GFLOP/s")
    logits = QUICK_LOSS_SHAPE if quick else LOSS_SHAPE
    loss_ns = loss_ns_per_logit(*logits, budget)
    say(f"  cross-entropy loss over {logits[0]} x {logits[1]} logits, forward + backward "
        f"(1 thread): {loss_ns:.2f} ns per logit")
    layer_us, microbatch_us = framework_overheads(budget)
    say(f"  fixed costs (1 thread, tiny model): {layer_us:,.0f} us per layer forward, "
        f"{microbatch_us:,.0f} us per micro-batch")
    say("  gloo all-reduce between 2 local ranks (starting them takes a few seconds) ...")
    sizes = QUICK_ALLREDUCE_BYTES if quick else ALLREDUCE_BYTES
    world = 2
    timings = measure_allreduce(world, sizes, 0.05 if quick else 0.5)
    allreduce = [{"bytes": b, "seconds": s, "bus_gbps": 2 * (world - 1) / world * b / s / 1e9}
                 for b, s in timings]
    for row in allreduce:
        say(f"  all-reduce {row['bytes'] / 2**10:,.0f} KiB: {row['seconds'] * 1e6:,.0f} us, "
            f"bus {row['bus_gbps']:.2f} GB/s")
    result = {
        # The profile's inputs: per rank (one thread), as `tessera pretrain` ranks run.
        "gemm_tflops": layer_gemm_rate(gemms["fp32"]),
        "gemm_tflops_bf16": max(r["tflops"] for r in gemms["bf16"]),
        "allreduce_gbps": allreduce[-1]["bus_gbps"],
        "memory_gib": memory_gib(),
        "memory_gbps": memory_gbps,
        "attention_tflops": attention,
        # A small all-reduce is latency only: 2 (n - 1) ring steps, as the time model counts.
        "link_latency_us": allreduce[0]["seconds"] / (2 * (world - 1)) * 1e6,
        "loss_ns_per_logit": loss_ns,
        "layer_overhead_us": layer_us,
        "microbatch_overhead_us": microbatch_us,
        # For people, and for a planner that wants the detail.
        "isa": isa, "cpu": cpu_name(), "cores": cores, "threads_per_rank": 1,
        "clock": "process cpu time", "load_average": os.getloadavg()[0],
        "gemm": gemms, "allreduce": allreduce, "quick": quick,
        "torch": _torch_version(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                time.gmtime()),
    }
    from tessera.core.files import atomic_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        Path(tmp).write_text(json.dumps(result, indent=2) + "\n")
    say(f"  -> {path}: GEMM {result['gemm_tflops'] * 1e3:.1f} GFLOP/s fp32, "
        f"{result['gemm_tflops_bf16'] * 1e3:.1f} bf16 per rank; all-reduce "
        f"{result['allreduce_gbps']:.2f} GB/s; {result['memory_gib']:.1f} GiB ({isa})")
    return result


def _torch_version() -> str:
    import torch

    return torch.__version__
