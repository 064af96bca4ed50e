"""The batched LoRA product of `core.lora_batched`: loop over the batch's adapters (what the hook
does) against gathering every row's factors and two `bmm`s, on this host's CPU.

    python bench/bench_lora_batched.py [--threads N]

Prints the CPU's ISA beside the figures (`core.cpu_isa`).
"""

from __future__ import annotations

import argparse
import time

import torch

from tessera.core.cpu_isa import cpu_isa


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_isa()}, threads {args.threads}")
    print(f"{'hidden':>6} {'T':>4} {'B':>3} {'adapters':>8} {'loop us':>9} {'gather+bmm us':>14}")
    g = torch.Generator().manual_seed(0)
    for hidden, T, B, n in [(256, 1, 8, 2), (256, 1, 32, 4), (1024, 1, 16, 4), (1024, 1, 64, 4),
                            (1024, 64, 4, 2), (2048, 1, 32, 4), (2048, 128, 2, 2)]:
        a = torch.randn(4, 16, hidden, generator=g)
        b = torch.randn(4, 3 * hidden, 16, generator=g)
        x = torch.randn(T, B, hidden, generator=g)
        slots = torch.arange(B) % (n + 1) - 1  # some rows without an adapter
        assert torch.allclose(loop(x, a, b, slots), gather_bmm(x, a, b, slots), atol=1e-3)
        print(f"{hidden:>6} {T:>4} {B:>3} {n:>8} {timed(loop, x, a, b, slots):>9.0f} "
              f"{timed(gather_bmm, x, a, b, slots):>14.0f}")


if __name__ == "__main__":
    main()
