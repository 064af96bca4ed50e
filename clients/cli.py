"""`tessera generate "prompt" (--checkpoint DIR | --url URL)`: generate text locally or remotely.

With `--url`, a running Tessera server generates and the tokens are printed as they arrive.
With `--checkpoint`, the model runs in this process: that code lives beside the engine
(`tessera.serving.generate.run_local`), which clients may not import, so the root command passes
it in as `local`. Either way the prompt is printed first, then its continuation; with `--chat`
the prompt is a user message (`--system` adds a system one before it) sent through the chat
template, and only the reply is printed. `--stop S` (repeatable) ends the text before S.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from tessera.core.arg_types import (
    non_negative_float,
    non_negative_int,
    positive_int,
    top_p,
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `tessera generate`, both modes."""
    parser = argparse.ArgumentParser(
        prog="tessera generate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate a continuation of PROMPT with a local checkpoint or a server.",
        epilog='examples:\n  tessera generate "Return the" --checkpoint '
               "runs/demo/checkpoints/step-00000300 --max-tokens 40 --temperature 0.8\n"
               '  tessera generate "Return the" --url http://127.0.0.1:8000 --model demo:qa\n'
               '  tessera generate "What is a tensor?" --chat --stream --stop "\\n\\n" '
               "--checkpoint CKPT")
    parser.add_argument("prompt", help="text to continue")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint", metavar="DIR",
                       help="Tessera checkpoint directory (generate in this process)")
    where.add_argument("--url", help="a running Tessera server, e.g. http://127.0.0.1:8000")
    # The key itself never appears in --help: the default names the variable it comes from.
    parser.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"), metavar="KEY",
                        help="server API key (default: $TESSERA_API_KEY)")
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="server model, BASE or BASE:TASK (default: the server's base model)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, metavar="N",
                        help="tokens to generate at most (default: 64)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                        help="sampling temperature, 0 = greedy (default: 0)")
    parser.add_argument("--top-k", type=non_negative_int, default=0, metavar="K",
                        help="sample from the k best, 0 = all (default: 0)")
    parser.add_argument("--top-p", type=top_p, default=1.0, metavar="P",
                        help="nucleus sampling mass (default: 1.0)")
    parser.add_argument("--seed", type=non_negative_int, default=None, metavar="N",
                        help="seed for reproducible sampling (default: none)")
    parser.add_argument("--dtype", default=None,
                        help="with --checkpoint: fp32 | bf16 | fp16 (default: the checkpoint's)")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="end the text before TEXT (repeatable; up to 16)")
    parser.add_argument("--stream", action="store_true",
                        help="print the text as it is generated (--url always streams)")
    parser.add_argument("--chat", action="store_true",
                        help="PROMPT is a user message, sent through the model's chat "
                             "template; prints the reply alone")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="with --chat: a system message before PROMPT")
    return parser


def main(argv: list[str], local: Callable[[argparse.Namespace], int] | None = None) -> int:
    """Run `tessera generate ARGV`; `local` runs `--checkpoint` (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    if args.url:
        return _remote(args)
    if local is None:
        parser.error("--checkpoint generates in this process, through `tessera generate` "
                     "(tessera.serving.generate); this entry point only talks to a server (--url)")
    return local(args)


def _remote(args: argparse.Namespace) -> int:
    import httpx

    from tessera.clients.client import Client, TesseraError

    params = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
              "seed": args.seed, **({"stop": args.stop} if args.stop else {})}
    try:
        with Client(args.url, api_key=args.api_key, model=args.model) as client:
            if args.chat:
                messages = ([{"role": "system", "content": args.system}] if args.system else []) \
                    + [{"role": "user", "content": args.prompt}]
                chunks = client.chat_stream(messages, max_tokens=args.max_tokens, **params)
                head = ""
            else:
                chunks = client.stream(args.prompt, max_tokens=args.max_tokens, **params)
                head = args.prompt
            first = next(chunks, None)  # the server has accepted the request
            print(head + (first.text if first else ""), end="", flush=True)
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
