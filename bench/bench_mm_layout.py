"""Why a compiled bf16 decode step can be slower than eager on a CPU without native bf16.

On such a CPU (AVX2 only: no AMX, no AVX-512 bf16) oneDNN refuses bf16 weight packing
("bf16 path needs avx_ne_convert or avx512bw/vl/dq"), so TorchInductor's frozen graph cannot
use its prepacked oneDNN linear and calls `mm` with the weight constant-folded to a contiguous
(in, out) matrix. ATen's bf16 `mm` then runs its reference loops, and the no-transpose loop is
several times slower than the transposed one eager `F.linear` takes, the more so the more rows:
the compiled multi-row (concurrent) step suffers most. This prints both layouts, in bf16 and
fp32, for 1, 2 and 16 rows of a decode-sized product, with the CPU's ISA. Each row is printed as
it is measured; `--budget-s` stops starting cases once spent.

    python bench/bench_mm_layout.py [--in 512 --out 1536]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, best_time  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in", dest="k", type=int, default=512)
    parser.add_argument("--out", dest="n", type=int, default=1536)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget: no case starts once it is spent")
    args = parser.parse_args(argv)
    budget, rows = Budget(args.budget_s), Rows("mm_layout")
    w = torch.randn(args.n, args.k)
    for m in (1, 2, 16):
        for dtype in (torch.bfloat16, torch.float32):
            if rows.rows and budget.skips(f"{m} rows, {dtype}"):
                continue
            x, wt = torch.randn(m, args.k, dtype=dtype), w.to(dtype)
            folded = wt.t().contiguous()
            eager = best_time(lambda: torch.mm(x, wt.t()), repeats=5)  # noqa: B023
            frozen = best_time(lambda: torch.mm(x, folded), repeats=5)  # noqa: B023
            rows.add({"dtype": str(dtype).removeprefix("torch."), "rows": m,
                      "eager layout (us)": eager * 1e6, "frozen layout (us)": frozen * 1e6,
                      "frozen / eager": frozen / eager})
    return rows.finish()


if __name__ == "__main__":
    main()
