"""Mixture-of-Experts training throughput: Tessera vs Hugging Face `MixtralForCausalLM`, and
Tessera's grouped-GEMM experts vs its per-expert loop, side by side.

One step = forward, backward (the load-balancing loss included on both sides: HF with
`output_router_logits=True`) and an AdamW update, single process, same config, same batch, same
precision (fp32; bf16 autocast with fp32 master weights; pure bf16 weights). NOTE: under bf16
autocast transformers 5.x runs its experts in fp32 (`torch._grouped_mm` is not autocast-enabled,
so it casts the input to the fp32 weights), while Tessera's experts follow autocast (bf16); on a
CPU without native bf16 matrix units (AVX2) fp32 products are the faster ones, so that row
compares different arithmetic. The pure-bf16 row compares like with like. Rows:
- `tessera grouped`: experts through `torch._grouped_mm` (one call for all experts);
- `tessera loop`: the per-expert `F.linear` loop (the fallback);
- `hf`: transformers' Mixtral (its own per-hit-expert loop over fused expert weights).
A second table times the expert block alone (forward + backward of 8 experts on the token
copies of one layer), grouped vs loop. The CPU's instruction set is printed with the figures.
Each precision's (dtype's) rows are printed once measured; `--budget-s` stops starting
precisions, dtypes and the second table once spent.

    python bench/bench_moe.py [--layers 2 --hidden 256 --ffn 512 --experts 8 --seq 128 --batch 4]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, best_time  # noqa: E402

from tessera.converters.hf_mapping import config_to_hf  # noqa: E402
from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.moe.experts import GroupedExperts  # noqa: E402
from tessera.core.moe.layer import MoEFeedForward  # noqa: E402


def _config(args) -> ModelConfig:
    return ModelConfig.from_name(
        "mixtral-tiny", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64, ffn_hidden_size=args.ffn,
        moe={"num_experts": args.experts, "top_k": args.top_k},
        max_position_embeddings=args.seq)


def _hf_model(config: ModelConfig):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = config_to_hf(config)
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **{
        k: v for k, v in hf.items() if k not in ("architectures", "torch_dtype", "dtype")})
    hf_config._attn_implementation = "sdpa"
    hf_config.output_router_logits = True  # its aux loss, as Tessera always computes it
    return AutoModelForCausalLM.from_config(hf_config).train()


def _step_fn(model, ids, autocast: torch.dtype | None, hf: bool):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)

    def step():
        ctx = torch.autocast(ids.device.type, dtype=autocast) if autocast else (
            contextlib.nullcontext())
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss if hf else model(ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _set_grouped(model, grouped: bool) -> None:
    for m in model.modules():
        if isinstance(m, MoEFeedForward):
            m.experts.use_grouped_mm = grouped


def run_training(args, rows: Rows, budget: Budget, isa: str) -> None:
    config = _config(args)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0))
    tokens = args.batch * args.seq
    for precision, autocast, dtype in (("fp32", None, torch.float32),
                                       ("bf16 autocast", torch.bfloat16, torch.float32),
                                       ("bf16 weights", None, torch.bfloat16)):
        if rows.rows and budget.skips(f"training in {precision}"):
            break
        times = {}
        model = build_model(config, seed=0, dtype=dtype).train()
        for grouped in (True, False):
            _set_grouped(model, grouped)
            times["tessera grouped" if grouped else "tessera loop"] = best_time(
                _step_fn(model, ids, autocast, hf=False), repeats=args.steps)
        times["hf"] = best_time(_step_fn(_hf_model(config).to(dtype), ids, autocast, hf=True),
                                repeats=args.steps)
        for name, t in times.items():
            rows.add({"precision": precision, "side": name, "tokens/s": tokens / t,
                      "vs hf": times["hf"] / t, "isa": isa})


def run_experts(args, rows: Rows, budget: Budget, isa: str) -> None:
    n = args.batch * args.seq * args.top_k
    counts = torch.bincount(torch.randint(0, args.experts, (n,),
                                          generator=torch.Generator().manual_seed(1)),
                            minlength=args.experts)
    for dtype in (torch.float32, torch.bfloat16):
        if rows.rows and budget.skips(f"the expert block in {dtype}"):
            break
        experts = GroupedExperts(args.experts, args.hidden, args.ffn, "swiglu").to(dtype)
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.02)
        xs = torch.randn(n, args.hidden, dtype=dtype, requires_grad=True)
        times = {}
        for grouped in (True, False):
            experts.use_grouped_mm = grouped

            def fwd_bwd(experts=experts, xs=xs):
                experts(xs, counts).square().mean().backward()

            times[grouped] = best_time(fwd_bwd, repeats=args.steps)
        rows.add({"dtype": str(dtype).removeprefix("torch."), "copies": n,
                  "grouped ms": times[True] * 1e3, "loop ms": times[False] * 1e3,
                  "loop / grouped": times[False] / times[True], "isa": isa})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("layers", 2), ("hidden", 256), ("ffn", 512), ("experts", 8),
                          ("top-k", 2), ("seq", 128), ("batch", 4), ("vocab", 4096),
                          ("steps", 3)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget: nothing further starts once it is spent")
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"CPU ISA: {isa}; torch threads: {torch.get_num_threads()}", flush=True)
    rows = Rows("moe_train")
    run_training(args, rows, budget, isa)
    rows.finish()
    if budget.skips("the expert-block table"):
        return
    rows = Rows("moe_experts")
    run_experts(args, rows, budget, isa)
    rows.finish()


if __name__ == "__main__":
    main()
