"""T5 span-corruption samples over the indexed datasets `tessera preprocess` writes.

Raw text comes from a `GPTDataset` over the same data (documents packed across boundaries with
their EOD tokens, shuffled per epoch, index arrays cached): sample i's `raw_length` tokens are
its sample i. Span corruption then follows T5 (Raffel et al. 2020, section 3.1.4): about
`raw_length x noise_density` tokens are noise, cut into about `noise / mean_span` spans; the
noise and the kept tokens are each split into that many non-empty runs at random points, and
interleaved kept, noise, kept, noise, ... The encoder sees the kept tokens with each noise span
replaced by the next sentinel (`core.models.t5.tokens`), then EOS; the target is each sentinel
followed by its span, then EOS. Unlike T5, which rounds both counts to the nearest integer (so
a short sample's density and span length can be off by several percent), each count is rounded
up or down at random with the probabilities that make its mean exact. `raw_length` is the
longest whose encoder input always fits `encoder_length`; a shorter input is padded (masked),
and the target is padded to its longest with -100, so every sample has the same shapes.

Deterministic and resumable like the GPT data: sample i depends only on the data, the
arguments and i (its noise is drawn from a generator seeded by (seed, i)), so a run resumed at
sample n reads exactly what an uninterrupted one would.

`build_t5_datasets` makes the train / valid / test splits (and blends) from `--data` arguments as
`gpt_dataset.build_datasets` does. `ds[i]` is a dict of LongTensors:
- `encoder_ids (encoder_length,)`, `encoder_mask (encoder_length,)` (1 = real token);
- `decoder_input_ids (target_length,)`: the decoder start token, then the labels shifted right
  (-100 as the pad id), as Hugging Face's `_shift_right` makes them;
- `labels (target_length,)`: the target, then -100 (ignored) to the fixed length.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from tessera.core.models.t5.span import SpanShape, fit_raw_length
from tessera.core.models.t5.tokens import SentinelError, SentinelTokenizer
from tessera.training.gpt_dataset import (
    GPTDataset,
    build_split_datasets,
)
from tessera.training.indexed_dataset import IndexedDataset

Sample = dict[str, torch.Tensor]


def _stochastic_round(x: float, u: float) -> int:
    """floor(x) or ceil(x), the latter with probability frac(x): the mean is x."""
    return math.floor(x) + int(u < x - math.floor(x))


def _segments(u: np.ndarray, items: int, parts: int) -> np.ndarray:
    """`items` cut into `parts` non-empty runs at uniformly random points (the positions of
    the `parts - 1` smallest of `items - 1` uniforms `u`): their lengths."""
    cuts = np.sort(np.argsort(u[: items - 1], kind="stable")[: parts - 1] + 1)
    return np.diff(np.concatenate([[0], cuts, [items]])).astype(np.int64)


def noise_mask(shape: SpanShape, rng: np.random.Generator) -> np.ndarray:
    """A boolean mask of `shape.raw_length`: True on the noise spans (T5's layout: a kept run
    first, then noise and kept runs alternating). Draws only `rng.random`, whose stream numpy
    keeps stable."""
    L = shape.raw_length
    u = rng.random(2 * L + 2)
    lo, hi = shape.noise_range
    noise = min(max(_stochastic_round(L * shape.noise_density, u[0]), lo), hi)
    spans = min(max(_stochastic_round(noise / shape.mean_span, u[1]), 1), noise, L - noise)
    runs = np.stack([_segments(u[2 + L:], L - noise, spans),
                     _segments(u[2:], noise, spans)], axis=1).reshape(-1)
    return np.repeat(np.tile([False, True], spans), runs)


def corrupt(tokens: np.ndarray, mask: np.ndarray, tok: SentinelTokenizer
            ) -> tuple[np.ndarray, np.ndarray]:
    """(encoder input, target) of `tokens` with the noise `mask`, both ending in EOS."""
    first = mask & ~np.concatenate([[False], mask[:-1]])  # the first token of each span
    sentinels = tok.vocab_size - 1 - (np.cumsum(first) - 1)  # `<extra_id_k>` of span k
    eos = np.array([tok.eos_id])
    inputs = np.concatenate([np.where(mask, sentinels, tokens)[~mask | first], eos])
    # The target: the noise tokens, each span's sentinel placed before its first one.
    noisy, opens = tokens[mask], first[mask]
    targets = np.empty(len(noisy) + int(opens.sum()), dtype=np.int64)
    at = np.arange(len(noisy)) + np.cumsum(opens)
    targets[at] = noisy
    targets[at[opens] - 1] = sentinels[first]
    return inputs, np.concatenate([targets, eos])


def fill_spans(sample: Sample, tok: SentinelTokenizer) -> list[int]:
    """The raw tokens back from a sample: each sentinel of the encoder input replaced by the
    tokens that follow the same sentinel in the target (padding and the final EOS dropped;
    the EOD tokens between documents are data and stay)."""
    inputs = sample["encoder_ids"][sample["encoder_mask"].bool()].tolist()[:-1]
    target = sample["labels"][sample["labels"] != -100].tolist()[:-1]
    spans: dict[int, list[int]] = {}
    current = None
    for t in target:
        k = tok.sentinel_index(t)
        if k is not None:
            current = spans.setdefault(k, [])
        elif current is not None:
            current.append(t)
    out = []
    for t in inputs:
        k = tok.sentinel_index(t)
        out += spans[k] if k is not None else [t]
    return out


class T5SpanDataset(Dataset[Sample]):
    """`num_samples` span-corrupted samples of `encoder_length` encoder tokens from one split.

    Args:
        indexed: the data, or its prefix (as `tessera preprocess` writes it).
        tokenizer: the data's tokenizer with its sentinels.
        encoder_length: encoder tokens per sample (the target length follows, `shape`).
        num_samples, seed, documents, cache_dir, name: as `GPTDataset`'s.
        noise_density, mean_span: T5's 0.15 and 3.
        model_vocab_size: when given, checked to hold the sentinel ids (`check_room`).
        decoder_start_token_id: the decoder's first input (T5: the pad id, 0).

    Raises:
        SentinelError: no room for the sentinels in the model, or more spans per sample than
            the tokenizer has sentinels.
    """

    def __init__(self, indexed: IndexedDataset | str | os.PathLike[str],
                 tokenizer: SentinelTokenizer, encoder_length: int, num_samples: int,
                 seed: int = 1234, documents: tuple[int, int] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, name: str = "train",
                 noise_density: float = 0.15, mean_span: float = 3.0,
                 model_vocab_size: int | None = None, decoder_start_token_id: int = 0):
        if not isinstance(tokenizer, SentinelTokenizer):
            raise SentinelError("T5 span corruption needs a tokenizer with sentinel tokens: "
                                "wrap it as core.models.t5.tokens.SentinelTokenizer(tokenizer)")
        if not 0 < noise_density < 1 or mean_span < 1:
            raise ValueError(f"noise_density must be in (0, 1) and mean_span >= 1, got "
                             f"{noise_density} and {mean_span}")
        self.tok, self.seed = tokenizer, seed
        self.shape = fit_raw_length(encoder_length, noise_density, mean_span)
        self.encoder_length, self.start = encoder_length, decoder_start_token_id
        if self.shape.max_spans > tokenizer.num_sentinels:
            raise SentinelError(f"a sample has up to {self.shape.max_spans} noise spans but the "
                                f"tokenizer has only {tokenizer.num_sentinels} sentinels; add "
                                "sentinels or shorten encoder_length")
        if model_vocab_size is not None:
            tokenizer.check_room(model_vocab_size)
        self.raw = GPTDataset(indexed, self.shape.raw_length - 1, num_samples, seed, documents,
                              cache_dir, name)
        self.raw.indexed.check_vocab(tokenizer.base)

    def __len__(self) -> int:
        return len(self.raw)

    # What the pretraining banner reports of a dataset (`training.banner.split_epochs`).
    @property
    def indexed(self) -> IndexedDataset:
        return self.raw.indexed

    @property
    def documents(self) -> tuple[int, int]:
        return self.raw.documents

    @property
    def num_samples(self) -> int:
        return self.raw.num_samples

    def raw_tokens(self, i: int) -> np.ndarray:
        """The `raw_length` tokens sample i corrupts."""
        return np.asarray(self.raw.sample_tokens(i), dtype=np.int64)

    def __getitem__(self, i: int) -> Sample:
        tokens = self.raw_tokens(i)
        rng = np.random.Generator(np.random.Philox(key=[self.seed, i]))
        inputs, targets = corrupt(tokens, noise_mask(self.shape, rng), self.tok)
        enc = np.full(self.encoder_length, self.tok.pad_id, dtype=np.int64)
        enc[: len(inputs)] = inputs
        mask = np.zeros(self.encoder_length, dtype=np.int64)
        mask[: len(inputs)] = 1
        labels = np.full(self.shape.target_length, -100, dtype=np.int64)
        labels[: len(targets)] = targets
        dec = np.concatenate([[self.start], labels[:-1]])
        dec[dec == -100] = self.tok.pad_id
        return {"encoder_ids": torch.from_numpy(enc), "encoder_mask": torch.from_numpy(mask),
                "decoder_input_ids": torch.from_numpy(dec), "labels": torch.from_numpy(labels)}


def build_t5_datasets(
    data_args: Sequence[str],
    tokenizer: SentinelTokenizer,
    encoder_length: int,
    split: str,
    num_samples: Sequence[int],
    seed: int = 1234,
    cache_dir: str | os.PathLike[str] | None = None,
    model_vocab_size: int | None = None,
) -> tuple[Dataset[Sample] | None, Dataset[Sample] | None, Dataset[Sample] | None]:
    """Train, valid and test span-corruption datasets (None where 0 samples are asked) from
    `--data` arguments, split by documents and blended as GPT's are (`gpt_dataset.
    build_split_datasets`: same split ratios, same blend); the other arguments as
    `T5SpanDataset`'s."""

    def part(ds: IndexedDataset, n: int, docs: tuple[int, int], name: str) -> Dataset[Sample]:
        return T5SpanDataset(ds, tokenizer, encoder_length, n, seed, docs, cache_dir, f"t5-{name}",
                             model_vocab_size=model_vocab_size)

    return build_split_datasets(data_args, split, num_samples, part, cache_dir)
