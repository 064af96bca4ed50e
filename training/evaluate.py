"""`tessera evaluate`: loss and perplexity of any checkpoint on an indexed dataset or text files.

Text files (.txt / .jsonl, optionally .gz) are tokenized with the checkpoint's own tokenizer and
packed into windows of `--seq-len` tokens with an EOS between documents; indexed datasets
(`PREFIX` of `PREFIX.bin/.idx`) are read as they are. Every token after the first of each window
is scored once; the result is the mean cross-entropy and its exponential.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from pathlib import Path

import torch

from tessera.core.checkpoint import CheckpointError, load_checkpoint


def _documents(path: Path, json_key: str):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        if ".jsonl" in path.suffixes:
            for line in fh:
                if line.strip():
                    yield json.loads(line)[json_key]
        else:
            yield from (d for d in fh.read().split("\n\n") if d.strip())


def token_stream(sources: list[str], checkpoint: Path, json_key: str) -> torch.Tensor:
    """All tokens of `sources` as one 1-D tensor (indexed datasets or tokenized text)."""
    from tessera.core.tokenizer import load_tokenizer
    from tessera.training.indexed_dataset import IndexedDataset

    pieces: list[torch.Tensor] = []
    tokenizer = None
    for src in sources:
        if Path(src + ".idx").is_file():
            ds = IndexedDataset(src)
            pieces += [torch.from_numpy(ds[i].astype("int64")) for i in range(len(ds))]
            continue
        path = Path(src)
        if not path.is_file():
            raise FileNotFoundError(f"{src}: neither a file nor an indexed dataset prefix "
                                    f"({src}.bin/.idx)")
        tokenizer = tokenizer or load_tokenizer(checkpoint)
        for doc in _documents(path, json_key):
            pieces.append(torch.tensor(tokenizer.encode(doc) + [tokenizer.eod_id]))
    if not pieces:
        raise ValueError("no tokens to evaluate on")
    return torch.cat(pieces)


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, seq_len: int, batch: int = 8,
             max_windows: int | None = None) -> dict[str, float]:
    """Mean loss and perplexity over non-overlapping windows of `seq_len + 1` tokens."""
    n = (len(tokens) - 1) // seq_len
    if max_windows:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"only {len(tokens)} tokens: need more than seq_len {seq_len}")
    windows = torch.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])
    total, count = 0.0, 0
    for chunk in windows.split(batch):
        loss = model(chunk[:, :-1], chunk[:, 1:])
        total += float(loss) * chunk.shape[0] * seq_len
        count += chunk.shape[0] * seq_len
    mean = total / count
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": count}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera evaluate", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example:\n  tessera evaluate --checkpoint runs/demo/checkpoints/step-00000300 "
               "--data runs/demo/data/corpus")
    parser.add_argument("--checkpoint", required=True, help="Tessera checkpoint directory")
    parser.add_argument("--data", nargs="+", required=True,
                        help="indexed dataset prefixes and/or .txt/.jsonl(.gz) files")
    parser.add_argument("--seq-len", type=int, default=0,
                        help="window length (0: the model's max positions, at most 1024)")
    parser.add_argument("--batch", type=int, default=8, help="windows per forward pass")
    parser.add_argument("--max-windows", type=int, default=0, help="stop after N windows")
    parser.add_argument("--json-key", default="text", help="field of JSONL documents")
    parser.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: saved)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        model = load_checkpoint(args.checkpoint, dtype=args.dtype)
        seq_len = args.seq_len or min(model.config.max_position_embeddings, 1024)
        tokens = token_stream(args.data, Path(args.checkpoint), args.json_key)
        result = evaluate(model, tokens, seq_len, args.batch, args.max_windows or None)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"tessera evaluate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(f"loss {result['loss']:.4f} | perplexity {result['perplexity']:.2f} | "
              f"{result['tokens']:,} tokens scored")
    return 0
