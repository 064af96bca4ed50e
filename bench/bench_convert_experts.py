"""Conversion of a Mixture-of-Experts checkpoint between expert layouts: peak memory and
throughput of `tessera convert --ep/--etp`, against the largest expert bank and a plain copy.

A random fp32 MoE checkpoint (8 experts per layer, banks of `--bank-mb` MiB each for w1, half
that for w2) is converted ep1 -> ep4 (dp 4), ep4 -> ep2 x etp2, ep2 x etp2 -> ep1, each in a
fresh subprocess so its peak RSS (VmHWM above the interpreter with torch imported) is its own.
Expert banks stream expert by expert in row chunks of `CHUNK_BYTES` (32 MiB), so the peak
should stay a few chunks whatever the bank size. Each row is printed as it is measured;
`--budget-s` stops starting conversions once spent.

    python bench/bench_convert_experts.py [--bank-mb 512] [--layers 2] [--workdir DIR] [--budget-s S]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows  # noqa: E402
from bench_convert import plain_copy  # noqa: E402

_CHILD = r"""
import json, re, sys, time
from tessera.converters.reshard import reshard_checkpoint
def hwm():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
src, dst, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
base = hwm()  # the interpreter with torch and tessera imported
tic = time.perf_counter()
s = reshard_checkpoint(src, dst, progress=False, overwrite=True, **kwargs)
print(json.dumps({"seconds": time.perf_counter() - tic, "bytes_written": s.bytes_written,
                  "peak_rss": hwm(), "baseline_rss": base}))
"""


def make_checkpoint(path: Path, bank_mb: int, layers: int) -> tuple[int, int]:
    """A random fp32 mixtral-style checkpoint whose w1 banks are `bank_mb` MiB each; returns
    (checkpoint bytes, w1 bank bytes)."""
    from tessera.core import ModelConfig, build_model, save_checkpoint

    hidden, experts = 1024, 8
    ffn = bank_mb * 2**20 // (experts * 2 * hidden * 4)  # w1: (E, 2 F, h) fp32
    config = ModelConfig.from_name("mixtral-tiny", hidden_size=hidden, num_heads=8,
                                   num_kv_heads=4, num_layers=layers, ffn_hidden_size=ffn,
                                   moe={"num_experts": experts}, vocab_size=32000)
    if not (path / "manifest.json").is_file():
        save_checkpoint(path, build_model(config, seed=0))
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return size, experts * 2 * ffn * hidden * 4


def convert(src: Path, dst: Path, **kwargs) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst), json.dumps(kwargs)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bank-mb", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tessera-bench-convert-moe"))
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget: no conversion starts once it is spent")
    args = parser.parse_args(argv)
    budget, rows = Budget(args.budget_s), Rows("convert_experts")
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / "ep1"
    size, bank = make_checkpoint(src, args.bank_mb, args.layers)
    rows.add({"conversion": f"checkpoint: {size / 1e9:.2f} GB fp32, w1 bank {bank / 2**20:.0f} "
                            f"MiB"})
    copy_s = plain_copy(src, args.workdir / "copy")
    rows.add({"conversion": "plain file copy (read + write + fsync)", "GB/s": size / copy_s / 1e9})
    hops = [("ep1 -> ep4 (dp 4)", src, "ep4", {"ep": 4, "dp": 4}),
            ("ep4 -> ep2 x etp2", args.workdir / "ep4", "ep2etp2", {"ep": 2, "etp": 2}),
            ("ep2 x etp2 -> ep1", args.workdir / "ep2etp2", "back", {"ep": 1})]
    for name, source, out, kwargs in hops:
        # Each hop reads the one before, so a skipped hop skips the rest.
        if budget.skips(f"{name} and later hops"):
            break
        tic = time.perf_counter()
        result = convert(source, args.workdir / out, **kwargs)
        rss = result["peak_rss"] - result["baseline_rss"]
        rows.add({"conversion": name, "GB/s": size / result["seconds"] / 1e9,
                  "peak RSS MiB": rss / 2**20, "peak RSS / w1 bank": f"{rss / bank:.1%}",
                  "vs copy": copy_s / result["seconds"],
                  "wall s": time.perf_counter() - tic})
    rows.finish()


if __name__ == "__main__":
    main()
