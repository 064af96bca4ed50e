"""Conversion: throughput and peak memory of `tessera convert` resharding a >= 1 GB checkpoint,
against the checkpoint's size and a plain file copy of it, measured in the same run.

Each conversion runs in a fresh subprocess so its peak RSS is its own. Targets on the 2-core CPU:
peak RSS under 25% of the checkpoint size; throughput at least half of the file copy's. Each row
is printed as it is measured; `--budget-s` stops starting conversions once spent.

    python bench/bench_convert.py [--size-gb 1.0] [--workdir /tmp/tessera-bench-convert] [--budget-s S]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows  # noqa: E402

# Peak RSS from VmHWM, which belongs to this address space: getrusage's ru_maxrss survives
# fork + exec, so a child of a large parent would report the parent's peak.
_CHILD = r"""
import json, re, sys, time
from tessera.converters.reshard import reshard_checkpoint
def hwm():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
src, dst, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
base = hwm()  # the interpreter with torch and tessera imported
tic = time.perf_counter()
s = reshard_checkpoint(src, dst, tp=tp, pp=pp, progress=False, overwrite=True)
print(json.dumps({"seconds": time.perf_counter() - tic, "bytes_written": s.bytes_written,
                  "peak_rss": hwm(), "baseline_rss": base}))
"""


def make_checkpoint(path: Path, size_gb: float) -> int:
    """A random fp32 Llama checkpoint of about `size_gb` (built layer by layer, never whole)."""
    from tessera.core import ModelConfig, build_model, save_checkpoint
    from tessera.core.parallel.sharding import num_parameters

    def params(layers: int) -> int:
        return num_parameters(ModelConfig.from_name("llama-1b", num_layers=layers))

    layer_bytes, other_bytes = 4 * (params(1) - params(0)), 4 * params(0)  # fp32
    # A multiple of 4 layers, so every target layout (pp 2, pp 4) divides it.
    layers = max(4, round((size_gb * 1e9 - other_bytes) / layer_bytes / 4) * 4)
    config = ModelConfig.from_name("llama-1b", num_layers=layers, max_position_embeddings=256)
    if not (path / "manifest.json").is_file():
        save_checkpoint(path, build_model(config, seed=0))
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def plain_copy(src: Path, dst: Path, chunk: int = 16 << 20) -> float:
    """Seconds to copy every file through user space and flush it, the minimum any converter
    does (read each byte, write each byte, make it durable). `shutil.copytree` would use the
    kernel's copy_file_range/sendfile and skip the flush, which no converter can."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    tic = time.perf_counter()
    for f in src.iterdir():
        with open(f, "rb") as fin, open(dst / f.name, "wb") as fout:
            while block := fin.read(chunk):
                fout.write(block)
            fout.flush()
            os.fsync(fout.fileno())
    return time.perf_counter() - tic


def convert(src: Path, dst: Path, tp: int, pp: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst), str(tp), str(pp)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tessera-bench-convert"))
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget: no conversion starts once it is spent")
    args = parser.parse_args(argv)
    budget, rows = Budget(args.budget_s), Rows("convert")
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = args.workdir / "src"
    size = make_checkpoint(src, args.size_gb)
    rows.add({"conversion": f"checkpoint: {size / 1e9:.2f} GB fp32"})
    copy_s = plain_copy(src, args.workdir / "copy")
    rows.add({"conversion": "plain file copy (read + write + fsync)", "GB/s": size / copy_s / 1e9,
              "peak RSS / checkpoint": "-", "vs copy (target >= 0.5)": 1.0})
    for tp, pp in ((2, 2), (1, 1), (4, 1)):
        if budget.skips(f"tp1 -> tp{tp} x pp{pp} and later conversions"):
            break
        result = convert(src, args.workdir / f"tp{tp}pp{pp}", tp, pp)
        rss = result["peak_rss"] - result["baseline_rss"]
        rows.add({"conversion": f"tp1 -> tp{tp} x pp{pp}",
                  "GB/s": size / result["seconds"] / 1e9,
                  "peak RSS / checkpoint": f"{rss / size:.1%} (target < 25%)",
                  "vs copy (target >= 0.5)": copy_s / result["seconds"]})
    rows.finish()


if __name__ == "__main__":
    main()
