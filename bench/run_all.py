"""Run the whole benchmark suite and print one table of the targets (each part can run alone).

    python bench/run_all.py            # CPU: training, parallel overhead, generation, serving,
                                       # conversion, tuning, FP8
    python bench/run_all.py --gpu      # one CUDA GPU: a ~1B Llama at sequence 2048 in bf16
    python bench/run_all.py --only train generate

Each part writes `bench/results/<part>.json` and `.md`; this script also writes
`bench/results/summary.md` (the table docs/benchmarks.md shows) with the date and the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, machine, markdown_table  # noqa: E402

HERE = Path(__file__).parent
CPU_PARTS = {
    "train": ["bench_train.py"],
    # 1B-model width (Llama 3.2 1B has hidden 2048): where matmuls, not elementwise passes,
    # decide the fraction of peak. Two layers keep it a few minutes.
    "train-wide": ["bench_train.py", "--hidden", "2048", "--layers", "2", "--steps", "2",
                   "--no-compile", "--name", "train-wide"],
    "parallel": ["bench_parallel.py"],
    "cp": ["bench_cp.py"],  # about 2 minutes: one 4096-token sequence on 1, 2 and 4 ranks
    "generate": ["bench_generate.py"],
    # bf16 on both sides: this CPU's bf16 GEMM costs the same for 16 rows as for 1, its fp32
    # GEMM 4x more, so batched decoding is a bf16 job.
    "generate-bf16": ["bench_generate.py", "--dtype", "bf16", "--no-int8"],
    "serve_load": ["serve_load.py", "--self-test", "--compare-hf"],
    "serve_load-compiled": ["serve_load.py", "--self-test", "--compare-hf",
                            "--serve-arg=--compile", "--name", "serve_load-compiled"],
    # paged + prefix cache vs wave 1's slots, and chunked prefill: tables in docs/benchmarks.md's
    # serving section (bench/results/serving_paged.md, serving_chunked_prefill.md)
    "serving_paged": ["bench_serving_paged.py", "--num-requests", "32", "--rate", "2", "inf"],
    "convert": ["bench_convert.py"],
    "async_save": ["bench_async_save.py"],
    "tune": ["bench_tune.py"],
    "lora": ["bench_lora.py"],
    "fp8": ["bench_fp8.py", "--device", "cpu"],
}
GPU_PARTS = {
    "train-cuda": ["bench_train.py", "--device", "cuda", "--preset", "llama-1b", "--seq", "2048",
                   "--batch", "4"],
    "generate-cuda": ["bench_generate.py", "--device", "cuda", "--preset", "llama-1b",
                      "--prompt", "128", "--new", "128"],
    "fp8": ["bench_fp8.py", "--device", "cuda"],
}


def _rows(part: str) -> list[dict]:
    path = RESULTS / f"{part}.json"
    return json.loads(path.read_text())["rows"] if path.is_file() else []


def _find(rows: list[dict], key: str, value: str) -> dict:
    return next((r for r in rows if str(r.get(key, "")).startswith(value)), {})


def summary(gpu: bool) -> list[dict]:
    """The targets of the performance issue against what the parts measured."""
    out: list[dict] = []

    def add(metric: str, measured, target: str, ok: bool | None) -> None:
        out.append({"metric": metric, "measured": measured if measured is not None else "-",
                    "target": target, "met": "-" if ok is None else ("yes" if ok else "no")})

    if gpu:
        for r in _rows("train-cuda"):
            frac = r.get("tessera TFLOP/s", 0) / 989.0  # H100/H200 dense bf16 peak
            add(f"training MFU ({r['precision']}, of 989 TFLOP/s)", round(frac, 3), ">= 0.50",
                frac >= 0.5)
        single = _find(_rows("generate-cuda"), "case", "single stream")
        frac = single.get("fraction of bandwidth bound")
        add("decode batch 1, fraction of HBM bound", frac, ">= 0.60",
            None if frac is None else frac >= 0.6)
        for r in _rows("fp8"):
            add(f"FP8 {r['layer']} {r['scales']} speedup (error {r['fp8 relative error']:.3f})",
                r["fp8 speedup"], "report", None)
        return out
    train = _rows("train") + _rows("train-wide")
    for r in train:
        add(f"training tok/s vs HF ({r['precision']}; {r.get('model', '')})",
            r["ratio (target >= 1.15)"], ">= 1.15", r["ratio (target >= 1.15)"] >= 1.15)
    for r in train:
        if r["precision"].startswith("bf16"):
            add(f"training FLOP/s / bf16 matmul peak ({r['precision']}; {r.get('model', '')})",
                r["fraction of peak"], ">= 0.70", r["fraction of peak"] >= 0.7)
    for part, dtype in (("generate", "fp32"), ("generate-bf16", "bf16")):
        gen = _rows(part)
        for label in ("", ", compiled decode"):
            # Exact: every single-stream row starts with "single stream".
            single = next((r for r in gen if r["case"] == f"single stream{label}"), {})
            sixteen = _find(gen, "case", f"16 concurrent{label} (")
            mode = f"{dtype} both{label}"
            if single:
                add(f"decode tok/s vs HF, single stream ({mode})", single["ratio"], ">= 2",
                    single["ratio"] >= 2)
            if sixteen:
                add(f"16 concurrent vs HF single stream ({mode})",
                    sixteen["vs HF single stream"], ">= 5", sixteen["vs HF single stream"] >= 5)
        both = _find(gen, "case", "single stream, both compiled")
        if both:
            add(f"decode tok/s vs HF, single stream, both compiled ({dtype}; HF static cache)",
                both["ratio"], "report", None)
        int8 = _find(gen, "case", "single stream, Tessera int8")
        if int8:
            add(f"decode tok/s vs HF {dtype}, single stream, Tessera int8 weights (logit error "
                f"{int8['int8 logit error']:.3f})", int8["ratio"], ">= 2", int8["ratio"] >= 2)
    for part, label in (("serve_load", ""), ("serve_load-compiled", ", --compile")):
        rows = _rows(part)
        hf = _find(rows, "run", "HF generate").get("output tok/s")
        for r in rows:
            if r["run"].startswith("tessera") and r.get("completed"):
                # Below the server's capacity tok/s follows the offered rate: latency is the point.
                add(f"serving{label}, {r['run'].split(', ')[1]}: output tok/s (HF sequential "
                    f"{hf or float('nan'):.0f}; TTFT p50/p99 {r['TTFT p50 ms']:.0f}/"
                    f"{r['TTFT p99 ms']:.0f} ms, ITL p50/p99 {r['ITL p50 ms']:.1f}/"
                    f"{r['ITL p99 ms']:.1f} ms)", round(r["output tok/s"]), "report", None)
    for r in _rows("convert")[2:]:
        rss = float(str(r["peak RSS / checkpoint"]).split("%")[0]) / 100
        add(f"convert {r['conversion']}: peak RSS / size", round(rss, 3), "< 0.25", rss < 0.25)
        add(f"convert {r['conversion']}: speed vs copy", r["vs copy (target >= 0.5)"], ">= 0.5",
            r["vs copy (target >= 0.5)"] >= 0.5)
    for r in _rows("tune"):
        add(f"{r['method']} step speed vs peft", r["speed ratio"], "report", None)
    for r in _rows("cp")[1:]:
        add(f"cp {r['cp']} {r['cp_comm']}: activations per rank / ideal 1/cp (seq {r['seq']})",
            round(r["x ideal (mem)"], 2), "report", None)
    for r in _rows("cp_dynamic"):
        add(f"dynamic vs fixed cp {r['cp']} ({r['doc lengths']}, seq {r['seq']}): speed-up",
            round(r["speed-up (fixed / dynamic)"], 2), "report", None)
    for r in _rows("parallel"):
        if "bubble measured" in r:
            add(f"{r['layout']} bubble (theory {r['bubble theory']:.2f})",
                r["bubble measured"], "report", None)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the CUDA suite (~1B Llama, bf16)")
    parser.add_argument("--only", nargs="+", help="run only these parts")
    args = parser.parse_args(argv)
    parts = GPU_PARTS if args.gpu else CPU_PARTS
    failed = []
    for name, cmd in parts.items():
        if args.only and name not in args.only:
            continue
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        if subprocess.run([sys.executable, str(HERE / cmd[0]), *cmd[1:]]).returncode:
            failed.append(name)
    table = markdown_table(summary(args.gpu))
    from datetime import datetime, timezone

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    text = f"Benchmarks, {stamp}, {machine()}\n\n{table}\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / ("summary-gpu.md" if args.gpu else "summary.md")).write_text(text)
    print("\n" + text)
    if failed:
        print(f"parts that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
