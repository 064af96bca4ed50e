"""`tessera plan --calibrate --device cuda`: measure one GPU and write a planner hardware profile.

What is measured, each timed with CUDA events after warm-up (the wall clock on a CPU), each
within its share of a wall-clock budget (60 s by default; what runs out is reported skipped):

- GEMMs at training shapes: the forward, input-gradient and weight-gradient GEMMs of every
  linear layer of llama-1b and llama2-7b (qkv, o, gate+up, down, output layer) on `tokens`
  rows (8,192 = 4 x 2,048), in bf16. `gemm_efficiency` is the value at which the planner's
  `Hardware.gemm_fraction` shape rule reproduces their measured total time;
- causal attention (`scaled_dot_product_attention`, forward + backward) at sequence 2,048 and
  head dims 128 and 64, with each SDPA backend (flash, cudnn, efficient, math) that runs.
  Rates are in the planner's count (`estimate._kind_times`: 4 b s^2 a d forward over the whole
  score matrix, the backward twice that; a causal kernel does half of it), so that
  `attention_efficiency` is the fastest fused backend's rate over the peak;
- HBM bandwidth: a device copy of a 1 GiB tensor, bytes read + written over its time.

The profile keeps the datasheet of the card it recognises (`BASE_PROFILES`: peaks, links,
collective efficiencies, which one GPU cannot measure) and replaces `gemm_efficiency`,
`attention_efficiency`, `memory_gbps` and `memory_gib` with measured values; for a card it
does not recognise (and on a CPU) the peak is the fastest GEMM measured. A `measured` block
records every figure, the device, the versions and the date; `load_hardware` ignores it.

The code is device-generic so that tests run it on a CPU with `QUICK` sizes.
Script entry: `python -m tessera.plan.calibrate_gpu --out PATH.json [--budget-s 60]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.plan.hardware import PROFILES, Hardware


def default_gpu_profile_path() -> Path:
    """Where `tessera plan --calibrate --device cuda` writes unless told otherwise:
    `$TESSERA_CACHE/plan-gpu.json`, else `~/.cache/tessera/plan-gpu.json`."""
    root = os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera"
    return Path(root) / "plan-gpu.json"


@dataclass(frozen=True)
class Sizes:
    """What to measure: GEMMs of `models`' layers on `tokens` rows, attention at each of
    `attention` (batch, heads, seq, head_dim), a copy of `copy_bytes`, at most `max_runs`
    timed runs of each."""

    tokens: int
    models: tuple[str, ...]
    attention: tuple[tuple[int, int, int, int], ...]
    copy_bytes: int
    max_runs: int = 20


FULL = Sizes(tokens=8192, models=("llama-1b", "llama2-7b"),
             attention=((4, 16, 2048, 128), (4, 32, 2048, 64)), copy_bytes=2**30)
QUICK = Sizes(tokens=64, models=("llama-tiny",), attention=((1, 2, 64, 32), (1, 2, 64, 16)),
              copy_bytes=2**20, max_runs=5)

# Datasheet profiles by a substring of `torch.cuda.get_device_name()`. PCIe and NVL parts
# have other peaks and bandwidths than the SXM parts the built-in profiles describe.
BASE_PROFILES = (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-80gb"))
UNKNOWN_CARD_LINKS = "h100-80gb"  # links and collective efficiencies for an unrecognised card
SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")
FUSED_BACKENDS = ("flash", "cudnn", "efficient")


def base_profile(device_name: str, memory_gib: float) -> Hardware | None:
    """The built-in profile whose card `device_name` is, or None (CPUs, other cards)."""
    if "PCIe" in device_name or "NVL" in device_name:
        return None
    for key, profile in BASE_PROFILES:
        if key in device_name:
            if profile == "a100-80gb" and memory_gib < 60:
                profile = "a100-40gb"
            return PROFILES[profile]
    return None


def layer_gemm_shapes(model_name: str, tokens: int) -> list[tuple[str, int, int, int]]:
    """(label, m, n, k) of each linear layer of `model_name` on `tokens` rows, as the planner
    counts them (`estimate._kind_times`): qkv, o, the gated MLP's gate+up as one GEMM, down,
    and the output layer."""
    from tessera.core.config import ModelConfig

    cfg = ModelConfig.from_name(model_name)
    h, hd = cfg.hidden_size, cfg.head_dim
    a, kv, f = cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden_size
    up = 2 if cfg.gated else 1
    return [("qkv", tokens, (a + 2 * kv) * hd, h), ("o", tokens, h, a * hd),
            ("gate+up" if up == 2 else "up", tokens, up * f, h), ("down", tokens, h, f),
            ("lm head", tokens, cfg.vocab_size, h)]


class Budget:
    """A wall-clock allowance shared by the measurements: each gets an equal share of what
    is left among those still to run."""

    def __init__(self, seconds: float, items: int) -> None:
        self.deadline = time.perf_counter() + seconds
        self.items = max(1, items)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def share(self) -> float:
        """Seconds for the next measurement (0 when the budget is spent)."""
        share = max(0.0, self.left()) / self.items
        self.items = max(1, self.items - 1)
        return share


class Clock:
    """Times calls on one device: CUDA events on a GPU (the kernels' own time, host
    launches overlapped as in a training loop), the wall clock elsewhere."""

    def __init__(self, device: str) -> None:
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)

    def median(self, fn: Callable[[], object], seconds: float, max_runs: int) -> float | None:
        """Median seconds of one call of `fn`: one warm-up call (timed on the wall clock, to
        size the runs), then as many timed calls as fit in `seconds` (at least 2, at most
        `max_runs`). None when the budget is spent before the warm-up, or the warm-up alone
        overran it."""
        if seconds <= 0:
            return None
        self.sync()
        tic = time.perf_counter()
        fn()
        fn()  # two warm-ups: first-call set-up (handles, autotuning, allocations)
        self.sync()
        warm = (time.perf_counter() - tic) / 2
        if 2 * warm >= seconds:
            return None
        runs = int(max(2, min(max_runs, (seconds - 2 * warm) / max(warm, 1e-9))))
        if not self.cuda:
            times = []
            for _ in range(runs):
                tic = time.perf_counter()
                fn()
                times.append(time.perf_counter() - tic)
            return statistics.median(times)
        import torch

        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(runs)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        self.sync()
        return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def gemm_seconds(clock: Clock, m: int, n: int, k: int, seconds: float, max_runs: int
                 ) -> float | None:
    """Seconds of one linear layer's three training GEMMs in bf16 (forward X W^T, input
    gradient dY W, weight gradient dY^T X, for X m x k and W n x k as `nn.Linear` holds it),
    the sum of their medians; None when the budget runs out."""
    import torch

    dt, dev = torch.bfloat16, clock.device
    x, w = torch.randn(m, k, dtype=dt, device=dev), torch.randn(n, k, dtype=dt, device=dev)
    dy = torch.randn(m, n, dtype=dt, device=dev)
    total = 0.0
    for op in (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x):
        t = clock.median(op, seconds / 3, max_runs)
        if t is None:
            return None
        total += t
    return total


def attention_seconds(clock: Clock, backend: str, shape: tuple[int, int, int, int],
                      seconds: float, max_runs: int) -> float | None | str:
    """Seconds of a causal SDPA forward + backward in bf16 at (batch, heads, seq, head_dim)
    with only `backend` allowed; None when the budget runs out, the error text when the
    backend cannot run this shape here."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]
    q, k, v = (torch.randn(*shape, dtype=torch.bfloat16, device=clock.device,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(*shape, dtype=torch.bfloat16, device=clock.device)

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    # A backend that cannot run warns its reasons before it raises: the raise is reported.
    with sdpa_kernel([kernel]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return clock.median(run, seconds, max_runs)
        except RuntimeError as exc:  # "No available kernel" and the like
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "failed"
            return first.split(". ")[0][:120]


def attention_flops(shape: tuple[int, int, int, int]) -> float:
    """The planner's FLOPs of attention forward + backward: 3 x 4 b s^2 a d."""
    b, a, s, d = shape
    return 3 * 4 * b * s * s * a * d


def copy_seconds(clock: Clock, nbytes: int, seconds: float, max_runs: int) -> float | None:
    """Seconds of one device copy of `nbytes`."""
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=clock.device)
    dst = torch.empty_like(src)
    return clock.median(lambda: dst.copy_(src), seconds, max_runs)


def _versions(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "cudnn": torch.backends.cudnn.version() if device == "cuda" else None}
    return info


def device_description(device: str) -> tuple[str, float]:
    """(name, memory GiB) of `device`: the CUDA card's, or this CPU's."""
    import torch

    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        return props.name, props.total_memory / 2**30
    from tessera.plan.calibrate import cpu_name, memory_gib

    return cpu_name(), memory_gib()


def calibrate_device(out: Path, device: str = "cuda", budget_s: float = 60.0,
                     sizes: Sizes = FULL, say: Callable[[str], None] | None = None
                     ) -> dict[str, Any]:
    """Measure `device` (see the module doc), write the profile JSON to `out` and return it.
    `say` gets one line per measurement as it is taken (default: printed, flushed)."""
    import torch

    say = say or (lambda line: print(line, flush=True))
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        from tessera.plan.errors import PlanError

        raise PlanError("--device cuda: torch sees no CUDA device here (torch "
                        f"{torch.__version__}, built for CUDA {torch.version.cuda}); run it on "
                        "the GPU machine, or calibrate this CPU with --device cpu")
    started = time.perf_counter()
    name, mem_gib = device_description(device)
    base = base_profile(name, mem_gib)
    clock = Clock(device)
    shapes = [(model, *shape) for model in sizes.models
              for shape in layer_gemm_shapes(model, sizes.tokens)]
    budget = Budget(budget_s, len(shapes) + len(sizes.attention) * len(SDPA_BACKENDS) + 1)
    peak_bf16 = base.peak("bf16") if base else None
    say(f"calibrating {name} ({mem_gib:.1f} GiB) for a planner profile; datasheet "
        f"{'of ' + base.name if base else 'unknown: the peak will be the fastest GEMM measured'}"
        f"; budget {budget_s:g} s")

    gemms: list[dict[str, Any]] = []
    for model, label, m, n, k in shapes:
        t = gemm_seconds(clock, m, n, k, budget.share(), sizes.max_runs)
        row = {"model": model, "layer": label, "m": m, "n": n, "k": k, "seconds": t,
               "tflops": 3 * 2 * m * n * k / t / 1e12 if t else None}
        gemms.append(row)
        rate = f"{row['tflops']:.4g} TFLOP/s" if t else "skipped (budget spent)"
        of_peak = f" ({row['tflops'] / peak_bf16:.1%} of {peak_bf16:g})" if t and peak_bf16 else ""
        say(f"  GEMM bf16 {model} {label}: {m} x {k} -> {n}, forward + both gradients: "
            f"{rate}{of_peak}")
    done = [g for g in gemms if g["seconds"]]
    peak = peak_bf16 or max((g["tflops"] for g in done), default=None)

    attention: list[dict[str, Any]] = []
    for shape in sizes.attention:
        for backend in SDPA_BACKENDS:
            t = attention_seconds(clock, backend, shape, budget.share(), sizes.max_runs)
            row = {"shape": list(shape), "backend": backend,
                   "seconds": t if isinstance(t, float) else None,
                   "tflops": attention_flops(shape) / t / 1e12 if isinstance(t, float) else None,
                   "error": t if isinstance(t, str) else None}
            attention.append(row)
            b, a, s, d = shape
            of_peak = f", {row['tflops'] / peak:.1%} of {peak:.4g}" if row["tflops"] and peak else ""
            what = (f"{row['tflops']:.4g} TFLOP/s (planner's count, the causal kernel doing half"
                    f"{of_peak})" if row["tflops"] else
                    f"unavailable ({t})" if isinstance(t, str) else "skipped (budget spent)")
            say(f"  attention causal b{b} h{a} s{s} d{d}, forward + backward, {backend}: {what}")

    t = copy_seconds(clock, sizes.copy_bytes, budget.share(), sizes.max_runs)
    memory_gbps = 2 * sizes.copy_bytes / t / 1e9 if t else None
    say(f"  memory copy {sizes.copy_bytes / 2**20:,.0f} MiB: "
        + (f"{memory_gbps:,.4g} GB/s (read + write)" if t else "skipped (budget spent)"))

    profile, chosen = _profile(name, mem_gib, base, peak, done, attention, memory_gbps)
    elapsed = time.perf_counter() - started
    measured = {"device": name, "device_kind": torch.device(device).type,
                **_versions(torch.device(device).type),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "datasheet": base.name if base else None, "budget_s": budget_s,
                "seconds": round(elapsed, 2), "tokens": sizes.tokens,
                "gemm_tflops": _flop_weighted(done), "gemm": gemms,
                "attention": attention, "attention_backends": chosen,
                "memory_copy_gbps": memory_gbps,
                "kept_from_datasheet": sorted(_kept(base, done, chosen, memory_gbps))}
    result = {**profile.to_dict(), "measured": measured}
    from tessera.core.files import atomic_file

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:
        Path(tmp).write_text(json.dumps(result, indent=2) + "\n")
    say(f"  -> {out} ({elapsed:.1f} s): GEMM efficiency {profile.gemm_efficiency:.3f} of "
        f"{profile.peak('bf16'):g} TFLOP/s bf16, attention efficiency "
        f"{profile.attention_efficiency:.3f}, HBM {profile.memory_gbps:,.4g} GB/s, "
        f"{profile.memory_gib:.1f} GiB; plan with `tessera plan --gpu {out} ...`")
    return result


def _flop_weighted(rows: list[dict[str, Any]]) -> float | None:
    """All the rows' FLOPs over all their time, in TFLOP/s (each shape counts by its work)."""
    if not rows:
        return None
    return sum(3 * 2 * r["m"] * r["n"] * r["k"] for r in rows) / sum(
        r["seconds"] for r in rows) / 1e12


def gemm_efficiency(rows: list[dict[str, Any]], peak_tflops: float, half_size: int) -> float:
    """The `Hardware.gemm_efficiency` at which the planner's time for these GEMMs (3 x 2 m n k
    FLOPs each at `peak * efficiency * d / (d + half_size)`, d the smallest side) equals their
    measured total time."""
    at_full = sum(3 * 2 * r["m"] * r["n"] * r["k"]
                  / (peak_tflops * 1e12 * _shape_factor(r, half_size)) for r in rows)
    return at_full / sum(r["seconds"] for r in rows)


def _shape_factor(row: dict[str, Any], half_size: int) -> float:
    d = max(1.0, float(min(row["m"], row["n"], row["k"])))
    return d / (d + half_size)


def _profile(name: str, mem_gib: float, base: Hardware | None, peak: float | None,
             gemms: list[dict[str, Any]], attention: list[dict[str, Any]],
             memory_gbps: float | None) -> tuple[Hardware, dict[str, str]]:
    """The profile from the measurements over `base` (or the unknown-card defaults), and the
    fastest fused backend per attention shape."""
    if base is None and peak is None:
        from tessera.plan.errors import PlanError

        raise PlanError(f"no GEMM finished within the budget on {name}, and its peak is not in "
                        "the datasheet table: give the calibration more time (--budget-s)")
    # An unrecognised card's peak is its fastest GEMM measured: an achieved rate, so no
    # shape penalty on top (as for the cpu profile).
    template = base or dataclasses.replace(PROFILES[UNKNOWN_CARD_LINKS],
                                           peak_tflops={"bf16": peak}, gemm_half_size=0)
    changes: dict[str, Any] = {"memory_gib": round(mem_gib, 2)}
    if gemms:
        changes["gemm_efficiency"] = _figure(
            gemm_efficiency(gemms, template.peak("bf16"), template.gemm_half_size))
    chosen: dict[str, str] = {}
    flops = seconds = 0.0
    for shape in {tuple(r["shape"]) for r in attention}:
        ran = [r for r in attention if tuple(r["shape"]) == shape and r["seconds"]
               and r["backend"] in FUSED_BACKENDS]
        if ran:
            best = min(ran, key=lambda r: r["seconds"])
            chosen["x".join(map(str, shape))] = best["backend"]
            flops += attention_flops(shape)
            seconds += best["seconds"]
    if seconds:
        changes["attention_efficiency"] = _figure(flops / seconds / 1e12 / template.peak("bf16"))
    if memory_gbps:
        changes["memory_gbps"] = _figure(memory_gbps)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    changes["name"] = f"{base.name}-measured" if base else _slug(name)
    changes["notes"] = (f"measured on {name} by tessera plan --calibrate, {date}; peaks, links "
                        f"and collective efficiencies from the "
                        f"{base.name if base else UNKNOWN_CARD_LINKS} "
                        f"{'datasheet' if base else 'profile (this card is not in the table)'}")
    return dataclasses.replace(template, **changes), chosen


def _kept(base: Hardware | None, gemms: list, chosen: dict, memory_gbps: float | None
          ) -> set[str]:
    """Profile fields not measured here: taken from the datasheet (or unknown-card) profile."""
    kept = {"intra_node_gbps", "inter_node_gbps", "comm_efficiency", "p2p_efficiency",
            "unfused_attention_efficiency", "gemm_half_size", "framework_overhead_gib",
            "link_latency_us"}
    if base:
        kept.add("peak_tflops")
    kept |= {f for f, got in (("gemm_efficiency", gemms), ("attention_efficiency", chosen),
                              ("memory_gbps", memory_gbps)) if not got}
    return kept


def _figure(x: float) -> float:
    """`x` to 4 significant figures (never rounded to 0, which a profile refuses)."""
    return float(f"{x:.4g}")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "device"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tessera.plan.calibrate_gpu",
                                description="Measure this GPU's GEMM and attention rates and HBM "
                                "bandwidth at training shapes; write a profile that `tessera "
                                "plan --gpu PATH.json` reads.")
    p.add_argument("--out", type=Path, default=None,
                   help=f"profile to write (default: {default_gpu_profile_path()})")
    p.add_argument("--device", default="cuda", help="torch device to measure (default: cuda)")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="wall-clock seconds for all the measurements (default: 60)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (seconds, on a CPU too): to check the script, not to plan")
    args = p.parse_args(argv)
    from tessera.plan.errors import PlanError

    try:
        calibrate_device(args.out or default_gpu_profile_path(), args.device, args.budget_s,
                         QUICK if args.quick else FULL)
    except PlanError as exc:
        print(f"calibrate_gpu: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
