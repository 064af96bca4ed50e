"""Span-corruption evaluation of a T5 checkpoint (`tessera evaluate` on a family "t5" model).

The documents are cut into windows of the raw length whose corrupted input fits `seq_len`
encoder tokens (`t5_data.fit_raw_length`), and each window is corrupted exactly as pretraining
corrupts its samples (`t5_data.noise_mask` / `corrupt`: 15% noise, mean span 3), its noise drawn
from a generator seeded by (`seed`, window index), so the same checkpoint and data always give
the same numbers. The result is the mean cross-entropy over the target tokens (sentinels and EOS
included, as in training), its exponential, and the token accuracy: the share of target tokens
that are the model's top prediction given the true prefix (teacher forcing).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tessera.core.models.t5.tokens import DEFAULT_SENTINELS, SentinelTokenizer
from tessera.training.evaluate import windows
from tessera.training.t5_data import corrupt, fit_raw_length, noise_mask

EVAL_SEED = 1234


def _sample(tokens: np.ndarray, shape, tok: SentinelTokenizer, seq_len: int, start: int,
            i: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.Generator(np.random.Philox(key=[seed, i]))
    inputs, targets = corrupt(tokens, noise_mask(shape, rng), tok)
    enc = np.full(seq_len, tok.pad_id, dtype=np.int64)
    enc[: len(inputs)] = inputs
    mask = (np.arange(seq_len) < len(inputs)).astype(np.int64)
    labels = np.full(shape.target_length, -100, dtype=np.int64)
    labels[: len(targets)] = targets
    dec = np.concatenate([[start], labels[:-1]])  # as `t5_data.T5SpanDataset` makes them
    dec[dec == -100] = tok.pad_id
    return enc, mask, dec, labels


@torch.no_grad()
def evaluate_span_corruption(model, documents: Iterable[np.ndarray], seq_len: int,
                             batch: int = 8, max_windows: int | None = None, *,
                             checkpoint: str | Path, seed: int = EVAL_SEED
                             ) -> dict[str, float]:
    """Span-corruption loss, perplexity and token accuracy of the T5 `model` over `documents`
    (`checkpoint`: where its tokenizer is, for the EOS and pad ids)."""
    from tessera.core.tokenizer import load_tokenizer

    shape = fit_raw_length(seq_len)
    tok = SentinelTokenizer(load_tokenizer(Path(checkpoint)), DEFAULT_SENTINELS)
    tok.check_room(model.config.vocab_size)
    # `windows` yields seq_len + 1 tokens per window: ask for raw_length - 1.
    held = list(windows(documents, shape.raw_length - 1, max_windows))
    if not held:
        raise ValueError(f"fewer than {shape.raw_length} tokens to evaluate on: lower "
                         "--seq-len, or choose another --split")
    total, correct, count = 0.0, 0, 0
    for start in range(0, len(held), batch):
        rows = [_sample(w.numpy(), shape, tok, seq_len, model.config.options.decoder_start_token_id,
                        start + k, seed)
                for k, w in enumerate(held[start:start + batch])]
        enc, mask, dec, labels = (torch.from_numpy(np.stack(c)) for c in zip(*rows))
        logits = model(enc, decoder_input_ids=dec, encoder_mask=mask).float()
        picked = labels != -100
        total += float(F.cross_entropy(logits[picked], labels[picked], reduction="sum"))
        correct += int((logits[picked].argmax(-1) == labels[picked]).sum())
        count += int(picked.sum())
    mean = total / max(count, 1)
    return {"loss": mean, "perplexity": math.exp(mean), "accuracy": correct / max(count, 1),
            "tokens": count, "objective": "span-corruption"}
