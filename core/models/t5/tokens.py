"""T5's sentinel tokens, added on top of a tokenizer's vocabulary.

Span corruption replaces each masked span by a sentinel `<extra_id_k>` (k = 0, 1, ... in order)
in the encoder input and puts the sentinel before the span in the target. As in T5 and its
Hugging Face tokenizer, the `num_sentinels` sentinels take the ids right above the tokenizer's
own pieces, from the top down: `<extra_id_0>` is `base.vocab_size + num_sentinels - 1`. So the
model's vocabulary must have room for them (`check_room`): T5 v1.1's has 32000 pieces + 100
sentinels (+ 28 unused rows).

`SentinelTokenizer` wraps any `core.tokenizer.Tokenizer`: `encode` reads `<extra_id_k>` in text
as the sentinel, `decode` writes it back, everything else is the base tokenizer's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tessera.core.tokenizer import Tokenizer

SENTINEL = re.compile(r"<extra_id_(\d+)>")
DEFAULT_SENTINELS = 100  # as T5


class SentinelError(ValueError):
    """No room for the sentinels, or more spans than sentinels; the message says the fix."""


class SentinelTokenizer:
    """`base` plus `num_sentinels` sentinel ids above its vocabulary (see the module docstring)."""

    def __init__(self, base: Tokenizer, num_sentinels: int = DEFAULT_SENTINELS):
        if num_sentinels < 1:
            raise SentinelError(f"num_sentinels must be >= 1, got {num_sentinels}")
        self.base, self.num_sentinels = base, num_sentinels
        self.vocab_size = base.vocab_size + num_sentinels
        self.eos_id, self.pad_id = base.eod_id, base.pad_id

    def sentinel_id(self, k: int) -> int:
        """The id of `<extra_id_k>`."""
        if not 0 <= k < self.num_sentinels:
            raise SentinelError(f"sentinel {k} does not exist: this tokenizer has "
                                f"{self.num_sentinels} (<extra_id_0> .. "
                                f"<extra_id_{self.num_sentinels - 1}>)")
        return self.vocab_size - 1 - k

    def sentinel_index(self, token_id: int) -> int | None:
        """k for the id of `<extra_id_k>`, None for any other id."""
        k = self.vocab_size - 1 - int(token_id)
        return k if 0 <= k < self.num_sentinels else None

    def check_room(self, model_vocab_size: int) -> None:
        """Raise `SentinelError` unless a model of `model_vocab_size` has rows for every id."""
        if model_vocab_size < self.vocab_size:
            raise SentinelError(
                f"the tokenizer has {self.base.vocab_size} pieces and T5 span corruption adds "
                f"{self.num_sentinels} sentinel tokens above them (ids up to "
                f"{self.vocab_size - 1}), but the model's vocabulary has only "
                f"{model_vocab_size} rows: set the model's vocab_size to at least "
                f"{self.vocab_size} (T5 uses the tokenizer's size + 100), or use fewer "
                f"sentinels (at least the spans per sample)")

    def encode(self, text: str, eos: bool = False) -> list[int]:
        """Ids of `text`, with each `<extra_id_k>` as its sentinel id."""
        ids: list[int] = []
        pos = 0
        for m in SENTINEL.finditer(text):
            if m.start() > pos:
                ids += self.base.encode(text[pos:m.start()])
            ids.append(self.sentinel_id(int(m.group(1))))
            pos = m.end()
        if pos < len(text):
            ids += self.base.encode(text[pos:])
        return ids + [self.eos_id] if eos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, each sentinel written `<extra_id_k>`."""
        out, run = [], []
        for i in ids:
            k = self.sentinel_index(i)
            if k is None:
                run.append(int(i))
                continue
            out.append(self.base.decode(run))
            out.append(f"<extra_id_{k}>")
            run = []
        out.append(self.base.decode(run))
        return "".join(out)
