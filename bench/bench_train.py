"""Training throughput: Tessera's real training step vs Hugging Face `transformers`, same Llama,
same batch, same device, rows printed as they are measured.

Tessera runs `training.loop.train_step` on a job built by `training.loop.setup` (the path
`tessera pretrain` runs: its optimizer, clipping, precision and `--compile`). The peer is HF's
`LlamaForCausalLM` with its default SDPA attention, the same dtype and autocast, fused AdamW and
gradient clipping at 1.0 (what HF's `Trainer` does by default). Both models are built directly on
the device in their dtype. Each case: the first step's extra time (compilation), then the mean
step over `--steps` steps after 2 warm-up steps (CUDA events on a GPU), tokens/s, achieved
TFLOP/s counted as Megatron does (`model_flops_per_token`), MFU against the datasheet peak and
against this device's measured GEMM peak, and the peak memory beside `tessera plan`'s prediction.

    python bench/bench_train.py                                    # CPU, a small Llama
    python bench/bench_train.py --device cuda --preset llama-1b --seq 2048 --batch 4 --budget-s 150
    python bench/bench_train.py --tiny                             # seconds: the CI check
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows, device_time, matmul_peak_tflops  # noqa: E402

from tessera.converters.hf_mapping import config_to_hf  # noqa: E402
from tessera.core import ModelConfig  # noqa: E402
from tessera.core.flops import model_flops_per_token  # noqa: E402
from tessera.training.config import LoopConfig, PretrainConfig, TrainConfig  # noqa: E402
from tessera.training.loop import setup, train_step  # noqa: E402
from tessera.training.metrics import resolve_peak  # noqa: E402
from tessera.training.run_plan import resolve_plan  # noqa: E402


def model_config(args) -> ModelConfig:
    if args.preset:
        return ModelConfig.from_name(args.preset, max_position_embeddings=args.seq)
    return ModelConfig.from_name(
        "llama-tiny", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64,
        ffn_hidden_size=int(args.hidden * 8 / 3) // 64 * 64,
        max_position_embeddings=args.seq)


def tessera_step(args, config: ModelConfig, precision: str, compile_: bool, ids, labels):
    """The step `tessera pretrain --precision P [--compile]` runs, on a job of its own."""
    cfg = PretrainConfig(
        model=config,
        train=TrainConfig(global_batch=args.batch, seq_len=args.seq, precision=precision,
                          device=args.device, compile=compile_, steps=10**6, warmup_steps=0),
        loop=LoopConfig(progress=False, tensorboard=False))
    job = setup(resolve_plan(cfg, 1), torch.device(args.device))
    counter = iter(range(10**9))
    return lambda: train_step(job, next(counter), ids, labels)


def hf_step(args, config: ModelConfig, precision: str, compile_: bool, ids, labels):
    """HF's Llama as its `Trainer` runs it: fused AdamW, clipping at 1.0, autocast for bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = config_to_hf(config)
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **{
        k: v for k, v in hf.items() if k not in ("architectures", "torch_dtype", "dtype")})
    hf_config._attn_implementation = "sdpa"
    weights = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=weights).train()
    if compile_:
        model.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=args.device != "cpu" or None)
    autocast = torch.bfloat16 if precision == "bf16" else None
    device_type = torch.device(args.device).type

    def step():
        ctx = (torch.autocast(device_type, dtype=autocast) if autocast
               else contextlib.nullcontext())
        with ctx:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def predicted(args, precision: str) -> dict:
    """`tessera plan`'s step time and memory for this run on this GPU's built-in profile, and
    its step time on the measured profile when `--plan-gpu-measured` names one that exists."""
    out = _prediction(args, precision, args.plan_gpu, "plan")
    measured = args.plan_gpu_measured
    if measured and Path(measured).is_file():
        out.update({k: v for k, v in _prediction(args, precision, measured,
                                                   "plan (measured profile)").items()
                    if "memory" not in k})
    return out


def _prediction(args, precision: str, gpu: str | None, label: str) -> dict:
    if gpu is None or not args.preset:
        return {}
    cmd = [sys.executable, "-m", "tessera", "plan", "--model", args.preset, "--gpus", "1",
           "--gpu", gpu, "--seq-len", str(args.seq), "--global-batch", str(args.batch),
           "--micro-batch", str(args.batch), "--tp", "1", "--pp", "1", "--recompute", "none",
           "--precision", "bf16" if precision.startswith("bf16") else "fp32", "--json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        best = json.loads(out.stdout)["candidates"][0]
    except (subprocess.SubprocessError, KeyError, IndexError, ValueError) as exc:
        print(f"(no plan prediction: {exc})", flush=True)
        return {}
    return {f"{label} step ms": best["step_time_s"] * 1e3,
            f"{label} memory GiB": best["memory_gib"]}


def profile(step, args, path: Path) -> None:
    """Two steps under the PyTorch profiler: the kernels that take the time (and which SDPA
    backend ran), written to `path` and printed."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    sort = "self_cpu_time_total"
    if args.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
        sort = "self_cuda_time_total"
    with torch_profile(activities=activities) as prof:
        for _ in range(2):
            step()
        _sync(args.device)
    table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    print(table, flush=True)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cases(args) -> list[tuple[str, str, str, bool]]:
    """(side, label, precision, compile) in the order that matters most when the budget is short:
    the headline (Tessera as it would train on this device), its peer, then the rest."""
    if args.device.startswith("cuda"):
        out = [("tessera", "bf16 (fp32 master), --compile", "bf16", True),
               ("hf", "bf16 (fp32 master), eager", "bf16", False),
               ("tessera", "bf16 (fp32 master), eager", "bf16", False),
               ("tessera", "bf16-pure, --compile", "bf16-pure", True),
               ("hf", "bf16-pure, eager", "bf16-pure", False)]
        if args.hf_compile:
            out.append(("hf", "bf16 (fp32 master), torch.compile", "bf16", True))
        return out
    out = [("tessera", "fp32, eager", "fp32", False), ("hf", "fp32, eager", "fp32", False)]
    if args.compile:
        out.insert(1, ("tessera", "fp32, --compile", "fp32", True))
    if not args.tiny:
        out += [("tessera", "bf16 (fp32 master), eager", "bf16", False),
                ("hf", "bf16 (fp32 master), eager", "bf16", False)]
    return out


def run(args) -> list[dict]:
    budget = Budget(args.budget_s)
    rows = Rows(args.name or ("train" if args.device == "cpu" else "train-cuda"))
    torch.manual_seed(0)
    config = model_config(args)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=args.device)
    labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    tokens = args.batch * args.seq
    flops_per_step = model_flops_per_token(config, args.seq) * tokens
    label = (f"{args.preset or 'llama'} h{config.hidden_size} L{config.num_layers} "
             f"V{config.vocab_size} b{args.batch}x{args.seq}")
    dev = torch.device(args.device)
    datasheet, _ = resolve_peak("auto", dev, torch.bfloat16)
    gemm_peak: dict[torch.dtype, float] = {}
    predictions: dict[str, dict] = {}
    for side, case, precision, compile_ in cases(args):
        if rows.rows and budget.skips(f"{side} {case}"):  # the headline case always runs
            continue
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        if dtype not in gemm_peak:
            gemm_peak[dtype] = matmul_peak_tflops(dtype, args.device, n=args.gemm_n)
        _free(args.device)
        build = tessera_step if side == "tessera" else hf_step
        try:
            tic = time.perf_counter()
            step = build(args, config, precision, compile_, ids, labels)
            built = time.perf_counter() - tic
            tic = time.perf_counter()
            step()
            _sync(args.device)
            first = time.perf_counter() - tic
            seconds = device_time(step, steps=args.steps, warmup=args.warmup, device=args.device)
        except torch.OutOfMemoryError as exc:
            rows.add({"side": side, "case": case, "model": label, "error": f"OOM: {exc}"[:120]})
            continue
        achieved = flops_per_step / seconds / 1e12
        row = {"side": side, "case": case, "model": label, "step ms": seconds * 1e3,
               "tok/s": tokens / seconds, "TFLOP/s": achieved,
               "MFU (datasheet)": achieved / datasheet if datasheet else None,
               "MFU (measured GEMM)": achieved / gemm_peak[dtype],
               "GEMM peak TFLOP/s": gemm_peak[dtype],
               "first step s": first, "compile s": max(first - seconds, 0.0) if compile_ else 0,
               "build s": built}
        if args.device.startswith("cuda"):
            row["peak memory GiB"] = torch.cuda.max_memory_allocated() / 2**30
            row["peak reserved GiB"] = torch.cuda.max_memory_reserved() / 2**30
            # What nvidia-smi shows (the allocator's cache, CUDA context, cuBLAS workspaces):
            # the figure `tessera plan`'s memory per GPU predicts, overhead included.
            free, total = torch.cuda.mem_get_info()
            row["device used GiB"] = (total - free) / 2**30
            if side == "tessera":
                if precision not in predictions:
                    predictions[precision] = predicted(args, precision)
                row.update(predictions[precision])
        rows.add(row)
        if args.profile_out and side == "tessera" and compile_ and not budget.spent():
            profile(step, args, Path(args.profile_out))
        del step
    hf_rate = {r["case"].split(",")[0]: r["tok/s"] for r in rows.rows
               if r["side"] == "hf" and "tok/s" in r and "eager" in r["case"]}
    for r in rows.rows:
        peer = hf_rate.get(r["case"].split(",")[0])
        if r["side"] == "tessera" and peer and "tok/s" in r:
            r["vs HF eager"] = r["tok/s"] / peer
    return rows.finish()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    parser.add_argument("--preset", default=None, help="a model preset instead of the sizes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="on CPU, also time Tessera's --compile (always timed on CUDA)")
    parser.add_argument("--hf-compile", action="store_true",
                        help="also time HF under whole-model torch.compile (slow to compile)")
    parser.add_argument("--plan-gpu", default=None,
                        help="tessera plan's --gpu profile to predict step time and memory "
                             "(default on CUDA: h200 or h100-80gb by the card's name)")
    parser.add_argument("--plan-gpu-measured", default=None,
                        help="also predict the step on this measured profile (PATH.json)")
    parser.add_argument("--gemm-n", type=int, default=None, help="size of the peak-GEMM probe")
    parser.add_argument("--profile-out", default=None,
                        help="profile two steps of the first compiled Tessera case into this file")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new cases after this many seconds")
    parser.add_argument("--tiny", action="store_true",
                        help="a 2-layer, 128-wide model and fp32 only: the seconds-long CI run")
    parser.add_argument("--name", default=None, help="results name (default: train[-cuda])")
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.vocab, args.seq, args.batch = 2, 128, 512, 64, 2
        args.steps, args.warmup, args.gemm_n = 2, 1, args.gemm_n or 256
    if args.plan_gpu is None and args.device.startswith("cuda"):
        args.plan_gpu = "h200" if "H200" in torch.cuda.get_device_name() else "h100-80gb"
    run(args)


if __name__ == "__main__":
    main()
