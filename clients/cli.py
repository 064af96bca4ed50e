"""`tessera generate "prompt" (--checkpoint DIR | --url URL)`: generate text locally or remotely.

With `--checkpoint`, the model runs in this process. With `--url`, a running Tessera server
generates and the tokens are printed as they arrive. Either way the prompt is printed first,
then its continuation.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera generate", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Generate a continuation of PROMPT with a local checkpoint or a server.",
        epilog='examples:\n  tessera generate "Return the" --checkpoint '
               "runs/demo/checkpoints/step-00000300 --max-tokens 40 --temperature 0.8\n"
               '  tessera generate "Return the" --url http://127.0.0.1:8000 --model demo:qa')
    parser.add_argument("prompt", help="text to continue")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint", help="Tessera checkpoint directory (generate locally)")
    where.add_argument("--url", help="a running Tessera server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"),
                        help="server API key (default: $TESSERA_API_KEY)")
    parser.add_argument("--model", default=None,
                        help="server model, BASE or BASE:TASK (default: the server's base model)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k best (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (local; default: saved)")
    args = parser.parse_args(argv)
    return _remote(args) if args.url else _local(args)


def _local(args: argparse.Namespace) -> int:
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


def _remote(args: argparse.Namespace) -> int:
    import httpx

    from tessera.clients.client import Client, TesseraError

    params = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
              "seed": args.seed}
    try:
        with Client(args.url, api_key=args.api_key, model=args.model) as client:
            chunks = client.stream(args.prompt, max_tokens=args.max_tokens, **params)
            first = next(chunks, None)  # the server has accepted the request
            print(args.prompt + (first.text if first else ""), end="", flush=True)
            for chunk in chunks:
                print(chunk.text, end="", flush=True)
    except TesseraError as exc:
        print(f"\ntessera generate: the server answered {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"\ntessera generate: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print()
    return 0
