"""`tessera serve`'s LoRA flags (`--lora NAME=PATH`, `--max-loras`, `--max-lora-rank`,
`--allow-runtime-lora`) as the `serving.engine.adapters.LoRAServing` every rank builds its slots from."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from tessera.serving.engine.adapters import LoRAServing


def parse_lora_flags(items: list[str]) -> tuple[tuple[str, str], ...]:
    """`NAME=PATH` items as (name, path) pairs; a ValueError names a malformed or repeated one."""
    out: list[tuple[str, str]] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora {item!r}: expected NAME=PATH (e.g. --lora sql=runs/sql-lora)")
        if name in (n for n, _ in out):
            raise ValueError(f"--lora: the name {name!r} is given twice")
        out.append((name, path))
    return tuple(out)


def lora_serving(args: argparse.Namespace) -> LoRAServing | None:
    """The adapters to serve, or None when neither --lora nor --allow-runtime-lora asks for
    any (then no layer gets an adapter hook, and nothing costs anything)."""
    preload = parse_lora_flags(args.lora)
    if not preload and not args.allow_runtime_lora:
        return None
    if len(preload) > args.max_loras:
        raise ValueError(f"{len(preload)} --lora adapters do not fit --max-loras "
                         f"{args.max_loras}; raise it")
    reader = getattr(args, "adapter_reader", None)
    if reader is not None:
        reader = functools.partial(_read_for, reader, args.checkpoint)
    return LoRAServing(max_loras=args.max_loras, max_rank=args.max_lora_rank,
                       checkpoint=args.checkpoint, preload=preload,
                       allow_runtime=args.allow_runtime_lora, reader=reader)


def _read_for(reader, checkpoint: str, directory: Path):
    return reader(directory, checkpoint)
