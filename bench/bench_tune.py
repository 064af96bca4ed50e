"""Tuning: step time and peak memory of Tessera's prompt tuning / p-tuning against `peft` on the
Hugging Face export of the same base model, same batch, same number of virtual tokens.

Each variant runs in its own subprocess, so its peak RSS is its own. One step = forward,
backward and an AdamW update of the prompt parameters only (the base is frozen in both). Each
row is printed as it is measured; `--budget-s` stops starting methods once spent.

    python bench/bench_tune.py [--hidden 512 --layers 8 --seq 128 --batch 8 --virtual 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import (  # noqa: E402
    Budget,
    Rows,
    answer_only_batch,
    best_time,
    peak_rss_mb,
    run_child,
)


def tessera_steps(args, ckpt: str, method: str) -> float:
    """Seconds per step of Tessera's tuning (frozen base + VirtualPrompts hook)."""
    from tessera.core import load_checkpoint
    from tessera.core.prompts import attach_prompts
    from tessera.tuning.prompts import build_prompts

    model = load_checkpoint(ckpt).train()
    for p in model.parameters():
        p.requires_grad_(False)
    init = model.tok_embeddings.weight[3: 3 + args.virtual].detach().clone()
    prompts = attach_prompts(model, build_prompts(method, {"t": init}, encoder="mlp"))
    optimizer = torch.optim.AdamW(prompts.parameters(), lr=1e-3)
    ids, labels = answer_only_batch(args.batch, args.seq, model.config.vocab_size)
    ids[:, : args.virtual] = 0  # virtual slots carry the task index (0)
    labels = torch.cat([labels[:, 1:], labels[:, :1]], dim=1)

    def step() -> None:
        model(ids, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return best_time(step, repeats=args.steps)


def peft_steps(args, hf_dir: str, method: str) -> float:
    """Seconds per step of `peft` prompt tuning / p-tuning on the Hugging Face export."""
    from peft import PromptEncoderConfig, PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa")
    if method == "prompt-tuning":
        config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=args.virtual)
    else:
        config = PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=args.virtual,
                                     encoder_reparameterization_type="MLP")
    model = get_peft_model(base, config).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids, labels = answer_only_batch(args.batch, args.seq, base.config.vocab_size)
    ids, labels = ids[:, args.virtual:], labels[:, args.virtual:]  # peft prepends its own

    def step() -> None:
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return best_time(step, repeats=args.steps)


def _child(argv: list[str]) -> None:
    which, path, method, raw = argv
    args = argparse.Namespace(**json.loads(raw))
    fn = tessera_steps if which == "tessera" else peft_steps
    seconds = fn(args, path, method)
    rss = peak_rss_mb()
    print(json.dumps({"seconds": seconds, "peak_rss_mb": rss}))


def _run(which: str, path: Path, method: str, args) -> dict:
    return run_child(__file__, which, str(path), method, json.dumps(vars(args)))


def run(args, rows: Rows) -> None:
    from tessera.converters.hf_io import export_hf
    from tessera.core import ModelConfig, build_model, save_checkpoint

    budget = Budget(args.budget_s)
    config = ModelConfig.from_name("llama-tiny", vocab_size=8000, hidden_size=args.hidden,
                                   num_layers=args.layers, num_heads=args.hidden // 64,
                                   num_kv_heads=args.hidden // 64, ffn_hidden_size=args.hidden * 3,
                                   max_position_embeddings=args.seq)
    work = Path(tempfile.mkdtemp(prefix="tessera-bench-tune-"))
    ckpt = save_checkpoint(work / "ckpt", build_model(config, seed=0))
    export_hf(ckpt, work / "hf")
    for method in ("prompt-tuning", "p-tuning"):
        if method != "prompt-tuning" and budget.skips(method):
            break
        ours = _run("tessera", ckpt, method, args)
        theirs = _run("peft", work / "hf", method, args)
        rows.add({"method": method, "tessera step s": ours["seconds"],
                  "peft step s": theirs["seconds"],
                  "speed ratio": theirs["seconds"] / ours["seconds"],
                  "tessera peak RSS MB": ours["peak_rss_mb"],
                  "peft peak RSS MB": theirs["peak_rss_mb"]})


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        _child(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--virtual", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget: no further method starts once it is spent")
    args = parser.parse_args(argv)
    rows = Rows("tune")
    run(args, rows)
    rows.finish()


if __name__ == "__main__":
    main()
