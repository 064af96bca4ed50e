"""`tessera preprocess`: tokenize text or JSONL into an indexed dataset (`PREFIX.bin/.idx`).

Input formats, chosen by file name (a trailing `.gz` is decompressed on the fly):
- `*.jsonl`, `*.json`, `*.ndjson`: one JSON object per line, one document per line, the text in
  the `--json-key` field (default `text`). Blank lines are ignored. A line that is not valid JSON,
  not an object, or lacks a string under the key is malformed: it is reported as `FILE:LINE` and
  skipped (counted in the summary), or stops the run under `--strict`.
- a line (of either format) that is not valid UTF-8 is skipped the same way, counted apart
  ("skipped 3 lines that are not UTF-8 (first at FILE:17)").
- anything else is plain text, split into documents on blank lines: a document is a run of
  non-blank lines, joined with "\\n" (no trailing newline).
Each document is encoded without BOS; with `--append-eod` (the default) the EOD id (= EOS)
follows it. Empty or whitespace-only documents are dropped and counted; inputs that leave no
document at all are an error (nothing is written).

Memory is bounded, independent of the corpus size: the main process reads documents into
chunks that close once they reach CHUNK_CHARS (2**20) characters or CHUNK_DOCS (1024)
documents, and keeps at most IN_FLIGHT_PER_WORKER (2) chunks per worker in flight. At most
2 x workers + 1 chunks of about 1 MiB of text each (plus their tokens) are alive at once; a
chunk exceeds that only by its last document, so one huge document adds its own size. The
index keeps 4 bytes per document in memory; the tokens go straight to disk.

Output is deterministic: chunks are written in input order whatever `--workers` is, so any
worker count produces byte-identical files. The files appear only when the run succeeds, and
an existing PREFIX.bin/.idx is replaced only with `--overwrite`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult
from pathlib import Path
from typing import IO

import numpy as np

from tessera.core.arg_types import positive_int
from tessera.core.progress import Progress
from tessera.core.tokenizer import JSONL_SUFFIXES, Tokenizer, load_tokenizer
from tessera.training.indexed_dataset import IndexedDatasetWriter, dataset_paths
from tessera.training.run_dir import missing_directories, remove_empty_directories

CHUNK_CHARS = 1 << 20  # a chunk closes at this many characters of text
CHUNK_DOCS = 1024  # ... or at this many documents
IN_FLIGHT_PER_WORKER = 2
MAX_REPORTED_SKIPS = 20  # past this, skips are only counted, so a bad file cannot flood stderr
NOT_UTF8 = "not UTF-8"  # the skip reason of an undecodable line
# Input is decoded with errors="surrogateescape": each byte that is not UTF-8 becomes one lone
# surrogate U+DC80..U+DCFF, which valid UTF-8 never decodes to, so a line holding one is not UTF-8.
_UNDECODED = re.compile("[\udc80-\udcff]")


class MalformedInputError(ValueError):
    """A malformed input line under `--strict`; the message starts with `FILE:LINE:`."""


@dataclass
class PreprocessStats:
    documents: int = 0  # documents written
    tokens: int = 0  # tokens written, EODs included
    skipped: int = 0  # malformed JSONL lines skipped
    empty: int = 0  # blank documents dropped
    not_utf8: int = 0  # lines skipped for not being UTF-8
    first_not_utf8: str = ""  # FILE:LINE of the first of them
    seconds: float = 0.0

    def summary(self, prefix: str) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (
            f"wrote {prefix}.bin/.idx: {self.documents:,} documents, {self.tokens:,} tokens "
            f"in {self.seconds:.1f} s ({rate:,.0f} tokens/s); skipped {self.skipped:,} "
            f"malformed lines, dropped {self.empty:,} empty documents"
            + (f"; {self.not_utf8_text()}" if self.not_utf8 else "")
        )

    def not_utf8_text(self) -> str:
        return (f"skipped {self.not_utf8:,} lines that are not UTF-8 "
                f"(first at {self.first_not_utf8})")


class _SkipReporter:
    def __init__(self, strict: bool, stats: PreprocessStats) -> None:
        self.strict, self.stats = strict, stats

    def __call__(self, path: Path, lineno: int, reason: str) -> None:
        where = f"{path}:{lineno}: {reason}"
        if self.strict:
            raise MalformedInputError(f"{where} (run without --strict to skip such lines)")
        if reason == NOT_UTF8:
            self.stats.not_utf8 += 1
            self.stats.first_not_utf8 = self.stats.first_not_utf8 or f"{path}:{lineno}"
            return  # counted apart, reported once in the summary
        self.stats.skipped += 1
        if self.stats.skipped <= MAX_REPORTED_SKIPS:
            print(f"tessera preprocess: skipping {where}", file=sys.stderr)
        if self.stats.skipped == MAX_REPORTED_SKIPS:
            print("tessera preprocess: further skipped lines are only counted", file=sys.stderr)


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="surrogateescape")
    return open(path, encoding="utf-8", errors="surrogateescape")


def is_jsonl(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is read as JSON lines (by suffix, ignoring a trailing `.gz`)."""
    p = Path(path)
    return (p.with_suffix("") if p.suffix == ".gz" else p).suffix in JSONL_SUFFIXES


def iter_documents(
    path: str | os.PathLike[str],
    json_key: str = "text",
    report: Callable[[Path, int, str], None] | None = None,
) -> Iterator[str]:
    """The documents of one input file, in order (see the module docstring for the format).

    `report(path, lineno, reason)` is called for each malformed JSONL line and each line that is
    not UTF-8 (reason `NOT_UTF8`); without it such lines are skipped silently.
    """
    path = Path(path)
    with _open_text(path) as f:
        if not is_jsonl(path):
            paragraph: list[str] = []
            for lineno, line in enumerate(f, start=1):
                if _UNDECODED.search(line):
                    if report is not None:
                        report(path, lineno, NOT_UTF8)
                elif line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "".join(paragraph).rstrip("\n")
                    paragraph = []
            if paragraph:
                yield "".join(paragraph).rstrip("\n")
            return
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            reason = None
            if _UNDECODED.search(line):
                reason = NOT_UTF8
            else:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    reason = f"invalid JSON ({exc.msg} at column {exc.colno})"
            if reason is None:
                if not isinstance(record, dict):
                    reason = f"expected a JSON object, got {type(record).__name__}"
                elif not isinstance(record.get(json_key), str):
                    reason = f"no string field {json_key!r} (keys: {sorted(record)[:8]})"
            if reason is None:
                yield record[json_key]
            elif report is not None:
                report(path, lineno, reason)


def _chunks(docs: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= CHUNK_CHARS or len(chunk) >= CHUNK_DOCS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class _ChunkEncoder:
    """Encodes a chunk of documents into (concatenated tokens, per-document lengths)."""

    def __init__(self, tokenizer: Tokenizer, append_eod: bool) -> None:
        self.tokenizer, self.append_eod = tokenizer, append_eod

    def __call__(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # A blank document becomes zero tokens (not a lone EOD), so the writer drops it.
        encoded = [self.tokenizer.encode(d, eos=self.append_eod) if d.strip() else [] for d in docs]
        lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
        tokens = np.fromiter((t for ids in encoded for t in ids), np.int32, int(lengths.sum()))
        return tokens, lengths


_worker_encoder: _ChunkEncoder | None = None  # set once per pool worker by _init_worker


def _init_worker(encoder: _ChunkEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_encoder is not None, "pool worker used before _init_worker"
    return _worker_encoder(docs)


def _encoded(
    chunks: Iterable[list[str]], encoder: _ChunkEncoder, workers: int
) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray]]]:
    """(documents in chunk, encoded chunk), in input order."""
    if workers <= 1:
        for chunk in chunks:
            yield len(chunk), encoder(chunk)
        return
    # Not Pool.imap: its feeder thread drains the input as fast as it can, so a slow writer
    # would let the whole corpus pile up in memory. A bounded window of apply_async keeps
    # order and memory in check. spawn, because forking a process with threads can deadlock.
    with mp.get_context("spawn").Pool(workers, _init_worker, (encoder,)) as pool:
        pending: deque[tuple[int, AsyncResult]] = deque()
        for chunk in chunks:
            pending.append((len(chunk), pool.apply_async(_encode_in_worker, (chunk,))))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                n, result = pending.popleft()
                yield n, result.get()
        while pending:
            n, result = pending.popleft()
            yield n, result.get()


def preprocess(
    inputs: Sequence[str | os.PathLike[str]],
    tokenizer: str | os.PathLike[str] | Tokenizer,
    output_prefix: str | os.PathLike[str],
    *,
    workers: int = 1,
    json_key: str = "text",
    strict: bool = False,
    append_eod: bool = True,
    progress: bool = True,
) -> PreprocessStats:
    """Tokenize `inputs` into `output_prefix.bin/.idx`; see the module docstring.

    Raises:
        FileNotFoundError: an input or the tokenizer is missing.
        MalformedInputError: a malformed JSONL line with `strict=True` (nothing is written).
        ValueError: the inputs hold no document to write (nothing is written).
    """
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("no input files given")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input file not found: {path}")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    if append_eod:
        tok.eod_id  # noqa: B018 - fail now, not in a worker, if there is no EOS
    stats = PreprocessStats()
    report = _SkipReporter(strict, stats)
    docs = (doc for path in paths for doc in iter_documents(path, json_key, report))
    start = time.perf_counter()
    bar = Progress("preprocess", unit="docs", enabled=progress)
    with bar, IndexedDatasetWriter(output_prefix, tok.vocab_size) as writer:
        encoded = _encoded(_chunks(docs), _ChunkEncoder(tok, append_eod), workers)
        for n_docs, (tokens, lengths) in encoded:
            keep = lengths > 0
            stats.empty += int((~keep).sum())
            writer.add_documents(tokens, lengths[keep])
            bar.update(n_docs, tokens=f"{writer.num_tokens:,}")
        stats.documents, stats.tokens = writer.num_docs, writer.num_tokens
        if not stats.documents:  # raised inside the writer: its temporary files are discarded
            raise ValueError(_no_documents(paths, stats))
    stats.seconds = time.perf_counter() - start
    return stats


def _no_documents(paths: Sequence[Path], stats: PreprocessStats) -> str:
    why = [f"{stats.empty:,} empty documents dropped", f"{stats.skipped:,} malformed lines skipped"]
    if stats.not_utf8:
        why.append(stats.not_utf8_text())
    return (f"no documents to write: {', '.join(map(str, paths))} held none with text "
            f"({'; '.join(why)}); check the inputs (and --json-key for JSONL)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera preprocess",
        description="Tokenize text or JSONL files into an indexed dataset PREFIX.bin/PREFIX.idx "
        "for pretraining. .txt files are split into documents on blank lines; .jsonl files "
        "hold one document per line (any other name is read as plain text). Gzipped inputs (.gz) "
        "are read directly.",
        epilog="example: tessera preprocess --input corpus.jsonl.gz --tokenizer tok.model "
        "--output-prefix data/corpus --workers 8",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE",
        help="input files: .txt, .jsonl (or .json/.ndjson), optionally .gz",
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="PATH",
        help="sentencepiece .model, tokenizer.json, or a directory holding one",
    )
    parser.add_argument(
        "--output-prefix", required=True, metavar="PREFIX", help="write PREFIX.bin and PREFIX.idx"
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        default=1,
        help="tokenizer processes (default 1); the output does not depend on it",
    )
    parser.add_argument(
        "--json-key",
        default="text",
        metavar="KEY",
        help="field holding the text in JSONL inputs (default: text)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first malformed JSONL line instead of skipping it",
    )
    parser.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the EOD (EOS) id after every document (default: on)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing PREFIX.bin/.idx (without it, an existing one is refused)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    existing = [p for p in dataset_paths(args.output_prefix) if p.exists()]
    if existing and not args.overwrite:
        print(f"tessera preprocess: error: {existing[0]} already exists; pass --overwrite to "
              "replace it, or choose another --output-prefix", file=sys.stderr)
        return 2
    created = missing_directories(dataset_paths(args.output_prefix)[0].parent)
    try:
        stats = preprocess(
            args.input,
            args.tokenizer,
            args.output_prefix,
            workers=args.workers,
            json_key=args.json_key,
            strict=args.strict,
            append_eod=args.append_eod,
        )
    except (OSError, ValueError) as exc:
        remove_empty_directories(created)
        print(f"tessera preprocess: error: {exc}", file=sys.stderr)
        return 1
    print(stats.summary(str(args.output_prefix)))
    return 0
