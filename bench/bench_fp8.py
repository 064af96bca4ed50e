"""FP8 linear layers against bf16 on the layer shapes of real models: TFLOP/s of the bf16 matmul
and of three FP8 modes, their ratios to bf16, and the FP8 relative error against fp32.

Modes (e4m3 weights quantized beforehand, as a loaded FP8 model holds them):
- `gemm`: `torch._scaled_mm` alone, on an input quantized beforehand (the kernel's ceiling);
- `quant+gemm`: the input quantized eagerly (amax, scale, cast as separate passes), then the GEMM;
- `fused`: what the `Fp8` weight format runs: the input quantized by the compiled one-pass
  quantizer (`core.fp8_activation`), then the GEMM with fast accumulation.
Shapes: each block linear of the model as it runs it (fused QKV, attention output, fused
gate/up with N = 2 x ffn, down) at M tokens. Meaningful on FP8 GPUs (Hopper: H100/H200); on CPU
`_scaled_mm` is a slow reference kernel, so the CPU rows use a small model.

`--train`: one training step (forward, backward, AdamW) of a model with its block linears in FP8
(`enable_fp8_training`, `--fp8-recipe`: tensorwise current scaling by default, or rowwise or
delayed; torchao or TE when it imports and offers the recipe, else Tessera's own path, which
on FP8 GPUs runs `torch._scaled_mm`) against the same model in bf16 autocast, from the same
initial weights on the same batch: step time, speedup and the loss curves' distance.

    python bench/bench_fp8.py [--device cuda] [--budget-s 60] [--tiny] [--models llama-1b,...]
    python bench/bench_fp8.py --train [--device cuda] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, device_time  # noqa: E402

from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.config import PRESETS, ConfigError  # noqa: E402
from tessera.core.fp8 import quantize, scaled_mm_linear, weight_scale_inv  # noqa: E402
from tessera.core.fp8_activation import (  # noqa: E402
    compiled_quantize_activation,
    quantize_activation_eager,
)
from tessera.core.fp8_recipe import Fp8Recipe, resolve_fp8_recipe  # noqa: E402
from tessera.core.fp8_training import enable_fp8_training  # noqa: E402
from tessera.training.config import TrainConfig  # noqa: E402
from tessera.training.optim import build_optimizer  # noqa: E402

Quantizer = Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """`{layer: (N, K)}` of a preset's block linears, as the model multiplies them."""
    cfg = PRESETS[model]
    hidden, heads = cfg["hidden_size"], cfg["num_heads"]
    kv, head_dim = cfg.get("num_kv_heads", heads), hidden // heads
    ffn = cfg["ffn_hidden_size"]
    return {"qkv": ((heads + 2 * kv) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate/up": (2 * ffn, hidden), "down": (hidden, ffn)}


def fp8_product(x: torch.Tensor, q: torch.Tensor, w_inv: torch.Tensor, rowwise: bool,
                quantizer: Quantizer, fast_accum: bool) -> torch.Tensor:
    """`x @ W^T` through FP8: `x` quantized by `quantizer`, then `torch._scaled_mm`."""
    xq, x_inv = quantizer(x, rowwise)
    return gemm(xq, x_inv, q, w_inv, rowwise, x, fast_accum)


def gemm(xq: torch.Tensor, x_inv: torch.Tensor, q: torch.Tensor, w_inv: torch.Tensor,
         rowwise: bool, x: torch.Tensor, fast_accum: bool) -> torch.Tensor:
    out_dtype = torch.bfloat16 if rowwise and x.is_cuda else x.dtype
    return torch._scaled_mm(xq, q.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference).norm() / reference.norm()).item()


def cases(args) -> Iterator[tuple[str, str, int, int, int, str]]:
    """`(model, layer, M, N, K, scales)` in measuring order: the first M given goes first for
    every model, so a budget that runs out keeps the rows that matter most."""
    for m in args.tokens:
        for model in args.models:
            for layer, (n, k) in layer_shapes(model).items():
                for scales in args.scales:
                    yield model, layer, m, n, k, scales


def measure(args, model: str, layer: str, m: int, n: int, k: int, scales: str) -> dict:
    device, reps = args.device, args.reps
    g = torch.Generator(device=device).manual_seed(m + n + k)
    x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(torch.bfloat16)
    q, scale = quantize(w, per_channel=scales == "channel")
    rowwise = scale.dim() > 0 or device == "cpu"
    w_inv = weight_scale_inv(scale, n, rowwise)
    xq, x_inv = quantize_activation_eager(x, rowwise)
    fused_quantizer = compiled_quantize_activation()
    modes: dict[str, Callable[[], torch.Tensor]] = {
        "bf16": lambda: x @ w.t(),
        "gemm": lambda: gemm(xq, x_inv, q, w_inv, rowwise, x, True),
        "quant+gemm": lambda: fp8_product(x, q, w_inv, rowwise, quantize_activation_eager, False),
        "fused": lambda: fp8_product(x, q, w_inv, rowwise, fused_quantizer, True),
    }
    seconds = {mode: device_time(fn, steps=reps, warmup=2, device=device)
               for mode, fn in modes.items()}
    flops = 2 * m * n * k
    reference = x.float() @ w.float().t()
    y_fused = modes["fused"]()
    row = {"model": model, "layer": layer, "M": m, "N": n, "K": k, "scales": scales}
    row.update({f"{mode} TFLOP/s": flops / s / 1e12 for mode, s in seconds.items()})
    row.update({f"{mode} x bf16": seconds["bf16"] / seconds[mode]
                for mode in ("gemm", "quant+gemm")})
    row["fp8 speedup"] = seconds["bf16"] / seconds["fused"]  # the fused layer against bf16
    row["fp8 relative error"] = relative_error(y_fused, reference)
    row["unfused relative error"] = relative_error(modes["quant+gemm"](), reference)
    row["bf16 relative error"] = relative_error(modes["bf16"](), reference)
    # the fused mode is the layer's own path: same bits as `scaled_mm_linear`
    row["same as Fp8 layer"] = torch.equal(y_fused, scaled_mm_linear(x, q, scale, w_inv))
    return row


def run(args) -> list[dict]:
    rows, budget = Rows("fp8"), Budget(args.budget_s)
    for case in cases(args):
        if budget.spent():
            print(f"budget of {args.budget_s:g} s spent: remaining shapes not measured",
                  flush=True)
            break
        rows.add(measure(args, *case))
    return rows.finish()


def train_recipe(args) -> Fp8Recipe:
    """`--fp8-backend` and `--fp8-recipe` as given; by default the backend `auto` picks for the
    recipe, else Tessera's own."""
    try:
        return resolve_fp8_recipe(args.device, args.fp8_backend or "auto", args.fp8_recipe)
    except ConfigError:
        if args.fp8_backend:
            raise
        return resolve_fp8_recipe(args.device, "emulated", args.fp8_recipe)


def time_training(args, recipe: Fp8Recipe | None) -> tuple[float, list[float]]:
    """Seconds per step and the loss of every step, bf16 autocast, FP8 block linears if
    `recipe`; every call starts from the same weights and batch."""
    torch.manual_seed(0)
    config = ModelConfig.from_name(args.models[0], max_position_embeddings=args.seq)
    model = build_model(config, device=args.device).train()
    fp8 = enable_fp8_training([model], recipe) if recipe else None
    optimizer = build_optimizer([model], TrainConfig(lr=args.lr))
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=args.device)
    losses: list[torch.Tensor] = []

    def step() -> None:
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16):
            if fp8:
                with fp8.autocast():
                    loss = model(ids, ids)
            else:
                loss = model(ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fp8:
            fp8.step_end()
        losses.append(loss.detach())

    seconds = device_time(step, steps=args.steps - 2, warmup=2, device=args.device)
    return seconds, [loss.item() for loss in losses]


def run_train(args) -> list[dict]:
    rows = Rows("fp8_train")
    recipe = train_recipe(args)
    t_bf16, bf16 = time_training(args, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    t_fp8, fp8 = time_training(args, recipe)
    diff = [abs(a - b) / b for a, b in zip(fp8, bf16)]
    rows.add({"model": args.models[0], "batch x seq": f"{args.batch}x{args.seq}",
              "fp8": f"{recipe.backend} {recipe.recipe}", "steps": args.steps,
              "bf16 step ms": t_bf16 * 1e3, "fp8 step ms": t_fp8 * 1e3,
              "fp8 step speedup": t_bf16 / t_fp8,
              "tokens/s bf16": args.batch * args.seq / t_bf16,
              "tokens/s fp8": args.batch * args.seq / t_fp8,
              "loss first": bf16[0], "loss last bf16": bf16[-1], "loss last fp8": fp8[-1],
              "max loss relative diff": max(diff)})
    return rows.finish()


def _list(kind: Callable[[str], object]) -> Callable[[str], list]:
    return lambda text: [kind(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", type=_list(str), default=None,
                        help="presets whose layer shapes to run (default: llama-1b,llama3-8b on "
                             "CUDA, llama-demo on CPU)")
    parser.add_argument("--tokens", type=_list(int), default=None,
                        help="M values, first measured first (default: 8192,4096,16384 on CUDA)")
    parser.add_argument("--scales", type=_list(str), default=None,
                        help="weight scales: channel (rowwise), tensor (default: both on CUDA)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per mode (>= 20 "
                        "on CUDA by default)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new shapes after this many seconds")
    parser.add_argument("--tiny", action="store_true",
                        help="a quick run: small model, small M (CPU tests)")
    parser.add_argument("--train", action="store_true",
                        help="time an FP8 training step against bf16 instead (see above)")
    parser.add_argument("--batch", type=int, default=None, help="--train: sequences per step")
    parser.add_argument("--seq", type=int, default=None, help="--train: tokens per sequence")
    parser.add_argument("--steps", type=int, default=None,
                        help="--train: steps per side, the first 2 untimed")
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="--train: AdamW learning rate (no warm-up: keep it small)")
    parser.add_argument("--fp8-backend", choices=("torchao", "te", "emulated"), default=None,
                        help="--train: FP8 backend (default: auto's pick, else emulated)")
    parser.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise", "delayed"),
                        default="tensorwise",
                        help="--train: FP8 scaling recipe (the names every backend shares)")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if args.train:
        model = "llama-1b" if cuda and not args.tiny else "llama-demo"
        big = cuda and not args.tiny
        defaults = {"models": [model], "batch": 4 if big else 2, "seq": 2048 if big else 64,
                    "steps": 50 if big else 4}
        for name, value in defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        if args.steps < 3:
            parser.error(f"--steps must be >= 3 (2 warm-up steps and 1 timed), got {args.steps}")
        run_train(args)
        return
    if args.tiny:
        defaults = {"models": ["llama-demo"], "tokens": [16], "scales": ["channel"], "reps": 3}
    elif cuda:
        defaults = {"models": ["llama-1b", "llama3-8b"], "tokens": [8192, 4096, 16384],
                    "scales": ["channel", "tensor"], "reps": 20}
    else:
        defaults = {"models": ["llama-demo"], "tokens": [256], "scales": ["channel"],
                    "reps": 5}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    unknown = [m for m in args.models if m not in PRESETS]
    if unknown:
        parser.error(f"unknown model preset(s) {', '.join(unknown)}; see `tessera presets`")
    bad = [s for s in args.scales if s not in ("channel", "tensor")]
    if bad:
        parser.error(f"--scales takes channel and/or tensor, not {', '.join(bad)}")
    run(args)


if __name__ == "__main__":
    main()
