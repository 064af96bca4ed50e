"""Generation: Tessera's engine against Hugging Face `generate` (KV cache) on the same model.

Rows: single-stream decode tokens/s and time to first token; then aggregate throughput with
continuous batching at 1, 4, 16 and 64 concurrent requests against HF `generate` with a static
batch of the same size. Each Tessera row comes twice: the engine as it runs by default (eager),
and with its decode step compiled (`--compile`, `serving/engine/compiled.py`). HF's own compiled path
(static cache, compiled forward) is measured too, as the peer of the compiled decode step.
Greedy, fixed output length (EOS ignored), same weights (the Tessera
checkpoint is exported to Hugging Face format in the same run). The engine's step loop runs on
the main thread, as `tessera serve` runs it, and HF `generate` runs there too: a torch team on a
second thread would slow both sides (see `serving.engine.bridge`).

Targets on the 2-core CPU: single-stream decode >= 2x HF; 16 concurrent >= 5x HF single-stream.

    python bench/bench_generate.py [--hidden 512 --layers 8 --prompt 64 --new 64]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import record  # noqa: E402

from tessera.core import ModelConfig, build_model, save_checkpoint  # noqa: E402
from tessera.serving.engine import LLMEngine, run_beside  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402


def _config(args) -> ModelConfig:
    if args.preset:
        return ModelConfig.from_name(args.preset, max_position_embeddings=args.prompt + args.new + 8)
    return ModelConfig.from_name("llama-tiny", vocab_size=8000, hidden_size=args.hidden,
                                 num_layers=args.layers, num_heads=args.hidden // 64,
                                 num_kv_heads=max(1, args.hidden // 256),
                                 ffn_hidden_size=args.hidden * 3,
                                 max_position_embeddings=args.prompt + args.new + 8)


async def _engine_run(engine: LLMEngine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """Wall seconds for all prompts together, and the mean time to first token."""
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
    return time.perf_counter() - tic, sum(first) / len(first)


def _hf_run(model, prompts: list[list[int]], new: int) -> tuple[float, float]:
    ids = torch.tensor(prompts, device=model.device)
    tic = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                   min_new_tokens=1, pad_token_id=0)
    ttft = time.perf_counter() - tic
    tic = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                   min_new_tokens=new, do_sample=False, pad_token_id=0)
    return time.perf_counter() - tic, ttft


def hbm_bandwidth() -> float:
    """Measured device memory bandwidth in bytes/s (a large copy reads and writes each byte)."""
    from _common import best_time

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / best_time(lambda: b.copy_(a), repeats=5)


def _hf_compiled(model, prompt: list[int], new: int) -> float | None:
    """HF `generate` on its own compiled path (static cache, `torch.compile` of the forward),
    warmed up; decode tok/s, or None when it does not compile here."""
    from transformers import CompileConfig

    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = CompileConfig(fullgraph=False, dynamic=False)
    # transformers compiles on CUDA only unless told otherwise (a private switch, as of 5.x).
    model.generation_config.compile_config._compile_all_devices = True
    try:
        _hf_run(model, [prompt], new)  # compiles; the static cache's length is fixed by `new`
        _hf_run(model, [prompt], new)
        seconds, _ = _hf_run(model, [prompt], new)
        return new / seconds
    except Exception as exc:  # a peer that cannot compile here is reported, not fatal
        print(f"HF compiled generate failed: {exc}", file=sys.stderr)
        return None
    finally:
        model.generation_config.cache_implementation = None
        model.generation_config.compile_config = None


def run(args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from tessera.converters.hf_io import export_hf

    torch.manual_seed(0)
    config = _config(args)
    work = Path(tempfile.mkdtemp(prefix="tessera-bench-gen-"))
    ckpt = save_checkpoint(work / "ckpt", build_model(config, seed=0))
    export_hf(ckpt, work / "hf")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    hf = AutoModelForCausalLM.from_pretrained(work / "hf", attn_implementation="sdpa",
                                              dtype=dtype).to(args.device).eval()

    def engine(**kwargs) -> LLMEngine:
        return LLMEngine.from_checkpoint(ckpt, max_batch=max(args.concurrency), dtype=dtype,
                                         device=args.device,
                                         max_step_tokens=max(args.concurrency) * args.prompt,
                                         background=False, **kwargs)

    engines = {"": engine()}
    if args.compile:
        tic = time.perf_counter()
        try:
            engines[", compiled decode"] = engine(compile_decode=True)
            print(f"compiled the decode step in {time.perf_counter() - tic:.0f} s",
                  file=sys.stderr)
        except Exception as exc:  # never run on CUDA yet: report it, measure the rest
            print(f"compiled decode step failed on {args.device}: {exc!r}", file=sys.stderr)
    gen = torch.Generator().manual_seed(1)

    def prompts(n: int) -> list[list[int]]:
        return torch.randint(3, config.vocab_size, (n, args.prompt), generator=gen).tolist()

    rows = []
    with torch.inference_mode():
        single = prompts(1)
        _hf_run(hf, single, 4)  # warm-up
        t_hf, ttft_hf = _hf_run(hf, single, args.new)
        hf_single = args.new / t_hf
        for label, eng in engines.items():
            run_beside(eng, lambda e=eng: _engine_run(e, single, 4))  # warm-up
            t_ours, ttft_ours = run_beside(eng, lambda e=eng: _engine_run(e, single, args.new))
            row = {"case": f"single stream{label}", "tessera tok/s": args.new / t_ours,
                   "HF tok/s": hf_single, "ratio": t_hf / t_ours,
                   "tessera TTFT s": ttft_ours, "HF TTFT s": ttft_hf}
            if args.device == "cuda":
                weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
                bound = hbm_bandwidth() / weight_bytes  # tok/s if a token reads every weight once
                row["fraction of bandwidth bound"] = args.new / t_ours / bound
            rows.append(row)
        if len(engines) > 1 and args.hf_compile:
            # Both compiled: HF's own compiled generate against Tessera's compiled decode.
            hf_fast = _hf_compiled(hf, single[0], args.new)
            if hf_fast is not None:
                ours = rows[-1]["tessera tok/s"]
                rows.append({"case": "single stream, both compiled (HF: static cache)",
                             "tessera tok/s": ours, "HF tok/s": hf_fast,
                             "ratio": ours / hf_fast})
        if args.device == "cpu" and args.int8:
            # Weight-only int8 (core/quantize.py) against the same HF model: fewer weight bytes
            # per token, so a different precision; the logit error is reported beside it.
            quantized = LLMEngine.from_checkpoint(ckpt, max_batch=1, dtype=torch.bfloat16,
                                                  quantize_with="int8", background=False)
            run_beside(quantized, lambda: _engine_run(quantized, single, 4))
            t_q, ttft_q = run_beside(quantized, lambda: _engine_run(quantized, single, args.new))
            ids = torch.tensor(single)
            reference = engines[""].executor.runner.stages[0](ids).float()
            error = (quantized.executor.runner.stages[0](ids).float() - reference).norm() \
                / reference.norm()
            rows.append({"case": f"single stream, Tessera int8 weights vs HF {args.dtype}",
                         "tessera tok/s": args.new / t_q, "HF tok/s": hf_single,
                         "ratio": t_hf / t_q, "tessera TTFT s": ttft_q, "HF TTFT s": ttft_hf,
                         "int8 logit error": float(error)})
            quantized.shutdown()
        for n in args.concurrency:
            batch = prompts(n)
            t_hf, _ = _hf_run(hf, batch, args.new)
            for label, eng in engines.items():
                t_ours, _ = run_beside(eng, lambda e=eng, b=batch: _engine_run(e, b, args.new))
                rows.append({"case": f"{n} concurrent{label} (HF: static batch {n})",
                             "tessera tok/s": n * args.new / t_ours,
                             "HF tok/s": n * args.new / t_hf, "ratio": t_hf / t_ours,
                             "vs HF single stream": n * args.new / t_ours / hf_single})
    for eng in engines.values():
        eng.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--preset", default=None, help="a model preset instead of the sizes")
    parser.add_argument("--int8", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure weight-only int8 decoding (CPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the engine with its compiled decode step")
    parser.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure HF's compiled generate (static cache), as a peer of "
                             "the compiled decode step")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="weights of both models (default: fp32 on CPU, bf16 on CUDA)")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    name = "generate" if args.device == "cpu" else f"generate-{args.device}"
    record(run(args), name if args.dtype == "fp32" or args.device == "cuda" else f"{name}-bf16")


if __name__ == "__main__":
    main()
