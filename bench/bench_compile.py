"""Cold compile time of a Llama training step: whole-model vs regional (per-block) compilation.

For each depth (`--layers`, default 2 and 16) and each way of compiling (`--modes`): "whole"
puts the model under one in-place `torch.compile` (what `--compile` did before), "regional"
compiles each transformer block (`core.regional_compile.compile_blocks`, what `--compile`
does). Each case runs in a fresh process with empty Inductor and Triton cache directories, so
every compile is cold. In it: eager steps first (they also compile the fused kernels), then the
first compiled forward+backward; compile seconds = that first step minus an eager step. Then
the step time once compiled. A step is forward and backward (no optimizer update: it is never
compiled). Each row is printed as it is measured; `--budget-s` bounds the whole run.

    python bench/bench_compile.py [--device cpu --hidden 256 --layers 2 16 --budget-s 900]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, device_time, machine  # noqa: E402

from tessera.core import ModelConfig, build_model  # noqa: E402

MODES = ("whole", "regional")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _config(args: argparse.Namespace, layers: int) -> ModelConfig:
    return ModelConfig.from_name(
        "llama-tiny", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=layers,
        num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64,
        ffn_hidden_size=int(args.hidden * 8 / 3) // 64 * 64, max_position_embeddings=args.seq)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_case(args: argparse.Namespace, layers: int, mode: str) -> dict:
    """One case in this process: eager step, cold compiled step, compiled step time."""
    import torch._dynamo

    from tessera.core.compile_cache import key_compile_cache_by_isa
    from tessera.core.regional_compile import compile_blocks

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(_config(args, layers), device=args.device, dtype=DTYPES[args.dtype])
    model.train()
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), device=args.device)

    def step() -> None:
        model(ids, labels=ids).backward()
        model.zero_grad(set_to_none=True)

    eager_s = device_time(step, steps=2, warmup=1, device=args.device)
    if mode == "whole":
        key_compile_cache_by_isa()
        model.compile()
    else:
        compile_blocks(model)
    torch._dynamo.utils.counters.clear()
    _sync(args.device)
    tic = time.perf_counter()
    step()
    _sync(args.device)
    first_s = time.perf_counter() - tic
    step_s = device_time(step, steps=args.steps, warmup=1, device=args.device)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # recompiles counted too
    return {"layers": layers, "mode": mode, "compile_s": round(first_s - eager_s, 2),
            "first_step_s": round(first_s, 2), "eager_step_ms": round(eager_s * 1e3, 1),
            "compiled_step_ms": round(step_s * 1e3, 1), "graphs": graphs}


def run_case(args: argparse.Namespace, layers: int, mode: str, timeout: float) -> dict:
    """`measure_case` in a fresh process with empty compile caches (a cold compile)."""
    argv = [sys.executable, __file__, "--child", "--case-layers", str(layers), "--mode", mode,
            "--device", args.device, "--dtype", args.dtype, "--hidden", str(args.hidden),
            "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch),
            "--steps", str(args.steps)]
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
        try:
            out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True,
                                 timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"layers": layers, "mode": mode, "status": f"out of budget ({timeout:.0f} s)"}
        except subprocess.CalledProcessError as error:
            last = (error.stderr.strip().splitlines() or ["(no output)"])[-1]
            return {"layers": layers, "mode": mode, "status": f"failed: {last[:200]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="weights' dtype (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="compiled steps timed")
    parser.add_argument("--budget-s", type=float, default=None, help="wall-clock budget")
    parser.add_argument("--name", default=None, help="results name (default: compile[-device])")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case-layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hidden % 64:
        parser.error(f"--hidden {args.hidden} must be a multiple of 64 (the head size)")
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.child:
        print(json.dumps(measure_case(args, args.case_layers, args.mode)), flush=True)
        return 0

    print(f"machine: {machine()}", flush=True)
    budget = Budget(args.budget_s)
    rows = Rows(args.name or ("compile" if args.device == "cpu" else f"compile-{args.device}"))
    for layers in args.layers:
        compile_s = {}
        for mode in args.modes:
            if budget.spent():
                print(f"budget spent: {layers} layers, {mode} not measured", flush=True)
                continue
            row = run_case(args, layers, mode, timeout=budget.left())
            compile_s[mode] = row.get("compile_s")
            if mode == "regional" and compile_s.get("whole") and row.get("compile_s"):
                row["whole_over_regional"] = round(compile_s["whole"] / row["compile_s"], 1)
            rows.add({"device": args.device, "dtype": args.dtype, "hidden": args.hidden, **row})
    rows.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
