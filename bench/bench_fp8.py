"""FP8 linear layers: `torch._scaled_mm` with e4m3 weights against the bf16 matmul, speed and
error, at the shapes of a Llama MLP. Meaningful on FP8 GPUs (Hopper: H100/H200); on CPU the FP8
kernel is a slow reference path and the row is reported for completeness.

    python bench/bench_fp8.py [--device cuda] [--tokens 4096 --hidden 2048 --ffn 5632]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import best_time, record  # noqa: E402

from tessera.core.fp8 import quantize, scaled_mm_linear  # noqa: E402


def run(args) -> list[dict]:
    device = args.device
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, (out_f, in_f) in {"w1 (up)": (args.ffn, args.hidden),
                                "w2 (down)": (args.hidden, args.ffn)}.items():
        x = torch.randn(args.tokens, in_f, device=device, generator=g).to(torch.bfloat16)
        w = (torch.randn(out_f, in_f, device=device, generator=g) * 0.02).to(torch.bfloat16)
        reference = x.float() @ w.float().t()
        for granularity in ("tensor", "channel"):
            q, scale = quantize(w, per_channel=granularity == "channel")
            t_bf16 = best_time(lambda x=x, w=w: x @ w.t(), repeats=args.repeats)
            t_fp8 = best_time(lambda x=x, q=q, s=scale: scaled_mm_linear(x, q, s),
                              repeats=args.repeats)
            y = scaled_mm_linear(x, q, scale).float()
            error = ((y - reference).norm() / reference.norm()).item()
            flops = 2 * args.tokens * in_f * out_f
            rows.append({"layer": name, "scales": granularity,
                         "bf16 TFLOP/s": flops / t_bf16 / 1e12,
                         "fp8 TFLOP/s": flops / t_fp8 / 1e12,
                         "fp8 speedup": t_bf16 / t_fp8, "fp8 relative error": error})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (8192 if args.device == "cuda" else 256)
    record(run(args), "fp8")


if __name__ == "__main__":
    main()
