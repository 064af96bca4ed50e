"""Perplexity cost of the Hugging Face FP8 exports (`tessera convert --to hf --fp8 ...`).

A small Llama is trained on English prose (by default Vim's user manual, `usr_*.txt`, which most
Linux machines carry; or `--checkpoint` a trained Tessera Llama with a tokenizer), exported as
bf16, block FP8 and per-tensor FP8 (dynamic, and static after calibration on a separate file),
imported back (dequantized exactly as transformers and vLLM do), and its perplexity measured on
held-out text. Activations are quantized and dequantized the way the FP8 kernels do it: block FP8
per token and 1 x block group (dynamic), per tensor over each batch (dynamic) or with the
calibrated input scale (static, saturating); the products then run in fp32. Each row is printed
as it is measured; `--budget-s` stops starting formats once spent (bf16, the reference, always
runs).

    python bench/bench_fp8_export.py [--steps 300] [--checkpoint CKPT --heldout FILE --calibration FILE]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Budget, Rows  # noqa: E402

from tessera.converters.calibrate import calibrate_input_amax  # noqa: E402
from tessera.converters.cli import main as convert  # noqa: E402
from tessera.core.checkpoint import load_checkpoint, read_manifest, save_checkpoint  # noqa: E402
from tessera.core.fp8 import dequantize, quantize  # noqa: E402
from tessera.core.parallel.layers import quantizable_linears  # noqa: E402
from tessera.core.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402

VIM_DOCS = Path("/usr/share/vim/vim90/doc")


def _manual(pattern: str) -> list[Path]:
    return sorted(VIM_DOCS.glob(pattern))


def train(work: Path, steps: int, seq: int, batch: int) -> Path:
    """A 4-layer Llama (hidden 256, every linear a multiple of 128) trained on the manual."""
    from tessera.core import ModelConfig, build_model

    files = [f for f in _manual("usr_*.txt") if not f.name.startswith("usr_4")]
    if not files:
        raise SystemExit(f"no training text in {VIM_DOCS}; pass --checkpoint/--heldout/--calibration")
    tok = train_tokenizer(files, 2048, work / "tok.model", "bpe", num_threads=1)
    ids = torch.tensor(tok.encode("\n".join(f.read_text(errors="replace") for f in files)))
    config = ModelConfig.from_name("llama-tiny", vocab_size=2048, hidden_size=256, num_layers=4,
                                   num_heads=4, num_kv_heads=2, ffn_hidden_size=768,
                                   max_position_embeddings=seq)
    model = build_model(config, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 2e-3, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(0)
    tic = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        window = torch.stack([ids[s:s + seq + 1] for s in starts])
        loss = model(window[:, :-1], labels=window[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - tic:.0f} s)")
    return save_checkpoint(work / "trained", model.eval(), tokenizer=work / "tok.model")


def _fake_quant_inputs(model: torch.nn.Module, mode: str, block: int,
                       amax: dict[str, float] | None) -> None:
    """Quantize-dequantize every quantizable linear's input as an FP8 kernel would."""
    def hook(name: str):
        def pre(_m, args):
            x = args[0]
            flat = x.reshape(-1, x.shape[-1]).float()
            if mode == "block":  # per token and group of `block` input columns, dynamic
                groups = flat.reshape(-1, block)
                q, s = quantize(groups, per_channel=True)
                out = dequantize(q, s).reshape(flat.shape)
            else:  # per tensor: dynamic over the batch, or the calibrated (static) amax
                a = None if amax is None else torch.tensor(amax[f"{name}.weight"])
                q, s = quantize(flat, amax=a)
                out = dequantize(q, s)
            return (out.reshape(x.shape).to(x.dtype), *args[1:])
        return pre

    for name, layer in quantizable_linears(model):
        layer.register_forward_pre_hook(hook(name))


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: torch.Tensor, seq: int) -> float:
    """exp(mean next-token loss) over consecutive windows of `seq` tokens."""
    n = (len(ids) - 1) // seq
    losses = [model(ids[i * seq:(i + 1) * seq][None], labels=ids[i * seq + 1:(i + 1) * seq + 1][None])
              for i in range(n)]
    return math.exp(torch.stack(losses).mean().item())


def run(args, rows: Rows) -> None:
    budget = Budget(args.budget_s)
    work = Path(tempfile.mkdtemp(prefix="bench-fp8-export-"))
    ckpt = Path(args.checkpoint) if args.checkpoint else train(work, args.steps, args.seq,
                                                                 args.batch)
    heldout = args.heldout or [str(f) for f in _manual("usr_4[1-5].txt")]
    calibration = Path(args.calibration) if args.calibration else VIM_DOCS / "usr_40.txt"
    manifest = read_manifest(ckpt)
    tok = load_tokenizer(ckpt / manifest.tokenizer)
    text = "\n".join(Path(f).read_text(errors="replace") for f in heldout)
    ids = torch.tensor(tok.encode(text)[: args.tokens])
    seq = min(args.seq, manifest.model.max_position_embeddings)
    amax = calibrate_input_amax(ckpt, calibration)
    variants = {"bf16": (None, []), "fp8 block": ("block", ["--fp8", "block"]),
                "fp8 tensor, dynamic": ("tensor", ["--fp8", "tensor"]),
                "fp8 tensor, static": ("static", ["--fp8", "tensor", "--calibration-data",
                                                  str(calibration)])}
    base = None
    for label, (mode, flags) in variants.items():
        if base is not None and budget.skips(f"{label} and later formats"):
            break
        hf, back = work / f"hf-{label}", work / f"back-{label}"
        assert convert(["--to", "hf", "--input", str(ckpt), "--output", str(hf), "--dtype",
                        "bf16", *flags, *(["--fp8-block", str(args.block)] if mode == "block"
                                          else [])]) == 0
        assert convert(["--from", "hf", "--input", str(hf), "--output", str(back),
                        "--dtype", "fp32"]) == 0
        model = load_checkpoint(back)
        if mode is not None:
            _fake_quant_inputs(model, "block" if mode == "block" else "tensor", args.block,
                               amax if mode == "static" else None)
        ppl = perplexity(model, ids, seq)
        base = base or ppl
        size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        rows.add({"format": label, "perplexity": ppl, "vs bf16": ppl / base - 1,
                  "weights MB": size / 1e6, "held-out tokens": len(ids)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a trained Tessera Llama checkpoint with a tokenizer")
    parser.add_argument("--heldout", nargs="+", help="held-out text files")
    parser.add_argument("--calibration", help="calibration text for the static export")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32768, help="held-out tokens at most")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget (training included): no format starts once spent")
    args = parser.parse_args(argv)
    rows = Rows("fp8_export")
    run(args, rows)
    rows.finish()


if __name__ == "__main__":
    main()
