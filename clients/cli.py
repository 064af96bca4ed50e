"""`tessera generate "prompt" --checkpoint DIR`: generate text locally from any checkpoint.

Prints the prompt and its continuation. (Querying a running server with `--url`
comes with the server.)
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera generate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Generate a continuation of PROMPT with a local checkpoint.",
        epilog='example:\n  tessera generate "Return the" --checkpoint '
               "runs/demo/checkpoints/step-00000300 --max-tokens 40 --temperature 0.8")
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument("--checkpoint", required=True, help="Tessera checkpoint directory")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k best (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: saved)")
    args = parser.parse_args(argv)
    from tessera.core.checkpoint import CheckpointError, load_checkpoint
    from tessera.core.generation import generate_ids
    from tessera.core.tokenizer import load_tokenizer

    try:
        model = load_checkpoint(args.checkpoint, dtype=args.dtype)
        tokenizer = load_tokenizer(args.checkpoint)
        prompt = tokenizer.encode(args.prompt, bos=tokenizer.bos_id is not None)
        ids = generate_ids(model, prompt, args.max_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, eos_id=tokenizer.eos_id,
                           seed=args.seed)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"tessera generate: {exc}", file=sys.stderr)
        return 2
    ids = [i for i in ids if i != tokenizer.eos_id]
    print(args.prompt + tokenizer.decode(ids))
    return 0
