"""Training throughput: Tessera vs Hugging Face `transformers`, same Llama, same batch, same step.

One step = forward, backward and an AdamW update, single process, each side with its own
default optimizer (both fused AdamW). Rows: fp32, bf16 autocast (fp32 master weights) and pure
bf16 weights; "default" runs each library as it comes (Tessera compiles its fused elementwise
kernels, HF runs eager), "compiled" puts both whole models under `torch.compile`. Tessera's
achieved FLOP/s is counted as Megatron does (`model_flops_per_token`) and divided by this
machine's measured matmul peak in the same dtype.

    python bench/bench_train.py [--layers 4 --hidden 512 --seq 256 --batch 8 --steps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import best_time, matmul_peak_tflops, record  # noqa: E402

from tessera.converters.hf_mapping import config_to_hf  # noqa: E402
from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.flops import model_flops_per_token  # noqa: E402
from tessera.training.config import TrainConfig  # noqa: E402
from tessera.training.optim import build_optimizer, param_groups  # noqa: E402


def _config(args) -> ModelConfig:
    if args.preset:
        return ModelConfig.from_name(args.preset, max_position_embeddings=args.seq)
    return ModelConfig.from_name(
        "llama-tiny", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64,
        ffn_hidden_size=int(args.hidden * 8 / 3) // 64 * 64,
        max_position_embeddings=args.seq)


def _hf_model(config: ModelConfig, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = config_to_hf(config)
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **{
        k: v for k, v in hf.items() if k not in ("architectures", "torch_dtype", "dtype")})
    hf_config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(hf_config).to(dtype).train()


def _optimizer(model, hf: bool) -> torch.optim.Optimizer:
    """Each side's own default: Tessera's `build_optimizer`, and what the HF `Trainer` builds
    by default on torch >= 2.8 (`adamw_torch_fused`), with the same hyperparameters."""
    cfg = TrainConfig()
    if not hf:
        return build_optimizer([model], cfg)
    return torch.optim.AdamW(param_groups([model], cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, fused=True)


def _step_fn(model, ids, labels, autocast: torch.dtype | None, hf: bool):
    optimizer = _optimizer(model, hf)
    device = ids.device.type

    def step():
        ctx = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss if hf else model(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run(args) -> list[dict]:
    torch.manual_seed(0)
    config = _config(args)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=args.device)
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    tokens = args.batch * args.seq
    flops = model_flops_per_token(config, args.seq)
    model_label = (f"{args.preset or 'llama'} h{config.hidden_size} L{config.num_layers} "
                   f"b{args.batch}x{args.seq}")
    rows = []
    cases = (("fp32", torch.float32, None),
             ("bf16 mixed (fp32 master)", torch.float32, torch.bfloat16),
             ("bf16 pure", torch.bfloat16, None))
    for label, weights, autocast in cases[1:] if args.device == "cuda" else cases:
        peak = matmul_peak_tflops(autocast or weights, args.device)
        for mode in ("default", "compiled") if args.compile else ("default",):
            ours = build_model(config, dtype=weights, device=args.device).train()
            theirs = _hf_model(config, weights).to(args.device)
            if mode == "compiled":  # both sides, so the ratio compares like with like
                ours.compile()
                theirs.compile()
            t_ours = best_time(_step_fn(ours, ids, labels, autocast, False), args.steps)
            t_hf = best_time(_step_fn(theirs, ids, labels, autocast, True), args.steps)
            achieved = flops * tokens / t_ours / 1e12
            rows.append({"precision": f"{label}, {mode}", "model": model_label,
                         "tessera tok/s": tokens / t_ours,
                         "HF tok/s": tokens / t_hf, "ratio (target >= 1.15)": t_hf / t_ours,
                         "tessera TFLOP/s": achieved, "matmul peak TFLOP/s": peak,
                         "fraction of peak": achieved / peak})
            del ours, theirs
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--preset", default=None, help="a model preset instead of the sizes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure both models under torch.compile")
    parser.add_argument("--name", default=None, help="results name (default: train[-device])")
    args = parser.parse_args(argv)
    record(run(args), args.name or ("train" if args.device == "cpu" else f"train-{args.device}"))


if __name__ == "__main__":
    main()
