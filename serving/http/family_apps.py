"""`tessera serve` for the model families the decoder engine does not run, each on one process.

- BERT (`serving.http.fill_mask`): `POST /v1/fill_mask` and its model/health routes.
- T5 (`serving.engine.t5_engine`): text-to-text through the generation routes (OpenAI completions,
  Triton generate, `/api`), greedy, one request at a time. Its tokenizer is the checkpoint's
  with sentinel tokens `<extra_id_k>` placed above it (`core.models.t5.tokens`):
  `--t5-sentinels N`, by default as many as the model's vocabulary has room for above the
  tokenizer, at most 100 (Hugging Face's T5 has 100, in a vocabulary padded to 32128).

`app_for_family(args)` returns the app for such a checkpoint (`ONE_PROCESS_APPS`, by family),
or None for a decoder-only one, which `serving.cli` serves with the batching engine. Flags these
apps cannot honour (tensor/pipeline parallelism, prompt tables, quantization) are refused with a
ValueError.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

HF_T5_SENTINELS = 100


def app_for_family(args: argparse.Namespace, served_names: list[str]) -> Any | None:
    """The one-process app for a checkpoint whose family has one (`ONE_PROCESS_APPS`); None for the
    others (the decoder families)."""
    from tessera.core.checkpoint import read_manifest

    family = read_manifest(args.checkpoint).model.family
    build = ONE_PROCESS_APPS.get(family)
    if build is None:
        return None
    if args.tp * args.pp != 1 or args.prompts or args.quantize not in (None, "none"):
        raise ValueError(f"a {family.upper()} checkpoint is served on one process, unquantized "
                         "and without prompt tables: drop --tp/--pp/--prompts/--quantize")
    return build(args, served_names)


def _bert_app(args: argparse.Namespace, served_names: list[str]) -> Any:
    from tessera.serving.http.fill_mask import fill_mask_app

    return fill_mask_app(args.checkpoint, served_names[0], dtype=args.dtype,
                         api_key=args.api_key, max_body_bytes=args.max_body_bytes)


def t5_sentinels(model_vocab: int, tokenizer_vocab: int, asked: int | None) -> int:
    """How many sentinels to place above a tokenizer of `tokenizer_vocab` ids (see the module
    docstring); raises ValueError when `asked` does not fit the model's vocabulary."""
    room = model_vocab - tokenizer_vocab
    if asked is None:
        return max(0, min(room, HF_T5_SENTINELS))
    if not 0 <= asked <= room:
        raise ValueError(f"--t5-sentinels {asked} does not fit: the model's vocabulary "
                         f"({model_vocab}) has room for {max(room, 0)} tokens above the "
                         f"tokenizer's {tokenizer_vocab}")
    return asked


def _t5_app(args: argparse.Namespace, served_names: list[str]) -> Any:
    from tessera.core.checkpoint import read_manifest
    from tessera.core.models.t5.init import load_t5_checkpoint
    from tessera.core.models.t5.tokens import SentinelTokenizer
    from tessera.core.tokenizer import load_tokenizer
    from tessera.serving.engine.t5_engine import T5Engine
    from tessera.serving.http.app import create_app
    from tessera.serving.http.flags import app_limits

    model = load_t5_checkpoint(str(args.checkpoint))
    tok = None
    if read_manifest(args.checkpoint).tokenizer:
        base = load_tokenizer(args.checkpoint)
        n = t5_sentinels(model.config.vocab_size, base.vocab_size, args.t5_sentinels)
        tok = SentinelTokenizer(base, n)
    engine = T5Engine(model, tok, model_name=served_names[0], adapters=t5_adapters(args))
    return create_app(engine, model_name=served_names[0], **app_limits(args, served_names))


def t5_adapters(args: argparse.Namespace) -> dict[str, Any]:
    """The `--lora NAME=PATH` adapters for a T5 checkpoint: name -> (config, tensors), each
    checked against the base. Runtime loading is refused (the T5 engine fixes them at start)."""
    from tessera.core.lora_format import check_base, load_adapter
    from tessera.core.prompt_table import base_fingerprint
    from tessera.serving.adapter_cli import parse_lora_flags

    if getattr(args, "allow_runtime_lora", False):
        raise ValueError("a T5 checkpoint serves its LoRA adapters from start only: drop "
                         "--allow-runtime-lora and name them with --lora NAME=PATH")
    preload = parse_lora_flags(getattr(args, "lora", None) or [])
    adapters = {}
    fingerprint = base_fingerprint(args.checkpoint) if preload else ""
    for name, path in preload:
        config, tensors = load_adapter(path)
        check_base(config, fingerprint, args.checkpoint)
        adapters[name] = (config, tensors)
    return adapters


# The families the batching engine does not run: family name -> the builder of its app from
# the `tessera serve` arguments and the served model names.
ONE_PROCESS_APPS: dict[str, Callable[[argparse.Namespace, list[str]], Any]] = {
    "bert": _bert_app,
    "t5": _t5_app,
}
