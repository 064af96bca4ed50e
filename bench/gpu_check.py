"""One command for a GPU session: every figure the GPU issues ask for, in stages with their own
time budgets, streamed as measured, and one Markdown + JSON report.

    python bench/gpu_check.py                       # CUDA, <= 7 minutes (make gpu-check)
    python bench/gpu_check.py --budget-s 300        # scale every stage's budget to fit 300 s
    python bench/gpu_check.py --device cpu --tiny   # the same stages on a CPU in about a minute
    python bench/gpu_check.py --stages env train    # some stages only

Stages run in order, each a child process under its own time limit: `env` (card, driver,
torch/CUDA/cuDNN versions, optional kernels), `tests` (`pytest tests/gpu`), `calibrate` (GEMM,
attention and HBM rates: the planner's profile), `train` (bench_train.py), `loss`
(bench_cross_entropy.py), `decode` (bench_generate.py: engine-only, eager and with the
compiled static-shape decode step), `serve` (serve_check.py: continuous batching through
`tessera serve --compile` at 1/16/64 concurrent requests), `fp8` and `fp8-train`
(bench_fp8.py), `smoke` (`tessera pretrain` then `tessera serve`).
A child prints `ROW <bench> {json}` for each measured row; those rows make the report, so a
stage that runs out of time still reports what it measured, and the stages after it still run.
The report goes to `--out` (default bench/results/): `gpu_check-<card>.md` and `.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import markdown_table  # noqa: E402


@dataclass
class Stage:
    """One stage: a command (argv after the Python interpreter) and its time budget."""

    name: str
    argv: list[str]
    budget_s: float
    purpose: str
    status: str = "not run"
    seconds: float = 0.0
    rows: list[dict] = field(default_factory=list)
    log_tail: list[str] = field(default_factory=list)


def stages(args) -> list[Stage]:
    """The stages for `args.device`; `--tiny`: the seconds-sized CPU versions."""
    py = [str(HERE / "bench_train.py")]
    cuda = args.device.startswith("cuda")
    out = args.out
    profile = str(Path(out) / "gpu-profile.json")  # calibrate writes it, train predicts with it
    if cuda and not args.tiny:
        train = py + ["--device", args.device, "--preset", "llama-1b", "--seq", "2048",
                      "--batch", "4", "--steps", "5", "--warmup", "2",
                      "--profile-out", str(Path(out) / "train-profile.txt"),
                      "--plan-gpu-measured", profile]
        calibrate = ["-m", "tessera.plan.calibrate_gpu", "--device", args.device,
                     "--out", profile]
        decode = [str(HERE / "bench_generate.py"), "--device", args.device, "--preset",
                  "llama-1b", "--prompt", "128", "--new", "128", "--concurrency", "1", "16"]
        serve = [str(HERE / "serve_check.py"), "--device", args.device, "--preset", "llama-1b"]
        loss = [str(HERE / "bench_cross_entropy.py"), "--device", args.device]
        fp8 = [str(HERE / "bench_fp8.py"), "--device", args.device]
        fp8_train = [str(HERE / "bench_fp8.py"), "--device", args.device, "--train"]
        smoke = [str(HERE / "gpu_smoke.py"), "--device", args.device, "--steps", "30"]
    else:
        train = py + ["--device", args.device, "--tiny", "--no-compile"]
        calibrate = ["-m", "tessera.plan.calibrate_gpu", "--device", args.device, "--quick",
                     "--out", profile]
        decode = [str(HERE / "bench_generate.py"), "--device", args.device, "--hidden", "64",
                  "--layers", "2", "--vocab", "256", "--prompt", "8", "--new", "8",
                  "--concurrency", "2", "--no-int8", "--no-hf-compile", "--compile-backend",
                  "eager"]
        serve = [str(HERE / "serve_check.py"), "--device", args.device, "--tiny",
                 "--concurrency", "2", "--no-compile"]
        loss = [str(HERE / "bench_cross_entropy.py"), "--device", args.device, "--tiny",
                "--vocabs", "2000", "--tokens", "256"]
        fp8 = [str(HERE / "bench_fp8.py"), "--device", args.device, "--tiny"]
        fp8_train = [str(HERE / "bench_fp8.py"), "--device", args.device, "--tiny", "--train"]
        smoke = [str(HERE / "gpu_smoke.py"), "--device", args.device, "--steps", "3"]
    tests = ["-m", "pytest", "-q", "-rfE", "--tb=line", "-p", "no:cacheprovider",
             str(ROOT / "tests" / "gpu")]
    # Seconds on one H100 with cold compile caches; the sum is the 7-minute default.
    plan = [
        Stage("env", [str(HERE / "gpu_check.py"), "--print-env", "--device", args.device], 15,
              "card, driver, versions, optional kernel libraries"),
        Stage("tests", tests, 45, "pytest tests/gpu"),
        Stage("calibrate", calibrate, 40, "GEMM / attention / HBM rates for tessera plan"),
        Stage("train", train, 110, "llama-1b 4x2048 training step vs HF"),
        Stage("loss", loss, 25, "full vs chunked linear cross-entropy, V 32k and 128k"),
        Stage("decode", decode, 90, "llama-1b decode vs HF, eager and static-shape compiled"),
        Stage("serve", serve, 60, "tessera serve --compile at 1/16/64 concurrent"),
        Stage("fp8", fp8, 45, "FP8 GEMM vs bf16"),
        Stage("fp8-train", fp8_train, 45, "FP8 training step vs bf16"),
        Stage("smoke", smoke, 35, "tessera pretrain + tessera serve"),
    ]
    plan = [s for s in plan if not args.stages or s.name in args.stages]
    total = sum(s.budget_s for s in plan)
    scale = (args.budget_s / total) if args.budget_s else 1.0
    for s in plan:
        s.budget_s = round(args.stage_budget.get(s.name, s.budget_s * scale), 1)
        if s.name in ("train", "loss", "decode", "serve", "fp8", "fp8-train", "calibrate"):
            # The bench stops starting new rows a little before the hard limit.
            s.argv += ["--budget-s", str(max(s.budget_s - 15, s.budget_s * 0.7))]
    return plan


def run_stage(stage: Stage, log) -> None:
    """Run `stage`, echoing and logging every line as it comes; kill its process group at the
    budget. Rows are the `ROW name {json}` lines it printed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tic = time.monotonic()
    proc = subprocess.Popen([sys.executable, *stage.argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True, bufsize=1)
    tail: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            print(f"[{stage.name} {time.monotonic() - tic:6.1f}s] {line}", flush=True)
            log.write(f"[{stage.name}] {line}\n")
            log.flush()
            tail.append(line)
            del tail[:-40]
            if line.startswith("ROW "):
                try:
                    bench, payload = line[4:].split(" ", 1)
                    stage.rows.append({"bench": bench, **json.loads(payload)})
                except ValueError:
                    pass

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=stage.budget_s)
        stage.status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        stage.status = f"out of time at {stage.budget_s:.0f} s"
    reader.join(timeout=5)
    stage.seconds = time.monotonic() - tic
    stage.log_tail = tail[-30:]


def profile_rows(path: Path) -> list[dict]:
    """The calibration's measurements (`plan.calibrate_gpu`'s profile) as report rows."""
    if not path.is_file():
        return []
    profile = json.loads(path.read_text())
    measured = profile.get("measured", {})
    rows = [{"bench": "calibrate", "what": f"GEMM {g['model']} {g['layer']}",
             "shape": f"{g['m']}x{g['n']}x{g['k']}", "TFLOP/s": g["tflops"]}
            for g in measured.get("gemm", [])]
    rows += [{"bench": "calibrate", "what": f"attention {a['backend']}",
              "shape": "x".join(map(str, a["shape"])), "TFLOP/s": a["tflops"],
              "error": (a.get("error") or "")[:80]} for a in measured.get("attention", [])]
    rows.append({"bench": "calibrate", "what": "profile",
                 "shape": f"{measured.get('memory_copy_gbps', 0):.0f} GB/s copy",
                 "TFLOP/s": profile.get("peak_tflops"),
                 "error": f"gemm_efficiency {profile.get('gemm_efficiency')}, "
                          f"attention_efficiency {profile.get('attention_efficiency')}"})
    return rows


def environment(device: str) -> dict:
    """What ran: the card, driver, versions and which optional kernel libraries import."""
    import torch

    env = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "host": platform.node(), "python": platform.python_version(),
           "torch": torch.__version__, "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(card=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                   sm=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,power.limit,"
                                  "clocks.max.sm", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            env["driver, power limit, max SM clock"] = smi
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "nvidia-smi not found"
    else:
        from tessera.core.cpu_isa import cpu_isa

        env.update(card=f"CPU ({cpu_isa()}, {os.cpu_count()} cores)")
    for name in ("transformers", "triton", "torchao", "liger_kernel", "transformer_engine",
                 "fastapi"):
        try:
            module = __import__(name)
            env[name] = getattr(module, "__version__", "installed")
        except Exception as exc:  # an optional library that does not import is reported
            env[name] = f"not available ({type(exc).__name__})"
    return env


def targets(done: list[Stage]) -> list[dict]:
    """The issues' targets against the rows measured (those that were)."""
    by = {s.name: s.rows for s in done}
    out: list[dict] = []

    def add(metric: str, value, target: str, ok: bool | None) -> None:
        out.append({"metric": metric, "measured": "-" if value is None else value,
                    "target": target, "met": "-" if ok is None else "yes" if ok else "no"})

    train = {(r.get("side"), r.get("case")): r for r in by.get("train", [])}
    head = train.get(("tessera", "bf16 (fp32 master), --compile"), {})
    hf = train.get(("hf", "bf16 (fp32 master), eager"), {})
    if head.get("step ms"):
        add("train step ms (llama-1b 4x2048 bf16)", round(head["step ms"], 1), "<= 120 (goal 95)",
            head["step ms"] <= 120)
        mfu = head.get("MFU (datasheet)")
        add("train MFU of datasheet peak", None if mfu is None else round(mfu, 3),
            ">= 0.40 (goal 0.50)", None if mfu is None else mfu >= 0.40)
        add("train compile s (cold)", round(head.get("compile s", 0), 1), "<= 40",
            head.get("compile s", 0) <= 40)
        if hf.get("tok/s"):
            ratio = head["tok/s"] / hf["tok/s"]
            add("train tok/s vs HF eager", round(ratio, 2), ">= 1.3", ratio >= 1.3)
        used = head.get("device used GiB") or head.get("peak memory GiB")
        if head.get("plan memory GiB") and used:
            err = used / head["plan memory GiB"] - 1
            what = "device memory used" if head.get("device used GiB") else "peak allocated"
            add(f"{what} vs tessera plan", f"{used:.1f} vs {head['plan memory GiB']:.1f} GiB "
                f"({err:+.0%})", "within 15%", abs(err) <= 0.15)
    decode = {r.get("case"): r for r in by.get("decode", [])}
    # The compiled (static-shape) decode step's rows where it ran, else the eager engine's.
    compiled = "single stream, compiled decode" in decode
    single = decode.get("single stream, compiled decode" if compiled else "single stream", {})
    if single.get("fraction of bandwidth bound") is not None:
        frac = single["fraction of bandwidth bound"]
        add("decode batch 1, fraction of HBM bound", round(frac, 3), ">= 0.50 (floor 0.30)",
            frac >= 0.30)
    batch16 = decode.get("16 concurrent, compiled decode" if compiled
                         else "16 concurrent (HF: static batch 16)", {})
    if batch16.get("tessera tok/s"):
        add("decode 16 concurrent, tok/s", round(batch16["tessera tok/s"]), ">= 8000",
            batch16["tessera tok/s"] >= 8000)
    seen = decode.get("single stream, compiled decode, same request again (lengths seen)"
                      if compiled else "single stream, same request again (lengths seen)", {})
    if single.get("tessera tok/s") and seen.get("tessera tok/s"):
        ratio = seen["tessera tok/s"] / single["tessera tok/s"]
        add("decode new-length / seen-length step time", round(ratio, 2), "<= 1.1", ratio <= 1.1)
    for r in by.get("serve", []):
        if r.get("output tok/s"):
            add(f"serve {r['case'].split(' through')[0]}: output tok/s, TTFT / ITL p50 / ITL "
                "p99 ms", f"{r['output tok/s']:.0f}, {r['TTFT p50 ms']:.0f} / "
                f"{r['ITL p50 ms']:.1f} / {r['ITL p99 ms']:.1f}", "reported", None)
    gemm = [r for r in by.get("fp8", []) if r.get("M") == 8192 and "gemm x bf16" in r]
    if gemm:
        worst = min(gemm, key=lambda r: r["gemm x bf16"])
        add("FP8 GEMM only x bf16, worst layer at M 8192", round(worst["gemm x bf16"], 2),
            ">= 1.4", worst["gemm x bf16"] >= 1.4)
        for layer, floor in (("gate/up", 1.2), ("down", 0.95)):
            at = [r["fp8 speedup"] for r in gemm if r.get("layer") == layer]
            if at:
                add(f"FP8 fused quantize+GEMM x bf16, {layer}", round(min(at), 2),
                    f">= {floor}", min(at) >= floor)
    for r in by.get("fp8-train", []):
        if r.get("fp8 step speedup"):
            add("FP8 training step x bf16", round(r["fp8 step speedup"], 2), ">= 1.15",
                r["fp8 step speedup"] >= 1.15)
            add("FP8 loss vs bf16 (max relative diff)", round(r["max loss relative diff"], 4),
                "<= 0.01", r["max loss relative diff"] <= 0.01)
    return out


def report(env: dict, done: list[Stage], out: Path, wall: float) -> Path:
    card = "cpu" if str(env.get("device")) == "cpu" else str(env.get("card", "gpu"))
    card = "".join(c if c.isalnum() or c in "-_." else "-" for c in card)
    stem = out / f"gpu_check-{card}"
    lines = [f"# Tessera GPU check — {env['date']} — {env.get('card')}", "",
             markdown_table([{"": k, "value": v} for k, v in env.items()]), "",
             f"Wall time {wall:.0f} s.", "", "## Stages", "",
             markdown_table([{"stage": s.name, "what": s.purpose, "status": s.status,
                              "seconds": round(s.seconds, 1), "budget s": s.budget_s,
                              "rows": len(s.rows)} for s in done]), "",
             "## Targets", "", markdown_table(targets(done)), ""]
    for s in done:
        lines += [f"## {s.name}", ""]
        if s.rows:
            lines += [markdown_table(s.rows), ""]
        if s.status != "ok" or not s.rows:
            lines += ["```", *s.log_tail, "```", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    stem.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "wall_s": wall, "targets": targets(done),
         "stages": [asdict(s) for s in done]}, indent=2, default=str) + "\n")
    return stem.with_suffix(".md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="seconds-sized models (CPU check)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="scale the chosen stages' budgets to sum to this (default: 420 s "
                             "for all stages)")
    parser.add_argument("--stage-budget", nargs="+", default=[], metavar="STAGE=SECONDS",
                        help="one stage's budget, e.g. train=200 (after --budget-s scaling)")
    parser.add_argument("--stages", nargs="+", default=None,
                        choices=["env", "tests", "calibrate", "train", "loss", "decode", "serve",
                                 "fp8", "fp8-train", "smoke"])
    parser.add_argument("--out", default=str(HERE / "results"), help="report folder")
    parser.add_argument("--print-env", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.stage_budget = {k: float(v) for k, v in
                             (item.split("=", 1) for item in args.stage_budget)}
    except ValueError:
        parser.error(f"--stage-budget takes STAGE=SECONDS, got {args.stage_budget}")
    if args.print_env:  # the env stage's child: one row
        print("ROW env " + json.dumps(environment(args.device), default=str), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = stages(args)
    tic = time.monotonic()
    with (out / "gpu_check.log").open("w") as log:
        for stage in plan:
            print(f"== {stage.name}: {stage.purpose} (budget {stage.budget_s:.0f} s)", flush=True)
            run_stage(stage, log)
            if stage.name == "calibrate":
                stage.rows += profile_rows(out / "gpu-profile.json")
            print(f"== {stage.name}: {stage.status} in {stage.seconds:.1f} s, "
                  f"{len(stage.rows)} rows", flush=True)
    env_rows = next((s.rows for s in plan if s.name == "env"), [])
    env = ({k: v for k, v in env_rows[0].items() if k != "bench"} if env_rows
           else environment(args.device))
    path = report(env, plan, out, time.monotonic() - tic)
    print(path.read_text(), flush=True)
    print(f"report: {path} (and .json)", flush=True)
    return 0 if all(s.status == "ok" for s in plan) else 1


if __name__ == "__main__":
    sys.exit(main())
