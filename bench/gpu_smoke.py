"""Smoke test of the two user-facing jobs on one device: `tessera pretrain` (the embedded demo,
a few steps) and `tessera serve` on the checkpoint it wrote, answering one `/v1/completions`.

    python bench/gpu_smoke.py --device cuda [--steps 30] [--workdir DIR]

Prints one `ROW gpu_smoke {...}` line per job as it finishes (bench/_common.py `Rows`).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Rows  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pretrain(workdir: Path, device: str, steps: int, precision: str) -> tuple[dict, Path | None]:
    run_dir = workdir / "demo"
    cmd = [sys.executable, "-m", "tessera", "pretrain", "--output", str(run_dir), "--steps",
           str(steps), "--device", device, "--precision", precision, "--save-interval", "0",
           "--eval-interval", "0", "--progress", "false", "--overwrite"]
    tic = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - tic
    tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    row = {"job": f"tessera pretrain ({steps} steps, {precision}, {device})",
           "ok": out.returncode == 0, "seconds": seconds, "tail": " / ".join(tail)[-300:]}
    return row, ckpts[-1] if out.returncode == 0 and ckpts else None


def serve(checkpoint: Path, device: str, timeout: float) -> dict:
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "tessera", "serve", "--checkpoint", str(checkpoint), "--device",
           device, "--port", str(port)]
    tic = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    row = {"job": f"tessera serve ({device})", "ok": False}
    try:
        base = f"http://127.0.0.1:{port}"
        while time.perf_counter() - tic < timeout:
            if proc.poll() is not None:
                row["tail"] = proc.stdout.read()[-300:]
                return row
            try:
                httpx.get(f"{base}/v1/models", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        row["startup s"] = time.perf_counter() - tic
        reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": httpx.get(f"{base}/v1/models").json()["data"][0]["id"],
            "prompt": "The default value", "max_tokens": 16, "temperature": 0})
        row.update(ok=reply.status_code == 200, status=reply.status_code,
                   text=reply.json()["choices"][0]["text"][:80] if reply.is_success else
                   reply.text[:200])
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--serve-timeout", type=float, default=60.0)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    rows = Rows("gpu_smoke")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        os.makedirs(workdir, exist_ok=True)
        row, checkpoint = pretrain(workdir, args.device, args.steps, precision)
        rows.add(row)
        if checkpoint is not None:
            rows.add(serve(checkpoint, args.device, args.serve_timeout))
    rows.finish()
    return 0 if all(r["ok"] for r in rows.rows) and len(rows.rows) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
