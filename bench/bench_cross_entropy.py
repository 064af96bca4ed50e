"""Time and peak memory of the decoder head's loss: full logits vs the chunked linear
cross-entropy (`core.linear_cross_entropy`), forward + backward.

`full` is today's head: `F.linear` then the fused log-softmax + NLL on fp32 logits
(`core.fused.cross_entropy`, compiled when training). `chunked` never holds more than one chunk
of logits. Both run under bf16 autocast (`--dtype bf16`, the CUDA default: fp32 master weights,
as training) or in fp32 (the CPU default). Peak memory is the most bytes of tensors alive at
once during one forward + backward, beyond the inputs: on CUDA from
`torch.cuda.max_memory_allocated`; on a CPU counted at the dispatcher
(`core.tensor_memory.PeakTensorBytes`), exact where a process's RSS moves with the allocator's
caching. The dispatcher does not see the allocations inside a compiled kernel, so the CPU memory
pass runs the full head eager (the compiled kernel holds fewer fp32 intermediates: read the CPU
`full` peak as an upper bound).

    python bench/bench_cross_entropy.py [--device cuda] [--tiny] [--budget-s 120]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, device_time  # noqa: E402

from tessera.core import fused  # noqa: E402
from tessera.core.linear_cross_entropy import chunk_rows, linear_cross_entropy  # noqa: E402
from tessera.core.tensor_memory import PeakTensorBytes  # noqa: E402

MIB = 2**20


def full_head(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    losses = fused.cross_entropy(F.linear(h, w), t, -100)
    return losses.sum() / (t != -100).sum().clamp(min=1)


def chunked_head(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, rows: int) -> torch.Tensor:
    return linear_cross_entropy(h, w, t, rows=rows)


def _step(head, h, w, t, dtype):
    def step():
        h.grad = w.grad = None
        with torch.autocast(h.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = head(h, w, t)
        loss.backward()
    return step


def peak_mib(step, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / MIB
    mode = fused.mode()
    fused.set_mode("off")
    try:
        with PeakTensorBytes() as memory:
            step()
    finally:
        fused.set_mode(mode)
    return memory.peak / MIB


def main() -> None:
    args = _parse()
    tokens = args.tokens or (1024 if args.tiny else 8192)
    hidden = args.hidden or (64 if args.tiny else 2048)
    chunk_mib = args.chunk_mib or (16 if args.tiny else 256)
    precision = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    rows, budget = Rows("cross_entropy"), Budget(args.budget_s)
    steps, warmup = (3, 1) if args.device == "cpu" else (5, 2)
    for vocab in args.vocabs:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(tokens, hidden, generator=g).to(args.device).requires_grad_()
        w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(args.device)
        w.requires_grad_()
        t = torch.randint(0, vocab, (tokens,), generator=g).to(args.device)
        t[: tokens // 8] = -100
        times, per_chunk = {}, chunk_rows(vocab, chunk_mib * MIB)
        chunked = functools.partial(chunked_head, rows=per_chunk)
        for name, head in (("full", full_head), ("chunked", chunked)):
            if budget.spent():
                print(f"budget of {args.budget_s:g} s spent: V={vocab} {name} not measured",
                      flush=True)
                break
            step = _step(head, h, w, t, dtype)
            times[name] = device_time(step, steps=steps, warmup=warmup, device=args.device)
            rows.add({"head": name, "device": args.device, "dtype": precision,
                      "tokens": tokens, "hidden": hidden, "vocab": vocab,
                      "chunk_rows": per_chunk if name == "chunked" else tokens,
                      "ms": times[name] * 1e3, "peak_mib": peak_mib(step, args.device),
                      "logits_fp32_mib": tokens * vocab * 4 / MIB,
                      "time_vs_full": times[name] / times["full"]})
    rows.finish()


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tiny", action="store_true",
                        help="1024 tokens, hidden 64 and 16 MiB chunks (CPU minutes) instead of "
                             "8192, 2048 and 256 MiB")
    parser.add_argument("--tokens", type=int, default=None, help="rows N (batch x sequence)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size C")
    parser.add_argument("--vocabs", type=lambda s: [int(v) for v in s.split(",")],
                        default=[32000, 128256], help="comma-separated vocabulary sizes")
    parser.add_argument("--chunk-mib", type=int, default=None,
                        help="fp32 logits per chunk (default 256, the decoder's)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                        help="bf16: autocast over fp32 weights, as training (default on CUDA; "
                             "fp32 on a CPU, whose bf16 products may be emulated and slow)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop measuring new rows after this many seconds")
    return parser.parse_args()


if __name__ == "__main__":
    main()
