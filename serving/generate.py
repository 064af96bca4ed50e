"""`tessera generate --checkpoint DIR`: generation in this process, beside the engine.

The verb's parser lives with the client (`tessera.clients.cli`), which also runs `--url`; the
root command hands `run_local` to it, so neither package imports the other (see the import
contracts in pyproject.toml).
"""

from __future__ import annotations

import argparse
import sys


def generate_text(checkpoint: str, prompt: str, *, max_tokens: int = 64,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int | None = None, dtype: str | None = None) -> str:
    """The continuation of `prompt` by the model at `checkpoint` (EOS dropped), one process.

    Raises `CheckpointError` / `ValueError` (bad checkpoint, prompt too long) and
    `FileNotFoundError` (no checkpoint there).
    """
    from tessera.core.checkpoint import load_checkpoint
    from tessera.core.generation import generate_ids
    from tessera.core.tokenizer import load_tokenizer

    model = load_checkpoint(checkpoint, dtype=dtype)
    tokenizer = load_tokenizer(checkpoint)
    ids = generate_ids(model, tokenizer.encode(prompt, bos=tokenizer.bos_id is not None),
                       max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       eos_id=tokenizer.eos_id, seed=seed)
    return tokenizer.decode([i for i in ids if i != tokenizer.eos_id])


def run_local(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation; `args` come from `tessera.clients.cli`'s parser.

    Returns the exit code: 0, or 2 when the checkpoint or prompt is unusable (message on stderr).
    """
    try:
        text = generate_text(args.checkpoint, args.prompt, max_tokens=args.max_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=args.seed, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as exc:  # CheckpointError is a ValueError
        print(f"tessera generate: {exc}", file=sys.stderr)
        return 2
    print(args.prompt + text)
    return 0
