"""The `tessera evaluate` command line; the work is in `training.evaluate`, imported only once the
arguments parse, so `--help` is instant."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tessera.core.arg_types import non_negative_int, positive_int
from tessera.core.help import HelpFormatter

_DESCRIPTION = "Loss and perplexity of any checkpoint on an indexed dataset or text files."
SPLITS = ("test", "valid", "train", "all")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera evaluate", description=_DESCRIPTION,
        formatter_class=HelpFormatter,
        epilog="example:\n  tessera evaluate --checkpoint runs/demo/checkpoints/step-00000300 "
               "--data runs/demo/data/corpus")
    parser.add_argument("--checkpoint", required=True, help="Tessera checkpoint directory")
    parser.add_argument("--data", nargs="+", required=True,
                        help="indexed dataset prefixes and/or .txt/.jsonl(.gz) files")
    parser.add_argument("--split", choices=SPLITS, default="test",
                        help="documents of indexed datasets to score, cut as pretraining cut "
                        "them: test (held out from training and from its validation), valid, "
                        "train, or all; text files are scored whole")
    parser.add_argument("--split-ratios", default=None,
                        help="train,valid,test ratios for --split (default: the checkpoint's "
                        "training run's, else pretraining's default split)")
    parser.add_argument("--seq-len", type=non_negative_int, default=0,
                        help="window length (0: the model's max positions, at most 1024)")
    parser.add_argument("--batch", type=positive_int, default=8, help="windows per forward pass")
    parser.add_argument("--max-windows", type=non_negative_int, default=0, help="stop after N windows")
    parser.add_argument("--json-key", default="text", help="field of JSONL documents")
    parser.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: saved)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    # Imported after parsing, so that `--help` does not wait for torch.
    from tessera.core.checkpoint import CheckpointError, load_checkpoint
    from tessera.training.evaluate import (
        DEFAULT_RATIOS,
        document_tokens,
        training_split_ratios,
    )
    from tessera.training.objectives import objective_for

    try:
        model = load_checkpoint(args.checkpoint, dtype=args.dtype)
        seq_len = args.seq_len or min(model.config.max_position_embeddings, 1024)
        ratios = args.split_ratios or training_split_ratios(args.checkpoint) or DEFAULT_RATIOS
        docs = document_tokens(args.data, Path(args.checkpoint), args.json_key, args.split,
                               ratios)
        # The model family's own metrics (GPT: `evaluate.evaluate`; BERT: masked-LM accuracy;
        # T5: span-corruption loss and accuracy, with the checkpoint's tokenizer's ids).
        objective = objective_for(model.config)
        kw = {"checkpoint": args.checkpoint} if objective.name == "span-corruption" else {}
        result = objective.evaluate(model, docs, seq_len, args.batch, args.max_windows or None,
                                    **kw)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"tessera evaluate: {exc}", file=sys.stderr)
        return 2
    result.update(split=args.split, split_ratios=ratios)
    if args.json:
        print(json.dumps(result))
    elif result.get("objective") == "span-corruption":
        print(f"span-corruption loss {result['loss']:.4f} | perplexity "
              f"{result['perplexity']:.2f} | token accuracy {result['accuracy']:.4f} | "
              f"{result['tokens']:,} target tokens scored | split {args.split} (ratios {ratios})")
    elif "accuracy" in result:
        print(f"masked-LM loss {result['loss']:.4f} | perplexity {result['perplexity']:.2f} | "
              f"accuracy {result['accuracy']:.4f} | {result['tokens']:,} masked tokens scored | "
              f"split {args.split} (ratios {ratios})")
    else:
        print(f"loss {result['loss']:.4f} | perplexity {result['perplexity']:.2f} | "
              f"{result['tokens']:,} tokens scored | split {args.split} (ratios {ratios})")
    return 0
