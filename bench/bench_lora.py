"""LoRA: step time and peak memory of Tessera's LoRA tuning against `peft` LoRA on the Hugging
Face export of the same base model, same rank, alpha, targets and batch.

Targets `attention` = Tessera's fused `wqkv` and `wo` = HF's `q_proj`, `k_proj`, `v_proj`,
`o_proj`; `all` adds `w1` (fused gate/up) and `w2` = `gate_proj`, `up_proj`, `down_proj`. On a
fused layer Tessera's adapter has one A for the fused outputs (as PEFT has on a fused layer),
so it holds fewer A parameters than PEFT's separate q/k/v (gate/up) adapters of the same rank.

Each variant runs in its own subprocess, so its peak RSS is its own. One step = forward,
backward and an AdamW update of the adapter only (the base is frozen in both). Each row is
printed as it is measured; `--budget-s` stops starting target sets once spent.

    python bench/bench_lora.py [--hidden 512 --layers 8 --seq 128 --batch 8 --rank 16]
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

HF_TARGETS = {"attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
              "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj"]}


def tessera_steps(args, ckpt: str, targets: str) -> tuple[float, int]:
    """Seconds per step of Tessera's LoRA (frozen base, adapters on ParallelLinear), and the
    number of adapter parameters."""
    from tessera.core import load_checkpoint
    from tessera.core.lora import attach_lora, mark_only_lora_as_trainable, resolve_targets
    from tessera.core.lora_format import AdapterConfig

    model = load_checkpoint(ckpt).train()
    adapter = AdapterConfig(rank=args.rank, alpha=2.0 * args.rank,
                            modules=resolve_targets(targets, model.config))
    params = attach_lora([model], adapter)
    mark_only_lora_as_trainable(model)
    optimizer = torch.optim.AdamW(params.values(), lr=1e-3)
    ids, labels = answer_only_batch(args.batch, args.seq, model.config.vocab_size)
    labels = torch.cat([labels[:, 1:], labels[:, :1]], dim=1)  # Tessera takes shifted labels

    def step() -> None:
        model(ids, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return best_time(step, repeats=args.steps), sum(p.numel() for p in params.values())


def peft_steps(args, hf_dir: str, targets: str) -> tuple[float, int]:
    """Seconds per step of `peft` LoRA on the Hugging Face export, and its adapter size."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa")
    config = LoraConfig(task_type="CAUSAL_LM", r=args.rank, lora_alpha=2 * args.rank,
                        lora_dropout=0.0, target_modules=HF_TARGETS[targets])
    model = get_peft_model(base, config).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    ids, labels = answer_only_batch(args.batch, args.seq, base.config.vocab_size)

    def step() -> None:
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return best_time(step, repeats=args.steps), sum(p.numel() for p in params)


def _child(argv: list[str]) -> None:
    which, path, targets, raw = argv
    args = argparse.Namespace(**json.loads(raw))
    fn = tessera_steps if which == "tessera" else peft_steps
    seconds, size = fn(args, path, targets)
    rss = peak_rss_mb()
    print(json.dumps({"seconds": seconds, "peak_rss_mb": rss, "params": size}))


def _run(which: str, path: Path, targets: str, args) -> dict:
    return run_child(__file__, which, str(path), targets, json.dumps(vars(args)))


def run(args, rows: Rows) -> None:
    from tessera.converters.hf_io import export_hf
    from tessera.core import ModelConfig, build_model, save_checkpoint

    budget = Budget(args.budget_s)
    config = ModelConfig.from_name("llama-tiny", vocab_size=8000, hidden_size=args.hidden,
                                   num_layers=args.layers, num_heads=args.hidden // 64,
                                   num_kv_heads=args.hidden // 64, ffn_hidden_size=args.hidden * 3,
                                   max_position_embeddings=args.seq)
    work = Path(tempfile.mkdtemp(prefix="tessera-bench-lora-"))
    ckpt = save_checkpoint(work / "ckpt", build_model(config, seed=0))
    export_hf(ckpt, work / "hf")
    for targets in ("attention", "all"):
        if targets != "attention" and budget.skips(f"targets {targets}"):
            break
        ours = _run("tessera", ckpt, targets, args)
        theirs = _run("peft", work / "hf", targets, args)
        rows.add({"targets": targets, "rank": args.rank,
                  "tessera step s": ours["seconds"], "peft step s": theirs["seconds"],
                  "speed ratio": theirs["seconds"] / ours["seconds"],
                  "tessera peak RSS MB": ours["peak_rss_mb"],
                  "peft peak RSS MB": theirs["peak_rss_mb"],
                  "tessera adapter params": ours["params"],
                  "peft adapter params": theirs["params"]})


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
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget: no further targets start once it is spent")
    args = parser.parse_args(argv)
    rows = Rows("lora")
    run(args, rows)
    rows.finish()


if __name__ == "__main__":
    main()
