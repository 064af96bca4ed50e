"""Structured outputs in the engine: constraints compiled by xgrammar into per-request matchers,
and the token masks of each step's constrained rows.

Contract:
- `GrammarCompiler.matcher(constraint)` compiles a `StructuredOutput` (cached per constraint)
  into a `RequestGrammar`, raising `RequestError` for an invalid constraint (the reason) or
  when xgrammar is not installed (the install command). Compile before queueing: a request
  that gets a matcher never fails later for its grammar.
- A `RequestGrammar` follows its request's generated tokens (`accept`) and ends with EOS (or
  one of the request's stop token ids): the grammar allows them only once the text is complete.
- `MaskFiller.start(rows)` fills, in a worker thread, the masks the step's constrained rows
  need: one row for the next token, plus one per draft token for speculative rows (the state
  after each draft prefix). It is called once the step is scheduled and overlaps the forward
  pass; `RequestGrammar.step_masks()` waits for them (or fills them on the spot when the step
  did not start them).
- Masks are xgrammar's packed bitmasks (int32, bit `t % 32` of word `t // 32`: token t
  allowed); `mask_logits` applies them on any device.

xgrammar is optional (`pip install 'tessera[structured]'`): it is imported on the first
constrained request only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tessera.core.tokenizer import Tokenizer
from tessera.serving.types import RequestError, StructuredOutput

INSTALL_HINT = "pip install 'tessera[structured]' (or pip install xgrammar)"


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise RequestError("structured outputs (response_format, guided_*, tool_choice "
                           f"'required' or named) need the xgrammar package: {INSTALL_HINT}"
                           ) from None
    return xgrammar


def available() -> bool:
    """Whether xgrammar can be imported (structured outputs are served)."""
    try:
        _xgrammar()
    except RequestError:
        return False
    return True


def _tokenizer_info(xgr: Any, tokenizer: Tokenizer, vocab_size: int) -> Any:
    """xgrammar's view of `tokenizer`: each id's bytes, padded to the model's `vocab_size`."""
    if tokenizer.kind == "huggingface":
        from tokenizers import Tokenizer as RawTokenizer
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(
            tokenizer_object=RawTokenizer.from_str(tokenizer.model_bytes().decode("utf-8")))
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    # sentencepiece: "▁" is a space, "<0xNN>" a byte; generated tokens decode in context, so
    # no leading space is dropped.
    pieces = [tokenizer.token_text(i) for i in range(tokenizer.vocab_size)]
    return xgr.TokenizerInfo(pieces, xgr.VocabType.BYTE_FALLBACK, vocab_size=vocab_size,
                             add_prefix_space=False)


def _choice_grammar(choices: Any) -> str:
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise RequestError("guided_choice takes a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# xgrammar's rule for the characters of a length-bounded string admits raw control characters
# (U+0000-U+001F), which JSON forbids; its unbounded strings already exclude them.
_LOOSE_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\"\\\0-\x1f]'


def _json_schema_ebnf(xgr: Any, schema: Any, strict: bool) -> str:
    """The EBNF of `schema` (compact separators, rule `root`), with JSON's string characters.
    JSON string literals are valid EBNF literals (same escapes), which the callers use."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                           strict_mode=strict)
    return str(grammar).replace(_LOOSE_STRING_CHARS, _JSON_STRING_CHARS)


class GrammarCompiler:
    """Compiles constraints for one tokenizer (thread-safe; xgrammar caches what it compiled).

    Args:
        vocab_size: the model's vocabulary (masks cover it; ids past the tokenizer's are banned).
        eos_id: the end-of-sequence id that completes a constrained output.
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_id: int | None):
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        xgr = _xgrammar()
        if self.tokenizer is None:
            raise RequestError("structured outputs need the model's tokenizer; this engine has "
                               "none")
        if self.eos_id is None:
            raise RequestError("structured outputs need an EOS token to end on; this "
                               "tokenizer has none")
        with self._lock:
            if self._compiler is None:
                info = _tokenizer_info(xgr, self.tokenizer, self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, constraint: StructuredOutput) -> Any:
        """xgrammar's compiled grammar for `constraint`; `RequestError` says why it is invalid."""
        compiler, kind, spec = self._get(), constraint.kind, constraint.spec
        xgr = _xgrammar()
        try:
            if kind == "json":
                return compiler.compile_builtin_json_grammar()
            if kind == "json_schema":
                if not isinstance(spec, (dict, bool)):
                    raise RequestError("a JSON schema must be an object")
                ebnf = _json_schema_ebnf(xgr, spec, constraint.strict)
                if not constraint.prefix and not constraint.suffix:
                    return compiler.compile_grammar(ebnf)
                # JSON string literals are valid EBNF literals (same escapes).
                wrapped = (f"{ebnf}\nwrapped_root ::= {json.dumps(constraint.prefix)} root "
                           f"{json.dumps(constraint.suffix)}\n")
                return compiler.compile_grammar(wrapped, root_rule_name="wrapped_root")
            if kind == "regex":
                if not isinstance(spec, str) or not spec:
                    raise RequestError("a regex constraint must be a non-empty string")
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(spec))
            if kind == "grammar":
                if not isinstance(spec, str) or not spec.strip():
                    raise RequestError("a grammar constraint must be a non-empty EBNF string")
                return compiler.compile_grammar(spec)
        except RequestError:
            raise
        except Exception as exc:  # xgrammar reports parse errors as RuntimeError/ValueError
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise RequestError(f"invalid {kind.replace('_', ' ')} constraint: {reason}") from None
        raise RequestError(f"unknown structured output kind {kind!r}")

    def matcher(self, constraint: StructuredOutput,
                stop_ids: Sequence[int] = ()) -> RequestGrammar:
        """A fresh matcher for one request; it ends on EOS or any of `stop_ids`."""
        xgr = _xgrammar()
        compiled = self.compile(constraint)
        stops = sorted({self.eos_id, *stop_ids} - {None})
        return RequestGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stops),
                              self.vocab_size)


class RequestGrammar:
    """One request's grammar state: the tokens it accepted so far, and its next masks."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self._pending: Future | None = None  # this step's masks, being filled

    def accept(self, token: int) -> None:
        """Advance by a generated `token`; a token the grammar forbids is a bug upstream."""
        if not self.matcher.accept_token(int(token)):
            raise RuntimeError(f"token {token} breaks the request's grammar")

    def valid_prefix(self, draft: Sequence[int]) -> list[int]:
        """The longest prefix of `draft` the grammar allows from the current state (the state
        is left as it was)."""
        n = 0
        for token in draft:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return list(draft[:n])

    def fill(self, bitmask: torch.Tensor, row: int, draft: Sequence[int] = ()) -> int:
        """Fill `bitmask[row + j]` with the mask after `draft[:j]`, j = 0..len(draft) (the draft
        must be allowed, see `valid_prefix`); the state is left as it was. Returns rows filled."""
        m = self.matcher
        m.fill_next_token_bitmask(bitmask, row)
        for j, token in enumerate(draft, 1):
            if not m.accept_token(int(token)):
                raise RuntimeError(f"draft token {token} breaks the request's grammar")
            if not m.is_terminated():  # after EOS nothing follows: the row is never used
                m.fill_next_token_bitmask(bitmask, row + j)
        if draft:
            m.rollback(len(draft))
        return 1 + len(draft)

    def masks_coming(self, pending: Future) -> None:
        """This step's masks are being filled by `pending` (`MaskFiller.start`)."""
        self._pending = pending

    def step_masks(self, n_rows: int) -> torch.Tensor:
        """This step's masks `(n_rows, words)`: those `MaskFiller.start` filled, else now."""
        pending, self._pending = self._pending, None
        if pending is not None:
            masks = pending.result().get(self)
            if masks is not None and masks.shape[0] >= n_rows:
                return masks[:n_rows]
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        if n_rows == 1:
            self.fill(bitmask, 0)
            return bitmask
        raise RuntimeError("the masks of a speculative row were not prepared for this step")


class MaskFiller:
    """Fills the next step's masks in one worker thread, overlapping the forward pass."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, rows: Sequence[tuple[Any, Sequence[int]]]) -> None:
        """Start filling the masks of `rows`: `(seq, draft)` for each constrained sequence that
        samples this step (`seq.grammar` set)."""
        if not rows:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-grammar")
        jobs = [(seq.grammar, list(draft)) for seq, draft in rows]
        future = self._pool.submit(_fill_all, jobs)
        for grammar, _ in jobs:
            grammar.masks_coming(future)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _fill_all(jobs: list[tuple[RequestGrammar, list[int]]]) -> dict[RequestGrammar, torch.Tensor]:
    """Every job's masks in one bitmask tensor (a view per grammar): the rows of the jobs
    without drafts in one batched xgrammar call, then each speculative job's rows."""
    xgr = _xgrammar()
    starts, total = [], 0
    for _, draft in jobs:
        starts.append(total)
        total += 1 + len(draft)
    bitmask = xgr.allocate_token_bitmask(total, jobs[0][0].vocab_size)
    plain = [(grammar, row) for (grammar, draft), row in zip(jobs, starts) if not draft]
    if plain:
        xgr.BatchGrammarMatcher(max_threads=1).batch_fill_next_token_bitmask(
            [grammar.matcher for grammar, _ in plain], bitmask, [row for _, row in plain])
    out = {}
    for (grammar, draft), row in zip(jobs, starts):
        if draft:
            grammar.fill(bitmask, row, draft)
        out[grammar] = bitmask[row:row + 1 + len(draft)]
    return out


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits (R, V)` with the tokens `bitmask (R, words)` forbids set to -inf (a new tensor)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., :vocab]
    return logits.masked_fill(~allowed, float("-inf"))
