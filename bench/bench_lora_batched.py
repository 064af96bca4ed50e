"""The batched LoRA product of `core.lora_batched`: loop over the batch's adapters (what the hook
does) against gathering every row's factors and two `bmm`s, on this host's CPU.

    python bench/bench_lora_batched.py [--threads N] [--budget-s S]

Prints the CPU's ISA beside the figures (`core.cpu_isa`), and each row as it is measured;
`--budget-s` stops starting shapes once spent.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows  # noqa: E402

from tessera.core.cpu_isa import cpu_isa  # noqa: E402


def loop(x, a, b, slots):
    out = x.new_zeros(*x.shape[:-1], b.shape[1])
    values = slots.tolist()
    for s in sorted(set(values) - {-1}):
        rows = torch.tensor([i for i, v in enumerate(values) if v == s])
        xs = x.index_select(1, rows)
        out.index_add_(1, rows, (xs @ a[s].t()) @ b[s].t())
    return out


def gather_bmm(x, a, b, slots):
    idx = slots.clamp(min=0)
    ag, bg = a[idx], b[idx]  # (B, r, in), (B, out, r)
    h = torch.bmm(x.transpose(0, 1), ag.transpose(1, 2))
    y = torch.bmm(h, bg.transpose(1, 2)) * (slots >= 0).to(x.dtype)[:, None, None]
    return y.transpose(0, 1)


def timed(fn, *args, reps=50):
    fn(*args)
    t = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return (time.perf_counter() - t) / reps * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget: no shape starts once it is spent")
    args = p.parse_args(argv)
    budget, rows = Budget(args.budget_s), Rows("lora_batched")
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_isa()}, threads {args.threads}")
    g = torch.Generator().manual_seed(0)
    for i, (hidden, T, B, n) in enumerate([(256, 1, 8, 2), (256, 1, 32, 4), (1024, 1, 16, 4),
                                           (1024, 1, 64, 4), (1024, 64, 4, 2), (2048, 1, 32, 4),
                                           (2048, 128, 2, 2)]):
        if i and budget.skips(f"hidden {hidden} T {T} B {B} and later shapes"):
            break
        a = torch.randn(4, 16, hidden, generator=g)
        b = torch.randn(4, 3 * hidden, 16, generator=g)
        x = torch.randn(T, B, hidden, generator=g)
        slots = torch.arange(B) % (n + 1) - 1  # some rows without an adapter
        assert torch.allclose(loop(x, a, b, slots), gather_bmm(x, a, b, slots), atol=1e-3)
        rows.add({"hidden": hidden, "T": T, "B": B, "adapters": n,
                  "loop us": timed(loop, x, a, b, slots),
                  "gather+bmm us": timed(gather_bmm, x, a, b, slots)})
    return rows.finish()


if __name__ == "__main__":
    main()
