"""`tessera tokenizer train`: train a sentencepiece tokenizer on text or JSONL files.

Inputs are read like `tessera preprocess` reads them (.txt, .jsonl with `--json-key`, either
optionally `.gz`) and streamed into sentencepiece line by line; sentencepiece keeps at most
`--input-sentence-size` lines (a random sample), which bounds memory on large corpora.
The model gets UNK=0, BOS=1, EOS=2, PAD=3 and byte fallback (see `tessera.core.tokenizer`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from tessera.core.arg_types import positive_int

# sentencepiece and the readers are imported when training starts, so `--help` is instant.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera tokenizer",
        description="Tokenizer tools. `train` fits a sentencepiece BPE or unigram model with "
        "UNK=0, BOS=1, EOS=2, PAD=3 and byte fallback, with an exact vocabulary size.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    train = verbs.add_parser(
        "train",
        help="train a sentencepiece tokenizer",
        description="Train a sentencepiece tokenizer on .txt / .jsonl files (optionally .gz).",
        epilog="example: tessera tokenizer train --input corpus.jsonl.gz --vocab-size 32000 "
        "--output tok.model",
    )
    train.add_argument(
        "--input", nargs="+", required=True, metavar="FILE", help="training text: .txt, .jsonl, .gz"
    )
    train.add_argument(
        "--vocab-size",
        type=positive_int,
        required=True,
        metavar="N",
        help="exact vocabulary size, including 4 specials and 256 byte pieces",
    )
    train.add_argument("--output", required=True, metavar="FILE", help="the .model file to write")
    train.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe", help="(default: bpe)")
    train.add_argument(
        "--json-key",
        default="text",
        metavar="KEY",
        help="field holding the text in JSONL inputs (default: text)",
    )
    train.add_argument(
        "--input-sentence-size",
        type=positive_int,
        default=2_000_000,
        metavar="N",
        help="lines sampled for training, bounding memory (default: 2000000)",
    )
    return parser


class _Skips:
    """Counts malformed JSONL lines and remembers the first, for the closing message."""

    def __init__(self) -> None:
        self.count, self.first = 0, ""

    def __call__(self, path: Path, lineno: int, reason: str) -> None:
        self.count += 1
        self.first = self.first or f"{path}:{lineno}: {reason}"


def _texts(files: Sequence[str], json_key: str, skips: _Skips) -> Iterator[str]:
    from tessera.training.preprocess import iter_documents

    for name in files:
        yield from iter_documents(name, json_key, skips)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = [name for name in args.input if not Path(name).is_file()]
    if missing:
        print(f"tessera tokenizer: error: input file not found: {missing[0]}", file=sys.stderr)
        return 1
    from tessera.core.tokenizer import train_tokenizer

    skips = _Skips()
    try:
        tokenizer = train_tokenizer(
            [],
            args.vocab_size,
            args.output,
            args.model_type,
            texts=_texts(args.input, args.json_key, skips),
            input_sentence_size=args.input_sentence_size,
        )
    except (OSError, ValueError) as exc:
        print(f"tessera tokenizer: error: {exc}", file=sys.stderr)
        return 1
    if skips.count:
        print(f"tessera tokenizer: skipped {skips.count} malformed JSONL lines; first: {skips.first}")
    print(f"wrote {args.output}: {args.model_type}, vocab_size={tokenizer.vocab_size}")
    return 0
