"""Continuous batching through `tessera serve`: output tok/s, TTFT and ITL p50/p99 at several
numbers of concurrent requests, against one server; each run printed as `ROW serve {json}`
(the `serve` stage of bench/gpu_check.py, beside the engine-only figures of its decode stage).

    python bench/serve_check.py --device cuda --preset llama-1b      # the GPU stage
    python bench/serve_check.py --device cpu --tiny                  # seconds on a CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _common import Budget  # noqa: E402
from serve_load import make_prompts, make_tiny_checkpoint, run_load, start_server, summarize  # noqa: E402


def preset_checkpoint(directory: Path, preset: str) -> Path:
    """Random bf16 weights of `preset` with the tiny tokenizer (prompts are sent as ids)."""
    from tessera.core import ModelConfig, build_model
    from tessera.core.checkpoint import save_checkpoint

    tiny = make_tiny_checkpoint(directory)  # trains the tokenizer next to it
    import torch

    model = build_model(ModelConfig.from_name(preset), dtype=torch.bfloat16, seed=0)
    return save_checkpoint(directory / preset, model, tokenizer=tiny.parent / "tokenizer.model")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--tiny", action="store_true", help="llama-tiny, few tokens (CPU test)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests-per-slot", type=int, default=2,
                   help="requests per concurrent slot in each run (at least 4 in all)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="serve with --compile (the static-shape decode step)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="no further run starts once this many seconds are spent")
    args = p.parse_args(argv)
    if args.tiny:
        args.input_len, args.output_len = min(args.input_len, 16), min(args.output_len, 8)
    budget = Budget(args.budget_s)
    extra = ["--device", args.device, "--max-step-tokens",
             str(max(512, max(args.concurrency) * 2))]
    if args.device.startswith("cuda"):
        extra += ["--dtype", "bf16"]
    if args.compile:
        extra += ["--compile"]
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = (make_tiny_checkpoint(Path(tmp)) if args.tiny
                else preset_checkpoint(Path(tmp), args.preset))
        server, url = start_server(ckpt, max(args.concurrency), None, extra)
        try:
            for n in args.concurrency:
                if budget.skips(f"{n} concurrent and later runs"):
                    break
                prompts = make_prompts(max(4, n * args.requests_per_slot), args.input_len, n)
                timings, wall = asyncio.run(run_load(url, prompts, args.output_len,
                                                     float("inf"), None, None, n, n))
                row = {"case": f"{n} concurrent through tessera serve",
                       "compiled": args.compile, **summarize(timings, wall)}
                failed |= row["completed"] < len(prompts)
                print(f"ROW serve {json.dumps(row)}", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
