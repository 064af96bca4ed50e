"""BERT masked-LM samples over the indexed datasets `tessera preprocess` writes.

Special tokens: the tokenizer's vocabulary (ids `[0, V)`) is kept as is and BERT's four special
tokens are appended after it, `[CLS] = V`, `[SEP] = V + 1`, `[MASK] = V + 2`, `[PAD] = V + 3`
(`BertSpecials`), so the model's vocabulary is `V + 4`: the specials are always the last four
ids of a BERT model's vocabulary (`BertSpecials.of_model`). A model whose vocabulary was set
explicitly without that room is an error that says so (`bert_specials`).

Samples: sample i starts from the packed window of `seq_len - 3` tokens that GPT's dataset
gives for index i (the same shuffled, cached, document-crossing windows, so a split, a blend
and the cache work as for GPT). With probability `short_seq_prob` the window is cut to a random
shorter length (the rest is padding, as in the original BERT), then split at a random point into
segment A and segment B. With `nsp`, half of the samples replace B by as many tokens from the
start of another window (label `next_sentence = 1`). The sample is
`[CLS] A [SEP] B [SEP] [PAD]...` with token types 0 up to the first [SEP] and 1 after it.

Masking (Devlin et al. 2018, section 3.1): of the segment tokens (never the specials), a share
`mask_prob` is picked (the count is `floor(mask_prob * n + u)`, u uniform, so its expectation is
exact), and each picked token becomes [MASK] with probability 0.8, a random ordinary token with
0.1, and stays with 0.1; `labels` holds the original id there and -100 elsewhere.

Every random choice of sample i comes from a generator seeded by `(seed, i)` alone, so samples
are deterministic, independent of the order they are read in, and a resumed run (which starts
at sample `step * global_batch`) sees exactly what an uninterrupted one would.

`ds[i]` is `{"tokens", "labels", "token_types", "attention_mask"}` (LongTensor `(seq_len)`),
plus `"next_sentence"` (LongTensor `()`) with `nsp`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

Sample = dict[str, torch.Tensor]
NUM_SPECIALS = 4


@dataclass(frozen=True)
class BertSpecials:
    """The ids of BERT's special tokens, appended after a tokenizer vocabulary of `base`."""

    base: int  # ordinary tokens are [0, base): what random replacement draws from

    @property
    def cls(self) -> int:
        return self.base

    @property
    def sep(self) -> int:
        return self.base + 1

    @property
    def mask(self) -> int:
        return self.base + 2

    @property
    def pad(self) -> int:
        return self.base + 3

    @property
    def vocab_size(self) -> int:
        """The model vocabulary that holds the tokenizer's tokens and the four specials."""
        return self.base + NUM_SPECIALS

    @classmethod
    def of_model(cls, model_vocab: int) -> BertSpecials:
        """The specials of a BERT model whose vocabulary is `model_vocab` (the last four ids)."""
        return cls(model_vocab - NUM_SPECIALS)

    def names(self) -> dict[str, int]:
        return {"[CLS]": self.cls, "[SEP]": self.sep, "[MASK]": self.mask, "[PAD]": self.pad}


def bert_specials(tokenizer_vocab: int, model_vocab: int | None = None) -> BertSpecials:
    """The special ids for a tokenizer of `tokenizer_vocab` tokens; `model_vocab` (a vocabulary
    set explicitly) must have room for them after the tokenizer's tokens.

    Raises:
        ValueError: `model_vocab` is smaller than `tokenizer_vocab + 4`.
    """
    specials = BertSpecials(tokenizer_vocab)
    if model_vocab is not None and model_vocab < specials.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer_vocab} tokens and BERT appends [CLS] [SEP] [MASK] "
            f"[PAD] after them (ids {tokenizer_vocab}..{tokenizer_vocab + 3}), but the model's "
            f"vocab_size is {model_vocab}: set vocab_size to at least {specials.vocab_size}, or "
            "leave it out so that it follows the tokenizer")
    return specials


@dataclass(frozen=True)
class MaskingConfig:
    """How masked-LM samples are made (see the module docstring)."""

    mask_prob: float = 0.15
    nsp: bool = False  # sentence pairs with a random B half of the time, labelled
    short_seq_prob: float = 0.1


class BertDataset(Dataset[Sample]):
    """Masked-LM samples of `seq_len` tokens over packed windows (see the module docstring).

    Args:
        windows: a GPT dataset (or blend) built with sequence length `seq_len - 4`, whose item i
            gives the `seq_len - 3` tokens of window i (`tokens` plus the last of `labels`).
        seq_len: tokens per sample, specials and padding included.
        specials: the special ids (`bert_specials`).
        seed: the masking seed.
        masking: the masking, NSP and short-sequence settings.
    """

    def __init__(self, windows: Dataset, seq_len: int, specials: BertSpecials, seed: int,
                 masking: MaskingConfig | None = None) -> None:
        if seq_len < 5:
            raise ValueError(f"a BERT sample needs seq_len >= 5 ([CLS] A [SEP] B [SEP]), got "
                             f"{seq_len}")
        self.windows, self.seq_len, self.specials = windows, seq_len, specials
        self.seed, self.masking = seed, masking or MaskingConfig()

    def __len__(self) -> int:
        return len(self.windows)

    # What the run banner reads of a GPT dataset or blend (`banner.split_epochs`): the windows'.
    @property
    def datasets(self) -> list[Any] | None:
        return getattr(self.windows, "datasets", None)

    @property
    def documents(self) -> tuple[int, int]:
        return self.windows.documents

    @property
    def indexed(self) -> Any:
        return self.windows.indexed

    @property
    def num_samples(self) -> int:
        return len(self.windows)

    def _window(self, i: int) -> np.ndarray:
        if hasattr(self.windows, "sample_tokens"):  # a GPTDataset: skip the tensors
            return self.windows.sample_tokens(i)
        item = self.windows[i]
        return torch.cat([item["tokens"], item["labels"][-1:]]).numpy()

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        rng = np.random.default_rng([self.seed, i])
        m, sp = self.masking, self.specials
        body = self._window(i)
        n = len(body)
        if rng.random() < m.short_seq_prob:
            body = body[: int(rng.integers(2, n + 1))]
        cut = int(rng.integers(1, len(body)))
        a, b = body[:cut], body[cut:]
        is_random = bool(m.nsp and len(self) > 1 and rng.random() < 0.5)
        if is_random:
            j = (i + 1 + int(rng.integers(len(self) - 1))) % len(self)  # any other window
            b = self._window(j)[: len(b)]
        # One array for the four rows: one tensor conversion per sample, not four.
        rows = np.zeros((4, self.seq_len), dtype=np.int64)
        tokens, labels, types, mask = rows
        used = len(a) + len(b) + 3
        tokens[:] = sp.pad
        tokens[:used] = np.concatenate([[sp.cls], a, [sp.sep], b, [sp.sep]])
        types[len(a) + 2: used] = 1
        mask[:used] = 1
        labels[:] = self._mask(tokens, len(a), len(b), rng)
        t = torch.from_numpy(rows)
        out = {"tokens": t[0], "labels": t[1], "token_types": t[2], "attention_mask": t[3]}
        if m.nsp:
            out["next_sentence"] = t[2, 0] + int(is_random)  # a 0-d tensor (types[0] is 0)
        return out

    def _mask(self, tokens: np.ndarray, len_a: int, len_b: int,
              rng: np.random.Generator) -> np.ndarray:
        """Mask `tokens` in place; return the labels."""
        candidates = np.concatenate([np.arange(1, 1 + len_a),
                                     np.arange(len_a + 2, len_a + 2 + len_b)])
        count = int(np.floor(self.masking.mask_prob * len(candidates) + rng.random()))
        picked = rng.choice(candidates, size=min(count, len(candidates)), replace=False)
        labels = np.full_like(tokens, -100)
        labels[picked] = tokens[picked]
        r = rng.random(len(picked))
        tokens[picked[r < 0.8]] = self.specials.mask
        swap = picked[(r >= 0.8) & (r < 0.9)]
        tokens[swap] = rng.integers(0, self.specials.base, size=len(swap))
        return labels


def build_bert_datasets(
    data_args: Sequence[str],
    seq_len: int,
    split: str,
    num_samples: Sequence[int],
    specials: BertSpecials,
    seed: int = 1234,
    cache_dir: str | os.PathLike[str] | None = None,
    masking: MaskingConfig | None = None,
) -> tuple[BertDataset | None, BertDataset | None, BertDataset | None]:
    """Train, valid and test `BertDataset`s (None where 0 samples are asked) from `--data`
    arguments, over GPT's windows (`gpt_dataset.build_datasets`) of `seq_len - 3` tokens."""
    from tessera.training.gpt_dataset import build_datasets

    if seq_len < 5:
        raise ValueError(f"a BERT sample needs seq_len >= 5 ([CLS] A [SEP] B [SEP]), got {seq_len}")
    windows = build_datasets(data_args, seq_len - 4, split, num_samples, seed, cache_dir)
    return tuple(  # type: ignore[return-value]
        None if w is None else BertDataset(w, seq_len, specials, seed, masking) for w in windows)
