"""Incremental detokenization and stop strings: text is released only once it is final.

Two things can make the end of a partial output unfinished:
- a multi-byte character split over byte-fallback pieces decodes to U+FFFD until its last byte
  arrives, so a trailing U+FFFD is held back;
- text that could be the start of a stop string is held back until it is clear whether the stop
  string follows (if it does, the stop string and everything after it are never sent).

`OutputText` tracks one request: tokens come in with `add`, deltas go out with `take`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.core.tokenizer import Tokenizer
from tessera.serving.types import TokenLogprob

REPLACEMENT = "\ufffd"
_ANCHOR = 4  # tokens of left context decoded along, so a piece keeps its leading space


class IncrementalDecoder:
    """The text of a growing list of token ids, decoding only a short window per new token.

    Decoding pieces alone loses context (sentencepiece drops the leading space of the first
    piece; a byte piece alone is not a character), so each new window is decoded after a few
    anchor tokens and the anchor's own text is cut off. The window is committed (and the
    anchor moved) whenever its text does not end in U+FFFD, i.e. when it is complete.
    """

    def __init__(self, tokenizer: Tokenizer | None, context_ids: list[int]):
        self.tokenizer = tokenizer
        self.text = ""  # final text so far (without a trailing partial character)
        self._window: list[int] = []
        self._set_anchor(list(context_ids))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None and ids else ""

    def _set_anchor(self, ids: list[int]) -> None:
        self._anchor = ids[-_ANCHOR:]
        self._anchor_text = self._decode(self._anchor)

    def _window_text(self) -> str:
        full = self._decode(self._anchor + self._window)
        if full.startswith(self._anchor_text):
            return full[len(self._anchor_text):]
        return self._decode(self._window)  # the anchor did not survive: decode without it

    def push(self, token_id: int) -> None:
        """Append a token; `text` grows by whatever became final."""
        self._window.append(token_id)
        piece = self._window_text()
        if piece.endswith(REPLACEMENT):
            return  # maybe a partial character: wait for more bytes
        self.text += piece
        self._set_anchor(self._anchor + self._window)
        self._window = []

    def flush(self) -> str:
        """All text, including a partial character at the end (for the final event)."""
        return self.text + (self._window_text() if self._window else "")


def stop_prefix_length(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper or full prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop), len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def find_stop(text: str, stops: list[str], start: int, new_from: int) -> int | None:
    """Index of the earliest stop string in `text` that starts at or after `start` and ends
    after `new_from` (so only matches completed by the newest text count), or None."""
    found = None
    for stop in stops:
        i = text.find(stop, max(start, new_from - len(stop) + 1))
        if i >= 0 and (found is None or i < found):
            found = i
    return found


@dataclass
class _Pending:
    token_id: int
    logprob: TokenLogprob | None
    start: int  # span of the token's text in the output text
    end: int


class OutputText:
    """The visible output of one request: tokens in, (token ids, text, logprobs) deltas out.

    A token is released together with its text: once all of it is final and no stop string can
    still begin inside it. When a stop string matches, the text is cut before it and the tokens
    lying wholly inside (or after) it are never released.
    """

    def __init__(self, tokenizer: Tokenizer | None, context_ids: list[int], stops: list[str]):
        self.decoder = IncrementalDecoder(tokenizer, context_ids)
        self.stops = [s for s in stops if s]
        self.sent = 0  # characters of text already released
        self.cut: int | None = None  # where a matched stop string begins
        self._pending: list[_Pending] = []

    def add(self, token_id: int, logprob: TokenLogprob | None, check_stop: bool) -> bool:
        """Append a sampled (visible) token; True if it completed a stop string."""
        before = len(self.decoder.text)
        self.decoder.push(token_id)
        text = self.decoder.text
        self._pending.append(_Pending(token_id, logprob, before, len(text)))
        if check_stop and self.stops and len(text) > before:
            self.cut = find_stop(text, self.stops, self.sent, before)
        return self.cut is not None

    def add_silent(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """Append a token that adds no text (a stop token or EOS that ends the request): its
        id and logprob are released after every token before it."""
        end = len(self.decoder.text)
        self._pending.append(_Pending(token_id, logprob, end, end))

    def take(self, final: bool = False) -> tuple[list[int], str, list[TokenLogprob | None]]:
        """Release what is final: `(token ids, text delta, their logprobs)`."""
        text = self.decoder.text
        if self.cut is not None:
            limit = self.cut
        elif final:
            text = self.decoder.flush()
            limit = len(text)
        else:
            limit = len(text) - stop_prefix_length(text, self.stops)
        out: list[_Pending] = []
        while self._pending:
            p = self._pending[0]
            if self.cut is not None:
                ok = p.start < self.cut or p.end <= self.cut
            else:
                ok = final or p.end <= limit
            if not ok:
                break
            out.append(self._pending.pop(0))
        if self.cut is not None:
            self._pending.clear()  # inside the stop string: never released
        delta = text[self.sent:limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return [p.token_id for p in out], delta, [p.logprob for p in out]
