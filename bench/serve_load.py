"""Serving load: Poisson arrivals against a running server, optionally beside Hugging Face `generate`.

Sends N streaming `/v1/completions` requests with fixed prompt and output lengths (random token
ids as the prompt, `ignore_eos` + `min_tokens` so every request generates exactly the output
length, greedy) at each given rate (exponential gaps, i.e. a Poisson process; `--rate inf`
sends them all at once) and reports, per rate, request and token throughput, time to first
token (TTFT), inter-token latency (ITL: every gap between streamed chunks), time per output token (TPOT) and
end-to-end latency, the way vLLM's `benchmark_serving` counts them.

`--compare-hf` then exports the checkpoint with `tessera.converters.hf_io.export_hf` and runs
`transformers` `generate` on the same prompts, one request at a time in this process (the way
a script without a server would), and prints both side by side.

Each run's row is printed as it is measured ("tok/s vs HF" is filled in once HF has run), and
saved under `bench/results/` with `--self-test` or `--compare-hf`; `--budget-s` (the server's
start included) stops starting runs once spent.

    python bench/serve_load.py --url http://127.0.0.1:8000 --num-requests 200 --rate 2 8 32
    python bench/serve_load.py --url ... --compare-hf --checkpoint runs/demo/checkpoints/latest
    python bench/serve_load.py --self-test [--compare-hf]   # starts `tessera serve` on a tiny model
    python bench/serve_load.py --self-test --serve-arg=--compile   # ... with a compiled decode step
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, markdown_table  # noqa: E402


@dataclass
class Timing:
    """One request as the client saw it (seconds from its send time)."""

    ok: bool = False
    retries: int = 0  # 429 / 503 answers before it was admitted
    ttft: float = 0.0
    e2e: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


def make_prompts(n: int, length: int, seed: int, low: int = 4, high: int = 256) -> list[list[int]]:
    """`n` prompts of `length` random token ids in [low, high): byte pieces, valid in any
    Tessera tokenizer (4 specials, then 256 byte-fallback pieces)."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------------------- the server


async def _one(http: httpx.AsyncClient, body: dict, slots: asyncio.Semaphore | None) -> Timing:
    """One streamed request; a 429 / 503 is retried after its Retry-After (the clock runs on:
    latencies count from the first attempt)."""
    timing = Timing()
    async with slots or contextlib.nullcontext():
        start = time.perf_counter()  # once it may go (the client-side cap waits uncounted)
        while True:
            try:
                busy = await _attempt(http, body, timing, start)
            except httpx.HTTPError as exc:
                timing.error = f"{type(exc).__name__}: {exc}"
                return timing
            if busy is None or timing.retries >= 100:
                return timing
            timing.retries += 1
            await asyncio.sleep(busy)


async def _attempt(http: httpx.AsyncClient, body: dict, timing: Timing, start: float) -> float | None:
    """Run the request into `timing`; the seconds to wait if the server was busy, else None."""
    last = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code in (429, 503):
            timing.error = f"HTTP {response.status_code}, still after 100 retries"
            return float(response.headers.get("retry-after", "0.1"))
        if response.status_code != 200:
            timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                timing.error = str(chunk["error"])
                return None
            now = time.perf_counter() - start
            if chunk.get("usage"):
                timing.tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                if last is None:
                    timing.ttft = now
                else:
                    timing.gaps.append(now - last)
                last = now
    timing.e2e, timing.ok, timing.error = time.perf_counter() - start, True, ""
    return None


async def run_load(url: str, prompts: list[list[int]], output_len: int, rate: float,
                   model: str | None, api_key: str | None, seed: int,
                   max_concurrency: int | None = None) -> tuple[list[Timing], float]:
    """All requests, sent with exponential gaps of mean 1/rate; (timings, wall seconds)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed + 1)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as http:
        if model is None:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
        tasks, start = [], time.perf_counter()
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": output_len,
                    "min_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(_one(http, body, slots)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        timings = await asyncio.gather(*tasks)
    return list(timings), time.perf_counter() - start


# ------------------------------------------------------------------------ Hugging Face


def run_hf(checkpoint: Path, prompts: list[list[int]], output_len: int,
           device: str = "cpu") -> tuple[list[Timing], float]:
    """`transformers` greedy `generate` on the exported checkpoint, one prompt after another."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from tessera.converters.hf_io import export_hf

    class Clock(BaseStreamer):
        """Timestamps of each `put` after the prompt's (one per generated token)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value) -> None:
            if self.prompt_seen:
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    with tempfile.TemporaryDirectory() as tmp:
        export_hf(checkpoint, Path(tmp) / "hf", dtype="fp32")
        model = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32)
    model = model.to(device).eval()
    timings, start = [], time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            clock, sent = Clock(), time.perf_counter()
            out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, streamer=clock,
                                 pad_token_id=0)
            t = [x - sent for x in clock.times]
            timings.append(Timing(ok=True, ttft=t[0], e2e=time.perf_counter() - sent,
                                  gaps=list(np.diff(t)), tokens=out.shape[1] - len(prompt)))
    return timings, time.perf_counter() - start


# ----------------------------------------------------------------------------- report


def summarize(timings: list[Timing], wall: float) -> dict[str, float]:
    done = [t for t in timings if t.ok]
    if not done:
        return {"completed": 0.0, "failed": float(len(timings))}
    ms = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if len(xs) else float("nan")  # noqa: E731
    gaps = [g for t in done for g in t.gaps]
    tpot = [(t.e2e - t.ttft) / (t.tokens - 1) for t in done if t.tokens > 1]
    tokens = sum(t.tokens for t in done)
    return {
        "completed": float(len(done)), "failed": float(len(timings) - len(done)),
        "retried 429/503": float(sum(t.retries for t in timings)),
        "req/s": len(done) / wall, "output tok/s": tokens / wall,
        "TTFT p50 ms": ms([t.ttft for t in done], 50), "TTFT p99 ms": ms([t.ttft for t in done], 99),
        "ITL p50 ms": ms(gaps, 50), "ITL p99 ms": ms(gaps, 99),
        "TPOT p50 ms": ms(tpot, 50), "E2E p50 ms": ms([t.e2e for t in done], 50),
        "E2E p99 ms": ms([t.e2e for t in done], 99)}


def compare_to_hf(rows: list[dict], hf: dict[str, float]) -> None:
    """Add each row's output tok/s against HF's (`hf`, a `summarize` result)."""
    for row in rows:
        row["tok/s vs HF"] = row.get("output tok/s", 0.0) / hf["output tok/s"] \
            if hf.get("output tok/s") else float("nan")


# -------------------------------------------------------------------------- self-test


def make_tiny_checkpoint(directory: Path) -> Path:
    """A random-weight tiny Llama with a tokenizer trained on Python's own sources."""
    import argparse as argparse_module
    import json as json_module

    from tessera.core import ModelConfig, build_model
    from tessera.core.checkpoint import save_checkpoint
    from tessera.core.tokenizer import train_tokenizer

    texts = [Path(m.__file__).read_text() for m in (argparse_module, json_module)]
    train_tokenizer([], 512, directory / "tokenizer.model", texts=texts, num_threads=1)
    model = build_model(ModelConfig.from_name("llama-tiny", max_position_embeddings=512), seed=0)
    return save_checkpoint(directory / "tiny", model, tokenizer=directory / "tokenizer.model")


def start_server(checkpoint: Path, max_batch: int, threads: int | None,
                 extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    process = subprocess.Popen([sys.executable, "-m", "tessera", "serve", "--checkpoint",
                                str(checkpoint), "--port", str(port), "--max-batch", str(max_batch),
                                "--log-level", "warning", *extra], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # --compile spends tens of seconds before it listens
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"tessera serve exited with code {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("tessera serve did not come up within 5 minutes")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", help="a running server (or use --self-test)")
    p.add_argument("--self-test", action="store_true", help="serve a tiny random model and bench it")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, nargs="+", default=[4.0, 16.0, float("inf")],
                   help="offered requests/s, one run each against the same server "
                        "(inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most, client side (default: no cap)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-hf", action="store_true", help="also run HF generate sequentially")
    p.add_argument("--hf-requests", type=int, default=10, help="prompts for the HF run")
    p.add_argument("--checkpoint", type=Path, help="the served checkpoint (for --compare-hf)")
    p.add_argument("--max-batch", type=int, default=16, help="--self-test: the engine's batch")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for the HF run and the --self-test server")
    p.add_argument("--hf-device", default=None, help="device of the HF run (default: cuda if any)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                   help="--self-test: a further `tessera serve` flag (repeatable), e.g. "
                        "--serve-arg=--compile")
    p.add_argument("--name", default="serve_load", help="results name (bench/results/NAME.*)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget: no further run starts once it is spent")
    args = p.parse_args(argv)
    if not args.url and not args.self_test:
        p.error("give --url URL or --self-test")
    if args.compare_hf and not (args.checkpoint or args.self_test):
        p.error("--compare-hf needs --checkpoint (the checkpoint the server serves)")
    budget = Budget(args.budget_s)
    # Figures of a server found at --url are printed, not saved over the self-test's.
    saved = Rows(args.name) if args.self_test or args.compare_hf else None
    rows: list[dict] = saved.rows if saved else []

    def add(row: dict) -> None:
        if saved:
            saved.add(row)
        else:
            rows.append(row)
            print(f"ROW {args.name} {json.dumps(row)}", flush=True)

    prompts = make_prompts(args.num_requests, args.input_len, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        server = None
        if args.self_test:
            args.checkpoint = make_tiny_checkpoint(Path(tmp))
            server, args.url = start_server(args.checkpoint, args.max_batch, args.threads,
                                            args.serve_arg)
        runs: list[dict[str, float]] = []
        try:
            for rate in args.rate:
                if runs and budget.skips(f"{rate:g} req/s and later rates"):
                    break
                timings, wall = asyncio.run(run_load(args.url, prompts, args.output_len, rate,
                                                     args.model, args.api_key, args.seed,
                                                     args.max_concurrency))
                runs.append(summarize(timings, wall))
                add({"run": f"tessera server, {rate:g} req/s offered", **runs[-1]})
                errors = sorted({t.error for t in timings if not t.ok})
                if errors:
                    print(f"rate {rate:g}: {len(errors)} distinct errors, e.g.: {errors[:3]}",
                          file=sys.stderr)
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=30)
        if args.compare_hf and not budget.skips("the HF generate run"):
            import torch

            if args.threads:
                torch.set_num_threads(args.threads)
            device = args.hf_device or ("cuda" if torch.cuda.is_available() else "cpu")
            hf = summarize(*run_hf(args.checkpoint, prompts[:args.hf_requests], args.output_len,
                                   device))
            add({"run": "HF generate (sequential)", **hf})
            compare_to_hf(rows, hf)
    print(f"\n{args.num_requests} requests per run, {args.input_len} prompt + {args.output_len} "
          "output tokens, greedy. A run's req/s cannot exceed its offered rate; HF runs one "
          "request at a time, as fast as it can.")
    if saved:
        saved.finish()
    else:
        print(markdown_table(rows))
    return 0 if all(summary.get("completed") for summary in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
