"""Speculative decoding on a repetitive-text workload: none vs n-gram vs draft model, one run.

Random weights would make acceptance meaningless (a random model follows neither its prompt
nor another random model), so this first trains, briefly and in this process, a target and a
smaller draft on the same synthetic corpus: text from a low-entropy Markov chain (each token
has a few likely successors), which both models learn well in a few hundred steps. The
workload's prompts are such text with a passage repeated (prompt lookup's best case, as in
code editing or retrieval answers); the engine serves `--concurrency` requests at once
(greedy, and sampled at temperature 0.7), on the in-process engine (no HTTP; the step loop on
the main thread, the client beside it, as `tessera serve` runs them).

Reported per method: output tokens/s, speedup over no speculation, acceptance rate (accepted /
drafted tokens), mean tokens per verified row, and whether greedy outputs equal the plain ones.
A mode's rows are printed once its interleaved runs are done; `--budget-s` (training included)
stops starting modes once spent.

    python bench/bench_speculative.py                     # the table in docs/benchmarks.md
    python bench/bench_speculative.py --k 2 4 --steps 300
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, machine  # noqa: E402

from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.cpu_isa import cpu_isa  # noqa: E402
from tessera.serving.engine import LLMEngine, run_beside  # noqa: E402
from tessera.serving.engine.speculative import SpeculativeConfig  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402

VOCAB = 512


def markov_chain(seed: int = 0, successors: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `successors` next tokens and their probabilities (peaked: ~0.8 on one)."""
    g = torch.Generator().manual_seed(seed)
    nexts = torch.randint(3, VOCAB, (VOCAB, successors), generator=g)
    probs = torch.tensor([0.8] + [0.2 / (successors - 1)] * (successors - 1))
    return nexts, probs.expand(VOCAB, successors)


def sample_text(chain, n: int, length: int, g: torch.Generator) -> torch.Tensor:
    nexts, probs = chain
    out = torch.empty(n, length, dtype=torch.long)
    out[:, 0] = torch.randint(3, VOCAB, (n,), generator=g)
    for t in range(1, length):
        pick = torch.multinomial(probs[out[:, t - 1]], 1, generator=g).squeeze(1)
        out[:, t] = nexts[out[:, t - 1], pick]
    return out


def train(model, chain, steps: int, seed: int, batch: int = 8, seq: int = 64) -> float:
    """A few hundred AdamW steps on chain text; returns the last loss."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        ids = sample_text(chain, batch, seq + 1, g)
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss = loss.mean() if loss.ndim else loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def workload(chain, args) -> list[GenerationRequest]:
    """Prompts: chain text with a passage repeated, then the passage's start again."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(args.requests):
        passage = sample_text(chain, 1, args.passage, g)[0].tolist()
        intro = sample_text(chain, 1, 16, g)[0].tolist()
        prompt = intro + passage + intro[-4:] + passage + passage[: args.passage // 4]
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                temperature=0.0 if args.mode == "greedy" else 0.7, seed=i)
        out.append(GenerationRequest(f"r{i}", prompt, params))
    return out


def serve(engine: LLMEngine, requests: list[GenerationRequest]) -> tuple[list[list[int]], float]:
    import asyncio

    async def one(request):
        ids = []
        async for out in engine.generate(request):
            ids.extend(out.token_ids)
        return ids

    async def work():
        return await asyncio.gather(*(one(r) for r in requests))

    tic = time.perf_counter()
    outputs = run_beside(engine, work)
    return outputs, time.perf_counter() - tic


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="training steps of each model")
    p.add_argument("--k", type=int, nargs="+", default=[4], help="draft tokens per step")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="max_batch of the engine")
    p.add_argument("--passage", type=int, default=48, help="tokens of the repeated passage")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--modes", nargs="+", default=["greedy", "sampled"])
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each method, interleaved; the best is reported")
    p.add_argument("--weights", default=None, metavar="FILE",
                   help="keep the trained weights here and reuse them on the next run")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget (training included): no mode starts once it is spent")
    args = p.parse_args(argv)
    budget, rows = Budget(args.budget_s), Rows("speculative")
    # Training here only makes the weights meaningful: eager kernels, no compile wait.
    os.environ.setdefault("TESSERA_FUSED_KERNELS", "off")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"host: {machine()}\nCPU ISA: {cpu_isa()}", flush=True)
    chain = markov_chain()
    target = build_model(ModelConfig.from_name("llama-tiny", hidden_size=192, num_layers=4,
                                               num_heads=6, num_kv_heads=2, ffn_hidden_size=576,
                                               max_position_embeddings=512), seed=0)
    draft = build_model(ModelConfig.from_name("llama-tiny", hidden_size=64, num_layers=1,
                                              max_position_embeddings=512), seed=1)
    tic = time.perf_counter()
    if args.weights and Path(args.weights).exists():
        saved = torch.load(args.weights)
        target.load_state_dict(saved["target"])
        draft.load_state_dict(saved["draft"])
        losses = saved["losses"]
        target.eval()
        draft.eval()
    else:
        losses = [train(target, chain, args.steps, seed=1),
                  train(draft, chain, args.steps, seed=2)]
        if args.weights:
            torch.save({"target": target.state_dict(), "draft": draft.state_dict(),
                        "losses": losses}, args.weights)
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    print(f"target {n_target / 1e6:.2f}M params (loss {losses[0]:.3f}), draft "
          f"{n_draft / 1e6:.2f}M (loss {losses[1]:.3f}), {args.steps} training steps each "
          f"({time.perf_counter() - tic:.0f} s)", flush=True)
    isa = cpu_isa().name
    for mode in args.modes:
        if rows.rows and budget.skips(f"mode {mode}"):
            break
        args.mode = mode
        requests = workload(chain, args)
        configs: list[tuple[str, SpeculativeConfig | None]] = [("none", None)]
        for k in args.k:
            configs += [(f"ngram k={k}", SpeculativeConfig("ngram", k)),
                        (f"draft k={k}", SpeculativeConfig("draft", k, draft_model=draft))]
        engines = [LLMEngine(target, max_batch=args.concurrency, background=False,
                             max_step_tokens=1024, speculative=config) for _, config in configs]
        for engine in engines:
            serve(engine, requests[:2])  # warm-up
        best = [float("inf")] * len(configs)
        counts = [(0, 0, 0)] * len(configs)
        outputs: list = [None] * len(configs)
        for _ in range(args.repeats):  # interleaved: load changes hit every method alike
            for i, engine in enumerate(engines):
                before = engine.stats()
                outputs[i], seconds = serve(engine, requests)
                after = engine.stats()
                best[i] = min(best[i], seconds)
                counts[i] = tuple(after[key] - before[key] for key in (
                    "spec_draft_tokens_total", "spec_accepted_tokens_total",
                    "spec_verify_steps_total"))
        for engine in engines:
            engine.shutdown()
        base = sum(len(o) for o in outputs[0]) / best[0]
        for (name, _), seconds, (drafted, accepted, verified), out in zip(configs, best, counts,
                                                                          outputs):
            speed = sum(len(o) for o in out) / seconds
            row = {"mode": mode, "speculation": name, "tokens/s": speed,
                   "speedup": speed / base,
                   "acceptance": accepted / drafted if drafted else float("nan"),
                   "tokens/verified row": ((accepted + verified) / verified
                                           if verified else float("nan")),
                   "CPU ISA": isa}
            if mode == "greedy":
                row["= plain output"] = out == outputs[0]
            rows.add(row)
    return rows.finish()


if __name__ == "__main__":
    main()
