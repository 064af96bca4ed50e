"""Generation: Tessera's engine against Hugging Face `generate` (KV cache) on the same model.

Rows, each printed as it is measured (`ROW generate... {json}`), cheapest first so that a short
`--budget-s` still gives the headline: single-stream decode tokens/s and time to first token;
the same request again (KV lengths the kernels have seen); continuous batching at the
`--concurrency` levels (16 first) against HF `generate` with a static batch of the same size.
Then, opt-in or last: weight-only int8 (CPU), the engine's compiled decode step (`--compile`,
`serving/engine/compiled.py`) and HF's own compiled path (`--hf-compile`, static cache). On CUDA
each row also gives the fraction of the HBM bound (tok/s if each token read every weight once
at the measured copy bandwidth).

Greedy, fixed output length (EOS ignored), same weights (the Tessera checkpoint is built on the
device in its dtype and exported to Hugging Face format in the same run). The engine's step loop
runs on the main thread, as `tessera serve` runs it, and HF `generate` runs there too: a torch
team on a second thread would slow both sides (see `serving.engine.bridge`).

Targets on the 2-core CPU: single-stream decode >= 2x HF; 16 concurrent >= 5x HF single-stream.

    python bench/bench_generate.py [--hidden 512 --layers 8 --prompt 64 --new 64]
    python bench/bench_generate.py --device cuda --preset llama-1b --prompt 128 --new 128 \\
        --budget-s 90
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, best_time, device_time  # noqa: E402

from tessera.core import ModelConfig, build_model, save_checkpoint  # noqa: E402
from tessera.serving.engine import LLMEngine, run_beside  # noqa: E402
from tessera.serving.engine.kv_config import KVCacheConfig  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402


def _config(args) -> ModelConfig:
    if args.preset:
        return ModelConfig.from_name(args.preset, max_position_embeddings=args.prompt + args.new + 8)
    return ModelConfig.from_name("llama-tiny", vocab_size=args.vocab, hidden_size=args.hidden,
                                 num_layers=args.layers, num_heads=max(1, args.hidden // 64),
                                 num_kv_heads=max(1, args.hidden // 256),
                                 ffn_hidden_size=args.hidden * 3,
                                 max_position_embeddings=args.prompt + args.new + 8)


def _timed(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call of `fn`: CUDA events on a GPU (`device_time`), else the wall clock."""
    return device_time(fn, steps=1, warmup=0, device=device)


async def _engine_run(engine: LLMEngine, prompts: list[list[int]], new: int,
                      ttft: list[float]) -> None:
    """All prompts together; appends the mean time to first token to `ttft`."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    first: list[float] = []
    tic = time.perf_counter()

    async def one(i: int, ids: list[int]) -> None:
        seen = False
        async for out in engine.generate(GenerationRequest(f"r{i}", ids, params)):
            if not seen and out.token_ids:
                first.append(time.perf_counter() - tic)
                seen = True

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    ttft.append(sum(first) / len(first))


def _ours(engine: LLMEngine, prompts: list[list[int]], new: int, device: str
          ) -> tuple[float, float]:
    """Seconds to generate `new` tokens for every prompt at once, and the mean TTFT."""
    ttft: list[float] = []
    seconds = _timed(lambda: run_beside(engine, lambda: _engine_run(engine, prompts, new, ttft)),
                     device)
    return seconds, ttft[-1]


def _hf(model, prompts: list[list[int]], new: int, device: str) -> tuple[float, float]:
    """HF `generate` of `new` tokens for the prompts as one static batch: seconds, and TTFT."""
    ids = torch.tensor(prompts, device=model.device)

    def generate(n: int) -> None:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)

    ttft = _timed(lambda: generate(1), device)
    return _timed(lambda: generate(new), device), ttft


def hbm_bandwidth() -> float:
    """Measured device memory bandwidth in bytes/s (a large copy reads and writes each byte)."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / best_time(lambda: b.copy_(a), repeats=5)


def _hf_compiled(model, prompt: list[int], new: int, device: str) -> float | None:
    """HF `generate` on its own compiled path (static cache, `torch.compile` of the forward),
    warmed up; decode tok/s, or None when it does not compile here."""
    from transformers import CompileConfig

    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = CompileConfig(fullgraph=False, dynamic=False)
    # transformers compiles on CUDA only unless told otherwise (a private switch, as of 5.x).
    model.generation_config.compile_config._compile_all_devices = True
    try:
        _hf(model, [prompt], new, device)  # compiles; the static cache's length is fixed by `new`
        _hf(model, [prompt], new, device)
        seconds, _ = _hf(model, [prompt], new, device)
        return new / seconds
    except Exception as exc:  # a peer that cannot compile here is reported, not fatal
        print(f"HF compiled generate failed: {exc}", file=sys.stderr)
        return None
    finally:
        model.generation_config.cache_implementation = None
        model.generation_config.compile_config = None


def run(args, rows: Rows) -> None:
    from transformers import AutoModelForCausalLM

    from tessera.converters.hf_io import export_hf

    budget = Budget(args.budget_s)
    torch.manual_seed(0)
    config = _config(args)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    work = Path(tempfile.mkdtemp(prefix="tessera-bench-gen-"))
    model = build_model(config, device=args.device, dtype=dtype, seed=0, backend="torch")
    ckpt = save_checkpoint(work / "ckpt", model)
    del model
    export_hf(ckpt, work / "hf")
    hf = AutoModelForCausalLM.from_pretrained(work / "hf", attn_implementation="sdpa",
                                              dtype=dtype, device_map=args.device).eval()
    cuda = args.device.startswith("cuda")
    # tok/s if every token read each weight once (a batch of n shares one read: n x this).
    bound = None
    if cuda:
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        bound = hbm_bandwidth() / weight_bytes

    def engine(**kwargs) -> LLMEngine:
        kv = KVCacheConfig(decode_attention=args.decode_attention)
        return LLMEngine.from_checkpoint(ckpt, max_batch=max(args.concurrency), dtype=dtype,
                                         device=args.device, kv=kv,
                                         max_step_tokens=max(args.concurrency) * args.prompt,
                                         background=False, **kwargs)

    gen = torch.Generator().manual_seed(1)

    def prompts(n: int) -> list[list[int]]:
        return torch.randint(3, config.vocab_size, (n, args.prompt), generator=gen).tolist()

    def add(row: dict, tok_s: float, steps_per_s: float | None = None) -> None:
        if bound is not None:
            row["fraction of bandwidth bound"] = (steps_per_s or tok_s) / bound
        rows.add(row)

    eager = engine()
    single = prompts(1)
    with torch.inference_mode():
        _hf(hf, single, 4, args.device)  # warm-up
        run_beside(eager, lambda: _engine_run(eager, single, 4, []))
        t_hf, ttft_hf = _hf(hf, single, args.new, args.device)
        hf_single, t_hf_single = args.new / t_hf, t_hf
        t_ours, ttft_ours = _ours(eager, single, args.new, args.device)
        add({"case": "single stream", "tessera tok/s": args.new / t_ours, "HF tok/s": hf_single,
             "ratio": t_hf / t_ours, "tessera TTFT s": ttft_ours, "HF TTFT s": ttft_hf},
            args.new / t_ours)
        if not budget.spent():
            # The same request again: every KV length was seen (kernel plans, allocations).
            t_hf2, _ = _hf(hf, single, args.new, args.device)
            t_ours2, _ = _ours(eager, single, args.new, args.device)
            add({"case": "single stream, same request again (lengths seen)",
                 "tessera tok/s": args.new / t_ours2, "HF tok/s": args.new / t_hf2,
                 "ratio": t_hf2 / t_ours2}, args.new / t_ours2)
        for n in sorted(args.concurrency, key=lambda n: (n != 16, n)):
            if budget.spent():
                break
            batch = prompts(n)
            t_hf, _ = _hf(hf, batch, args.new, args.device)
            t_ours, _ = _ours(eager, batch, args.new, args.device)
            add({"case": f"{n} concurrent (HF: static batch {n})",
                 "tessera tok/s": n * args.new / t_ours, "HF tok/s": n * args.new / t_hf,
                 "ratio": t_hf / t_ours, "vs HF single stream": n * args.new / t_ours / hf_single},
                n * args.new / t_ours, args.new / t_ours)
        for method, wanted in (("int8", args.int8 and not cuda), ("fp8", args.fp8)):
            if wanted and not budget.spent():
                _quantized_row(args, method, ckpt, single, eager, t_hf_single, ttft_hf, rows)
        compiled_single = None
        if args.compile and not budget.spent():
            compiled_single = _compiled_rows(args, engine, single, batch_of=prompts,
                                             hf_single=hf_single, add=add, budget=budget)
        if args.hf_compile and compiled_single is not None and not budget.spent():
            hf_fast = _hf_compiled(hf, single[0], args.new, args.device)
            if hf_fast is not None:
                add({"case": "single stream, both compiled (HF: static cache)",
                     "tessera tok/s": compiled_single, "HF tok/s": hf_fast,
                     "ratio": compiled_single / hf_fast}, compiled_single)
    eager.shutdown()
    if budget.spent():
        print(f"budget of {args.budget_s} s spent: later rows skipped", file=sys.stderr)


def _quantized_row(args, method: str, ckpt: Path, single: list[list[int]], eager: LLMEngine,
                   t_hf: float, ttft_hf: float, rows: Rows) -> None:
    """Quantized weights (core/quantize.py: int8 in bf16, fp8 in the run's dtype) against the
    same HF model: fewer weight bytes per token, so a different precision; the logit error is
    reported beside it."""
    dtype = torch.bfloat16 if method == "int8" else eager.executor.runner.dtype
    quantized = LLMEngine.from_checkpoint(ckpt, max_batch=1, dtype=dtype, device=args.device,
                                          quantize_with=method, background=False)
    run_beside(quantized, lambda: _engine_run(quantized, single, 4, []))
    t_q, ttft_q = _ours(quantized, single, args.new, args.device)
    ids = torch.tensor(single, device=args.device)
    reference = eager.executor.runner.stages[0](ids).float()
    error = (quantized.executor.runner.stages[0](ids).float() - reference).norm() \
        / reference.norm()
    rows.add({"case": f"single stream, Tessera {method} weights vs HF {args.dtype}",
              "tessera tok/s": args.new / t_q, "HF tok/s": args.new / t_hf,
              "ratio": t_hf / t_q, "tessera TTFT s": ttft_q, "HF TTFT s": ttft_hf,
              f"{method} logit error": float(error)})
    quantized.shutdown()


def _compiled_rows(args, engine: Callable[..., LLMEngine], single: list[list[int]],
                   batch_of: Callable[[int], list[list[int]]], hf_single: float,
                   add: Callable[..., None], budget: Budget) -> float | None:
    """The engine with its compiled decode step: single stream, then each concurrency level;
    returns its single-stream tok/s (None when it does not compile here)."""
    tic = time.perf_counter()
    try:
        compiled = engine(compile_decode=args.compile_backend)
    except Exception as exc:  # reported, the rest is measured
        print(f"compiled decode step failed on {args.device}: {exc!r}", file=sys.stderr)
        return None
    compile_s = time.perf_counter() - tic
    print(f"compiled the decode step in {compile_s:.0f} s", file=sys.stderr)
    run_beside(compiled, lambda: _engine_run(compiled, single, 4, []))
    t_ours, ttft = _ours(compiled, single, args.new, args.device)
    add({"case": "single stream, compiled decode", "tessera tok/s": args.new / t_ours,
         "HF tok/s": hf_single, "ratio": args.new / t_ours / hf_single, "tessera TTFT s": ttft,
         "compile s": compile_s}, args.new / t_ours)
    if not budget.spent():  # every KV length seen: a static-shape step should not care
        t_seen, _ = _ours(compiled, single, args.new, args.device)
        add({"case": "single stream, compiled decode, same request again (lengths seen)",
             "tessera tok/s": args.new / t_seen, "new / seen step time": t_ours / t_seen},
            args.new / t_seen)
    for n in sorted(args.concurrency, key=lambda n: (n != 16, n)):
        if budget.spent():
            break
        t_n, _ = _ours(compiled, batch_of(n), args.new, args.device)
        add({"case": f"{n} concurrent, compiled decode", "tessera tok/s": n * args.new / t_n,
             "vs HF single stream": n * args.new / t_n / hf_single},
            n * args.new / t_n, args.new / t_n)
    compiled.shutdown()
    return args.new / t_ours


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--preset", default=None, help="a model preset instead of the sizes")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new rows after this many seconds (rows measured "
                             "so far are reported)")
    parser.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure weight-only int8 decoding (CPU; after the eager rows)")
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure FP8 (e4m3, per-channel) decoding, W8A8 on Hopper "
                             "(default: on CUDA only; on CPU the weight is dequantized per "
                             "product, correct but not faster)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the engine with its compiled decode step (last)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="the compiled decode step's torch.compile backend (eager: Dynamo "
                             "only; static: the bucketed step uncompiled)")
    parser.add_argument("--decode-attention", choices=("gather", "flex"), default="gather",
                        help="the paged cache's one-token attention (core/paged_attention.py)")
    parser.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure HF's compiled generate (static cache), as a peer of "
                             "the compiled decode step (last)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="weights of both models (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--name", default=None, help="results name (default from device, dtype)")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.fp8 = cuda if args.fp8 is None else args.fp8
    name = "generate" if args.device == "cpu" else f"generate-{args.device}"
    if args.dtype != "fp32" and not cuda:
        name += "-bf16"
    rows = Rows(args.name or name)
    run(args, rows)
    return rows.finish()


if __name__ == "__main__":
    main()
