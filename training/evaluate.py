"""`tessera evaluate`: loss and perplexity of any checkpoint on an indexed dataset or text files.

Text files (.txt / .jsonl, optionally .gz) are tokenized with the checkpoint's own tokenizer and
packed into windows of `--seq-len` tokens with an EOS between documents; indexed datasets
(`PREFIX` of `PREFIX.bin/.idx`) are read as they are. Every token after the first of each window
is scored once; the result is the mean cross-entropy and its exponential.

Of an indexed dataset only one split of its documents is scored (`--split`), cut exactly as
`tessera pretrain` cut it: by the checkpoint's own `split` ratios when it is a training
checkpoint, else by `--split-ratios`. The default is the test split: pretraining neither trained
on it nor watched its loss (that is the valid split), so it is the one honest held-out number.
Text files are not pretraining's data and are scored whole.

Documents are read one at a time and scoring stops after `--max-windows`, so a large dataset
costs only what is scored. The command line is `training.evaluate_cli`.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from tessera.core.checkpoint import read_manifest
from tessera.training.config import DataConfig

DEFAULT_RATIOS = DataConfig().split  # what `tessera pretrain --split` cuts by default
_BLOCK = 1 << 20  # characters of a text file read at a time


def _documents(path: Path, json_key: str) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        if ".jsonl" in path.suffixes:
            for line in fh:
                if line.strip():
                    yield json.loads(line)[json_key]
        else:  # documents are separated by a blank line; read in blocks, split as they come
            rest = ""
            for block in iter(lambda: fh.read(_BLOCK), ""):
                *docs, rest = (rest + block).split("\n\n")
                yield from (d for d in docs if d.strip())
            if rest.strip():
                yield rest


def training_split_ratios(checkpoint: str | Path) -> str | None:
    """The `split` ratios the run that wrote `checkpoint` used, or None (not a training one)."""
    record = read_manifest(checkpoint).extra.get("training") or {}
    return ((record.get("config") or {}).get("data") or {}).get("split")


def document_tokens(sources: list[str], checkpoint: Path, json_key: str, split: str = "all",
                    ratios: str = DEFAULT_RATIOS) -> Iterator[np.ndarray]:
    """The documents of `sources`, one token array each, read lazily: of indexed datasets only
    the documents of `split` under `ratios`, tokenized text (with EOS after each) whole."""
    from tessera.core.tokenizer import load_tokenizer
    from tessera.training.gpt_dataset import SPLIT_NAMES, split_ranges
    from tessera.training.indexed_dataset import IndexedDataset

    tokenizer = None
    for src in sources:
        if Path(src + ".idx").is_file():
            ds = IndexedDataset(src)
            start, end = 0, len(ds)
            if split != "all":
                start, end = split_ranges(ratios, len(ds))[SPLIT_NAMES.index(split)]
            for i in range(start, end):
                yield ds[i]
            continue
        path = Path(src)
        if not path.is_file():
            raise FileNotFoundError(f"{src}: neither a file nor an indexed dataset prefix "
                                    f"({src}.bin/.idx)")
        tokenizer = tokenizer or load_tokenizer(checkpoint)
        for doc in _documents(path, json_key):
            yield np.asarray(tokenizer.encode(doc) + [tokenizer.eod_id], dtype=np.int64)


def windows(documents: Iterable[np.ndarray], seq_len: int,
            max_windows: int | None = None) -> Iterator[torch.Tensor]:
    """Consecutive windows of `seq_len + 1` tokens over the concatenated documents; window i
    starts at token `i * seq_len`, so neighbours share one token and each token after the first
    is a target once. Only the tokens of the window being cut are held."""
    pending: list[np.ndarray] = []
    held, made = 0, 0
    for doc in documents:
        pending.append(doc)
        held += len(doc)
        if held < seq_len + 1:
            continue
        flat, start = np.concatenate(pending), 0
        while len(flat) - start >= seq_len + 1:
            if max_windows and made >= max_windows:
                return
            yield torch.from_numpy(flat[start:start + seq_len + 1].astype(np.int64))
            made, start = made + 1, start + seq_len
        pending, held = [flat[start:]], len(flat) - start
        if max_windows and made >= max_windows:
            return


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor | Iterable[np.ndarray], seq_len: int, batch: int = 8,
             max_windows: int | None = None) -> dict[str, float]:
    """Mean loss and perplexity over non-overlapping windows of `seq_len + 1` tokens.

    `tokens` is one 1-D tensor, or documents (token arrays) read as they are needed.
    """
    docs = [tokens.numpy()] if isinstance(tokens, torch.Tensor) else tokens
    total, count = 0.0, 0
    chunk: list[torch.Tensor] = []
    for window in _then_none(windows(docs, seq_len, max_windows)):
        if window is not None:
            chunk.append(window)
        if chunk and (len(chunk) == batch or window is None):
            stacked = torch.stack(chunk)
            loss = model(stacked[:, :-1], stacked[:, 1:])
            total += float(loss) * stacked.shape[0] * seq_len
            count += stacked.shape[0] * seq_len
            chunk = []
    if count == 0:
        raise ValueError(f"fewer than {seq_len + 1} tokens to evaluate on: need more than "
                         f"seq_len {seq_len} (lower --seq-len, or choose another --split)")
    mean = total / count
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": count}


def _then_none(items: Iterable[torch.Tensor]) -> Iterator[torch.Tensor | None]:
    yield from items
    yield None  # the end: score the last, partial batch
