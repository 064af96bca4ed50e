"""`tessera tokenizer train`: train a sentencepiece tokenizer on text or JSONL files.

Inputs are read like `tessera preprocess` reads them (.txt, .jsonl with `--json-key`, either
optionally `.gz`) and streamed into sentencepiece line by line; sentencepiece keeps at most
`--input-sentence-size` lines (a random sample), which bounds memory on large corpora.
The model gets UNK=0, BOS=1, EOS=2, PAD=3 and byte fallback (see `tessera.core.tokenizer`).
Lines that are not UTF-8 and malformed JSONL lines are skipped and counted; an existing
`--output` is replaced only with `--overwrite`.
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
    train.add_argument("--overwrite", action="store_true",
                       help="replace an existing --output (without it, an existing one is refused)")
    return parser


class _Skips:
    """Counts skipped lines (malformed JSONL; not UTF-8) and remembers the first of each kind,
    for the closing message."""

    def __init__(self) -> None:
        self.count, self.first = 0, ""
        self.not_utf8, self.first_not_utf8 = 0, ""

    def __call__(self, path: Path, lineno: int, reason: str) -> None:
        from tessera.training.preprocess import NOT_UTF8

        if reason == NOT_UTF8:
            self.not_utf8 += 1
            self.first_not_utf8 = self.first_not_utf8 or f"{path}:{lineno}"
            return
        self.count += 1
        self.first = self.first or f"{path}:{lineno}: {reason}"

    def report(self) -> str:
        """The skips in words, or "" when nothing was skipped."""
        parts = []
        if self.count:
            parts.append(f"skipped {self.count} malformed JSONL lines; first: {self.first}")
        if self.not_utf8:
            parts.append(f"skipped {self.not_utf8} lines that are not UTF-8 "
                         f"(first at {self.first_not_utf8})")
        return "; ".join(parts)


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
    if Path(args.output).exists() and not args.overwrite:
        print(f"tessera tokenizer: error: {args.output} already exists; pass --overwrite to "
              "replace it, or choose another --output", file=sys.stderr)
        return 2
    from tessera.core.tokenizer import train_tokenizer
    from tessera.training.run_dir import missing_directories, remove_empty_directories

    created = missing_directories(Path(args.output).parent)

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
        remove_empty_directories(created)
        skipped = f" ({skips.report()})" if skips.report() else ""
        print(f"tessera tokenizer: error: {exc}{skipped}", file=sys.stderr)
        return 1
    if skips.report():
        print(f"tessera tokenizer: {skips.report()}")
    print(f"wrote {args.output}: {args.model_type}, vocab_size={tokenizer.vocab_size}")
    return 0
