"""The text of each token in a logprobs answer, so that the tokens concatenate to the text.

Decoding a token alone loses what its neighbours give it: sentencepiece drops the leading space
of the first piece (`'is'` for `' is'`, `''` for a whitespace piece), and a byte-fallback piece
alone is not a character. OpenAI's logprob tokens concatenate to the text they score, and
clients (lm-eval, `text_offset` users) rely on it. So a token's text here is what it adds to
the decoded text after a few tokens of left context, exactly as the engine's incremental
detokenizer (`serving.engine.detokenize`) builds the output text:

- a token that leaves a partial character (the text ends in U+FFFD) gets `""`, and the token
  that completes the character gets the whole character;
- `bytes` of a token are the UTF-8 bytes of its text, so they concatenate too.

`TokenTexts` works over any `decode(ids) -> str` (the `Engine` protocol's), one instance per
sequence, fed in order (a stream feeds it chunk by chunk).

`top_logprobs` keys (`TokenTexts.key`) are the text a token would add, except where that text
is not a whole character or is empty (a byte-fallback piece, a special token): then distinct
keys, as vLLM spells them, `bytes:\\xNN` for a byte piece and `token_id:N` otherwise, so no two
alternatives share a key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"
ANCHOR = 4  # tokens of left context decoded along (as serving.engine.detokenize does)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte-fallback pieces
BYTES_PREFIX = "bytes:"


def key_bytes(key: str) -> list[int]:
    """The UTF-8 bytes a `top_logprobs` key stands for (`bytes:\\xNN`: that byte)."""
    if key.startswith(BYTES_PREFIX):
        return [int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", key)]
    return [] if key.startswith("token_id:") else list(key.encode())


class TokenTexts:
    """Per-token texts of a sequence that continues `context` (token ids already decoded).

    `piece(token_id)` is the vocabulary's spelling of a token (`Tokenizer.token_text`), used
    only for the keys of tokens that are not text alone."""

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = (),
                 piece: Callable[[int], str] | None = None) -> None:
        self._decode, self._piece_of = decode, piece
        self._pending: list[int] = []
        self._reported = 0  # pending tokens already answered with "" (by a non-final `texts`)
        self._set_anchor(list(context))

    def _text(self, ids: list[int]) -> str:
        return self._decode(ids) if ids else ""

    def _set_anchor(self, ids: list[int]) -> None:
        self._anchor = ids[-ANCHOR:]
        self._anchor_text = self._text(self._anchor)

    def _piece(self, ids: list[int]) -> str:
        """What `ids` add to the text after the anchor."""
        full = self._text(self._anchor + ids)
        if full.startswith(self._anchor_text):
            return full[len(self._anchor_text):]
        return self._text(ids)  # the anchor's text did not survive: decode without it

    def alternative(self, token_id: int) -> str:
        """The text `token_id` would add at the next position (for `top_logprobs` keys)."""
        return self._piece(self._pending + [token_id])[len(self._piece(self._pending)):] \
            if self._pending else self._piece([token_id])

    @classmethod
    def of(cls, engine: Any, context: Sequence[int] = ()) -> TokenTexts:
        """Token texts over an `Engine` (its tokenizer's spellings when it has one)."""
        tokenizer = getattr(engine, "tokenizer", None)
        return cls(engine.decode, context, getattr(tokenizer, "token_text", None))

    def key(self, token_id: int) -> str:
        """The `top_logprobs` key of `token_id` at the next position (module docstring)."""
        text = self.alternative(token_id)
        if text and REPLACEMENT not in text:
            return text
        match = _BYTE_PIECE.fullmatch(self._piece_of(token_id)) if self._piece_of else None
        return f"{BYTES_PREFIX}\\x{match.group(1).lower()}" if match else f"token_id:{token_id}"

    def push(self, token_id: int) -> list[str]:
        """Append a token; the texts of the tokens this completes (none while a character is
        still partial, then one per token held back, the last one carrying the text)."""
        self._pending.append(token_id)
        piece = self._piece(self._pending)
        if piece.endswith(REPLACEMENT):
            return []
        return self._commit(piece)

    def flush(self) -> list[str]:
        """The texts of tokens still held back (a partial character at the end)."""
        return self._commit(self._piece(self._pending)) if self._pending else []

    def _commit(self, piece: str) -> list[str]:
        out = [""] * (len(self._pending) - 1 - self._reported) + [piece]
        self._set_anchor(self._anchor + self._pending)
        self._pending, self._reported = [], 0
        return out

    def end(self, final: bool = True) -> list[str]:
        """Close a run of `push`es: with `final`, flush; otherwise (a stream chunk that more
        will follow) answer tokens of a still-partial character with "" now; the token that
        completes it in a later chunk carries the character."""
        if final:
            if self._reported == len(self._pending):  # all answered already
                self._pending, self._reported = [], 0
                return []
            return self.flush()
        held = len(self._pending) - self._reported
        self._reported = len(self._pending)
        return [""] * held

    def texts(self, ids: Sequence[int], final: bool = True) -> list[str]:
        """The texts of `ids`, in order (`final`: see `end`)."""
        out: list[str] = []
        for token_id in ids:
            out += self.push(int(token_id))
        return out + self.end(final)


def prompt_texts(decode: Callable[[list[int]], str], ids: Sequence[int], bos: Sequence[int] = ()
                 ) -> list[str]:
    """The texts of a prompt's tokens; a leading BOS that the server added (`bos`, as the ids
    `encode("", add_bos=True)` gives) has no text, as the echoed prompt has none."""
    ids = list(ids)
    n = len(bos)
    if n and ids[:n] == list(bos):
        return [""] * n + TokenTexts(decode, ids[:n]).texts(ids[n:])
    return TokenTexts(decode).texts(ids)


def fit_to(texts: list[str], target: str) -> list[str]:
    """`texts` cut so that they concatenate to `target` when they overshoot it (a stop string
    cut inside the last tokens); unchanged otherwise."""
    joined = "".join(texts)
    if joined == target or not joined.startswith(target):
        return texts
    out, left = [], len(target)
    for text in texts:
        out.append(text[:max(left, 0)])
        left -= len(text)
    return out
