"""Paged KV cache + prefix caching against wave 1's slot engine, and chunked prefill, in one run.

Two workloads on the in-process engine (no HTTP; the step loop on the main thread, the client
beside it, as `tessera serve` runs them), random weights, greedy decoding with `ignore_eos`:

1. `prefix`: Poisson arrivals of requests that share a system prompt (a shared prefix, then a
   unique suffix). The wave-1 engine (`--kv-cache slots`, `--max-batch` slots) and the paged
   engine without and with prefix caching (the same KV memory, up to `--paged-max-batch`
   requests at once) serve the same arrivals; reported side by side: output token throughput, TTFT and ITL
   p50/p99, requests running at once, prefix-cache hit rate, and whether the outputs agree.
2. `chunked`: `--decoders` requests decoding when one long prompt (`--long-prompt` tokens)
   arrives; the decoders' inter-token latency p50/p99/max while it is prefilled, with
   chunked prefill (`--chunk` tokens per step) and without (the whole prompt in one step).

Each row is printed as it is measured ("outputs equal" is filled in once its peers have run);
`--budget-s` stops starting engines and workloads once spent.

    python bench/bench_serving_paged.py                       # both workloads
    python bench/bench_serving_paged.py --workload prefix --rate 4 16 --num-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows  # noqa: E402

from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.paged_kv_cache import PagedKVCache  # noqa: E402
from tessera.serving.engine import LLMEngine, run_beside  # noqa: E402
from tessera.serving.engine.kv_config import KVCacheConfig  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402


def cpu_isa() -> str:
    """The CPU's matrix/vector extensions that matter for bf16 and fp32 kernels."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    found = [name for flag, name in (("amx_bf16", "AMX-bf16"), ("avx512_bf16", "AVX-512-bf16"),
                                     ("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags]
    return f"{', '.join(found) or 'unknown'} (torch: {torch.backends.cpu.get_cpu_capability()})"


@dataclass
class Seen:
    """One request as the client saw it (seconds from its arrival)."""

    tokens: list[int] = field(default_factory=list)
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)


async def _consume(engine: LLMEngine, request: GenerationRequest, delay: float,
                   start: float) -> Seen:
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    sent = last = time.perf_counter()
    seen = Seen()
    async for out in engine.generate(request):
        now = time.perf_counter()
        if out.token_ids:
            if not seen.tokens:
                seen.ttft = now - sent
            else:
                seen.gaps.append(now - last)
            last = now
            seen.tokens += out.token_ids
    return seen


def serve(engine: LLMEngine, requests: list[GenerationRequest],
          delays: list[float]) -> tuple[list[Seen], float]:
    """Send `requests` at `delays` (seconds from the start); their views and the makespan."""
    async def work():
        start = time.perf_counter()
        seen = await asyncio.gather(*(_consume(engine, r, d, start)
                                      for r, d in zip(requests, delays)))
        return seen, time.perf_counter() - start

    return run_beside(engine, work)


def peak_running(engine: LLMEngine) -> list[int]:
    counts, run = [], engine.executor.run

    def counting(batch):
        counts.append(len(engine.scheduler.running))
        return run(batch)

    engine.executor.run = counting
    return counts


def ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def _outputs_equal(outputs: dict[str, list], rows: list[dict]) -> None:
    """Mark `rows` with whether every engine gave the same tokens ("-" with one engine)."""
    same = len({str(o) for o in outputs.values()}) == 1
    for row in rows:
        row["outputs equal"] = "-" if len(outputs) < 2 else "yes" if same else "NO"


def prefix_workload(model, args, rows: Rows, budget: Budget) -> None:
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    shared = rng.integers(4, vocab, args.prefix).tolist()
    requests = [GenerationRequest(
        f"r{i}", shared + rng.integers(4, vocab, int(rng.integers(16, 65))).tolist(),
        SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
        for i in range(args.num_requests)]
    c = model.config
    slot_bytes = args.max_batch * c.max_position_embeddings * PagedKVCache.block_bytes(
        c.num_layers, 1, c.num_kv_heads, c.head_dim, torch.float32)
    per_block = PagedKVCache.block_bytes(c.num_layers, 16, c.num_kv_heads, c.head_dim,
                                         torch.float32)
    engines = {"wave 1 (slots)": dict(max_batch=args.max_batch, kv=KVCacheConfig(kind="slots")),
               # the same pool without sharing: what the blocks alone give
               "paged, no prefix cache": dict(max_batch=args.paged_max_batch, kv=KVCacheConfig(
                   num_blocks=slot_bytes // per_block, prefix_caching=False)),
               "paged + prefix": dict(max_batch=args.paged_max_batch,
                                      kv=KVCacheConfig(num_blocks=slot_bytes // per_block))}
    for rate in args.rate:
        gaps = rng.exponential(1 / rate, len(requests)) if rate != float("inf") else \
            np.zeros(len(requests))
        delays = np.cumsum(gaps).tolist()
        outputs, measured = {}, []
        for name, kwargs in engines.items():
            if rows.rows and budget.skips(f"{name} at {rate:g} req/s"):
                continue
            with LLMEngine(model, background=False, max_step_tokens=args.step_tokens,
                           **kwargs) as engine:
                serve(engine, requests[:2], [0.0, 0.0])  # warm-up (also warms the prefix)
                counts = peak_running(engine)
                before = engine.stats()
                seen, span = serve(engine, requests, delays)
                stats = engine.stats()
            outputs[name] = [s.tokens for s in seen]
            gaps_all = [g for s in seen for g in s.gaps]
            queried = stats.get("prefix_cache_queries_tokens_total", 0) - before.get(
                "prefix_cache_queries_tokens_total", 0)
            hits = stats.get("prefix_cache_hits_tokens_total", 0) - before.get(
                "prefix_cache_hits_tokens_total", 0)
            measured.append(rows.add({
                "rate req/s": rate, "engine": name,
                "out tok/s": round(sum(len(s.tokens) for s in seen) / span, 1),
                "TTFT p50/p99 ms": f"{ms([s.ttft for s in seen], 50):.0f}/"
                                   f"{ms([s.ttft for s in seen], 99):.0f}",
                "ITL p50/p99 ms": f"{ms(gaps_all, 50):.1f}/{ms(gaps_all, 99):.1f}",
                "max running": max(counts, default=0),
                "prefix hit rate": f"{hits / queried:.0%}" if queried else "-",
                "prefilled tokens": int(stats["computed_tokens_total"]
                                        - before["computed_tokens_total"]),
                "preempted": int(stats["preemptions_total"] - before["preemptions_total"])}))
        _outputs_equal(outputs, measured)


def chunked_workload(model, args, rows: Rows, budget: Budget) -> None:
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    decoders = [GenerationRequest(f"d{i}", rng.integers(4, vocab, 16).tolist(),
                                  SamplingParams(max_tokens=args.decode_tokens, temperature=0,
                                                 ignore_eos=True))
                for i in range(args.decoders)]
    long = GenerationRequest("long", rng.integers(4, vocab, args.long_prompt).tolist(),
                             SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    outputs = {}
    for name, step_tokens in ((f"chunked ({args.chunk}/step)", args.chunk),
                              ("not chunked", args.long_prompt + args.decoders)):
        if rows.rows and budget.skips(f"prefill {name}"):
            break
        with LLMEngine(model, background=False, max_batch=args.decoders + 1,
                       max_step_tokens=step_tokens) as engine:
            serve(engine, decoders[:1], [0.0])  # warm-up
            # The long prompt arrives once the decoders are well into decoding.
            seen, span = serve(engine, decoders + [long], [0.0] * args.decoders + [args.arrive])
        outputs[name] = [s.tokens for s in seen]
        window = [g for s in seen[:-1] for g in s.gaps]
        rows.add({"prefill": name, "long prompt": args.long_prompt,
                  "decoders": args.decoders,
                  "decoder ITL p50/p99/max ms": f"{ms(window, 50):.1f}/{ms(window, 99):.1f}/"
                                                f"{max(window) * 1000:.0f}",
                  "long prompt TTFT ms": round(seen[-1].ttft * 1000),
                  "wall s": round(span, 2)})
    _outputs_equal(outputs, rows.rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("prefix", "chunked", "both"), default="both")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, nargs="+", default=[8.0, float("inf")])
    p.add_argument("--prefix", type=int, default=512, help="shared prompt tokens")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=8, help="wave-1 slots")
    p.add_argument("--paged-max-batch", type=int, default=48)
    p.add_argument("--step-tokens", type=int, default=512)
    p.add_argument("--decoders", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--long-prompt", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--arrive", type=float, default=0.3, help="seconds before the long prompt")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget: no engine or workload starts once it is spent")
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)
    torch.manual_seed(0)
    config = ModelConfig.from_name("llama-tiny", hidden_size=args.hidden, num_layers=args.layers,
                                   num_heads=8, num_kv_heads=2, ffn_hidden_size=4 * args.hidden,
                                   vocab_size=2048, max_position_embeddings=args.context,
                                   init_std=0.05)
    model = build_model(config, seed=0).eval()
    header = (f"CPU ISA: {cpu_isa()}; {torch.get_num_threads()} threads; model llama "
              f"hidden {args.hidden} x {args.layers} layers, GQA 8/2, fp32, context {args.context}")
    print(header, flush=True)
    if args.workload in ("prefix", "both"):
        rows = Rows("serving_paged")
        prefix_workload(model, args, rows, budget)
        print(f"\n{header}\nshared prefix {args.prefix} tokens + 16-64 unique, "
              f"{args.max_tokens} new, {args.num_requests} requests")
        rows.finish()
    if args.workload in ("chunked", "both") and not (
            args.workload == "both" and budget.skips("the chunked-prefill workload")):
        rows = Rows("serving_chunked_prefill")
        chunked_workload(model, args, rows, budget)
        print(f"\n{header}")
        rows.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
