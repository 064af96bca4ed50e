"""Structured outputs: the grammar's cost per output token beside unconstrained decoding.

The in-process engine (the step loop on this thread, the client beside it, as `tessera serve`
runs them) serves the same prompts twice per round: constrained by a JSON schema (xgrammar
masks, filled in a worker thread while the forward pass runs), then unconstrained with each
request's `max_tokens` set to the length its constrained output had (`ignore_eos`), so both
produce the same number of tokens. Rounds are interleaved and the best of `--repeats` is kept.

Reported per concurrency (requests running at once): seconds per output token of each, their
ratio (the goal: under 1.10 at 16), and the grammar's extra microseconds per token. The model
has random weights (the cost of masking does not depend on what the model learned), the
tokenizer is trained here (no download).

    python bench/bench_structured.py                     # concurrency 1 and 16
    python bench/bench_structured.py --hidden 512 --layers 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, machine  # noqa: E402

from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.cpu_isa import cpu_isa  # noqa: E402
from tessera.core.tokenizer import train_tokenizer  # noqa: E402
from tessera.serving.engine import LLMEngine, run_beside  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams, StructuredOutput  # noqa: E402

# A realistic mix: a record, an order with items, a tool call, a nested config.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 120},
        "email": {"type": "string", "maxLength": 24}, "active": {"type": "boolean"}},
     "required": ["name", "age", "active"], "additionalProperties": False},
    {"type": "object", "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "maxLength": 8},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]}},
     "required": ["order_id", "items", "status"], "additionalProperties": False},
    {"type": "object", "properties": {
        "name": {"const": "get_weather"}, "arguments": {
            "type": "object", "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}},
     "required": ["name", "arguments"], "additionalProperties": False},
    {"type": "object", "properties": {
        "server": {"type": "object", "properties": {
            "host": {"type": "string", "maxLength": 16},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "tls": {"type": "boolean"}}, "required": ["host", "port"],
            "additionalProperties": False},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
     "required": ["server", "ratio"], "additionalProperties": False},
]


def tokenizer(directory: Path):
    """A 512-piece sentencepiece model trained on Python's own sources (no download)."""
    texts = [Path(m.__file__).read_text() for m in (argparse, json)]
    return train_tokenizer([], 512, directory / "tokenizer.model", texts=texts, num_threads=1)


def serve(engine: LLMEngine, requests: list[GenerationRequest]) -> tuple[list[int], float]:
    """Each request's number of output tokens, and the wall time of the whole batch."""
    async def one(request):
        n = 0
        async for out in engine.generate(request):
            n += len(out.token_ids) + (1 if out.finish_reason == "stop" else 0)  # EOS counts
        return n

    async def work():
        return await asyncio.gather(*(one(r) for r in requests))

    tic = time.perf_counter()
    counts = run_beside(engine, work)
    return counts, time.perf_counter() - tic


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests-per-slot", type=int, default=2,
                   help="requests per running slot (at least 4 in all)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved rounds of each; the best is reported")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget: no further concurrency starts once it is spent")
    args = p.parse_args(argv)
    budget, rows = Budget(args.budget_s), Rows("structured")
    if args.threads:
        torch.set_num_threads(args.threads)
    isa = cpu_isa()
    print(f"host: {machine()}\nCPU ISA: {isa}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizer(Path(tmp))
    heads = max(args.hidden // 64, 1)
    model = build_model(ModelConfig.from_name(
        "llama-tiny", vocab_size=512, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=heads, num_kv_heads=heads, ffn_hidden_size=args.hidden * 3,
        max_position_embeddings=1024, init_std=0.3), seed=0).eval()
    prompt = tok.encode("Reply with JSON only:", bos=True)
    for concurrency in args.concurrency:
        if rows.rows and budget.skips(f"concurrency {concurrency}"):
            break
        n = max(concurrency * args.requests_per_slot, 4)
        constrained = [GenerationRequest(f"c{i}", prompt, SamplingParams(
            max_tokens=args.max_tokens, temperature=1.0, seed=i,
            structured=StructuredOutput("json_schema", SCHEMAS[i % len(SCHEMAS)])))
            for i in range(n)]
        engine = LLMEngine(model, tok, max_batch=concurrency, background=False,
                           max_step_tokens=1024, seed=0)
        serve(engine, constrained[:2])  # warm-up: the tokenizer's grammar tables, compiles
        best_c = best_u = float("inf")
        total = 0
        for _ in range(args.repeats):
            counts, seconds = serve(engine, constrained)
            best_c, total = min(best_c, seconds), sum(counts)
            plain = [GenerationRequest(f"u{i}", prompt, SamplingParams(
                max_tokens=c, temperature=1.0, seed=i, ignore_eos=True))
                for i, c in enumerate(counts)]
            _, seconds = serve(engine, plain)
            best_u = min(best_u, seconds)
        engine.shutdown()
        per_c, per_u = best_c / total, best_u / total
        rows.add({"concurrency": concurrency, "requests": n, "output tokens": total,
                  "s/token constrained": per_c, "s/token unconstrained": per_u,
                  "ratio": per_c / per_u, "grammar us/token": (per_c - per_u) * 1e6,
                  "model": f"{args.layers}x{args.hidden}", "CPU ISA": isa.name})
    return rows.finish()


if __name__ == "__main__":
    main()
