"""Speculative decoding for the engine: who proposes draft tokens, and how they are verified.

`tessera serve --speculative {ngram,draft} --num-speculative-tokens K` (`SpeculativeConfig`).
Each step, every decoding request that can speculate (`Speculator.eligible`) gets up to K draft
tokens; the engine runs its last token and the drafts as one row of 1 + K tokens, keeping the
logits of every position, and `Speculator.verify` (exact rejection sampling,
`core.speculative_sampling`) returns the tokens to emit: the accepted drafts, then one token
from the target. The engine then cuts the KV cache back to the accepted length
(`KVSpace.rollback`) and feeds the tokens to the request one by one, so stop tokens, stop
strings and lengths cut exactly where plain decoding would. Drafts live in `SeqState.draft`,
never in `tokens`, so no unverified token is ever hashed into the prefix cache.

Proposers:
- `NgramProposer` (prompt lookup): the most recent earlier occurrence of the sequence's last n
  tokens (n from `ngram_max` down to `ngram_min`) in its own prompt and output; the up to K
  tokens that followed it. Deterministic: a one-hot draft distribution.
- `DraftProposer`: a smaller model with the same vocabulary, in this process, with its own slot
  KV cache. Per step, for the whole batch: one pass that catches the draft's cache up on the
  tokens accepted since its last step (the whole prompt the first time), then K - 1 passes of
  one token. Drafts are drawn from the draft's distribution under the request's own settings
  (temperature, top-k, top-p; argmax for greedy requests), with the request's generator.

What falls back to plain decoding (per request, every step it applies): repetition, presence
or frequency penalties (their values depend on the tokens before each position; not
implemented position by position), and steps where `min_tokens` still bans EOS or stop tokens.
Everything else speculates (`logprobs` too: each emitted token's come from the raw logits of
its own position), and greedy output equals plain greedy output. A request with a grammar
(structured outputs) keeps only the drafts its grammar allows, and each position is verified
against the grammar's mask after the drafts before it, so only allowed tokens are emitted.

Reproducibility: a seeded request draws every number from its own generator, so its tokens do
not depend on its batch as long as each of its steps gets its full K drafts; when the step's
token budget (`max_step_tokens`) or the request's remaining length cuts its drafts, the
sequence of draws (never the output's distribution) changes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tessera.core.speculative_sampling import (
    processed_probs,
    sample_from,
    verify_greedy,
    verify_sampled,
)
from tessera.serving.engine.grammar import mask_logits

log = logging.getLogger("tessera.serving")

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (`LLMEngine(speculative=...)`).

    method: "ngram" (prompt lookup) or "draft" (a smaller model).
    num_speculative_tokens: K, draft tokens proposed per request and step.
    ngram_min, ngram_max: n-gram lengths tried by prompt lookup, longest first.
    draft_checkpoint: a Tessera checkpoint of the draft model (method "draft").
    draft_model: the draft as a `GPTModel` already built (library use, tests), instead.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    draft_checkpoint: str | None = None
    draft_model: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--speculative {self.method!r}: choose one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"--num-speculative-tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"--ngram-min ({self.ngram_min}) and --ngram-max "
                             f"({self.ngram_max}) need 1 <= ngram-min <= ngram-max")
        has_draft = self.draft_checkpoint is not None or self.draft_model is not None
        if self.method == "draft" and not has_draft:
            raise ValueError("--speculative draft needs --draft-checkpoint PATH (a smaller "
                             "Tessera checkpoint with the same tokenizer)")
        if self.method == "ngram" and has_draft:
            raise ValueError("--draft-checkpoint is for --speculative draft; prompt lookup "
                             "(ngram) needs no model")
        if self.draft_checkpoint is not None and self.draft_model is not None:
            raise ValueError("give the draft as draft_checkpoint or draft_model, not both")


def ngram_proposal(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens
    of `tokens` (n from `ngram_max` down to `ngram_min`); [] when none occurs."""
    arr = np.asarray(tokens, dtype=np.int64)
    size = len(arr)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        # Windows starting at 0 .. size - n - 1: every occurrence but the tail itself.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)
        hits = np.flatnonzero((windows == arr[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramProposer:
    """Prompt lookup over each sequence's own tokens (no model, no state)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, seqs: Sequence[Any], ks: Sequence[int]
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        c = self.config
        return [(ngram_proposal(s.tokens[s.n_virtual:], k, c.ngram_min, c.ngram_max), None)
                for s, k in zip(seqs, ks)]

    def accepted(self, seq: Any, n_before: int, n_accepted: int) -> None:
        pass

    def forget(self, running: Sequence[Any]) -> None:
        pass


class DraftProposer:
    """A draft model with its own slot KV cache (one slot per running request)."""

    def __init__(self, model: Any, max_batch: int, context: int, pad_id: int):
        from tessera.serving.engine.kv_config import KVCacheConfig
        from tessera.serving.engine.runner import ModelRunner

        if model.config.max_position_embeddings < context:
            raise ValueError(f"the draft model's context ({model.config.max_position_embeddings}"
                             f") is shorter than the served context ({context}): use a draft "
                             "with at least the target's context")
        self.runner = ModelRunner(model, max_batch, max_seq=context,
                                  kv=KVCacheConfig(kind="slots"))
        self.context, self.pad_id = context, pad_id
        self._free = list(range(max_batch))
        self._state: dict[Any, list[int]] = {}  # seq -> [slot, tokens in the draft's cache]

    def forget(self, running: Sequence[Any]) -> None:
        """Release the slots of sequences no longer running (finished or preempted)."""
        alive = set(running)
        for seq in [s for s in self._state if s not in alive]:
            self._free.append(self._state.pop(seq)[0])

    def accepted(self, seq: Any, n_before: int, n_accepted: int) -> None:
        state = self._state.get(seq)
        if state is not None:  # the drafts the target accepted stay valid in the draft's cache
            state[1] = min(state[1], n_before + n_accepted)

    def _pass(self, rows: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """One forward of the draft: rows of (slot, tokens, start position); the logits of each
        row's last token `(B, V)`."""
        from tessera.serving.engine.runner import StepBatch

        B, T = len(rows), max(len(t) for _, t, _ in rows)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        positions = torch.empty((B, T), dtype=torch.long)
        keep = []
        for r, (_, tokens, start) in enumerate(rows):
            ids[r, :len(tokens)] = torch.tensor(tokens)
            positions[r] = torch.arange(start, start + T).clamp(max=self.context - 1)
            keep.append(r * T + len(tokens) - 1)
        batch = StepBatch(ids, positions, torch.tensor([s for s, _, _ in rows]),
                          torch.full((B,), -1, dtype=torch.long), torch.tensor(keep))
        out = self.runner.forward(batch.to(self.runner.device))
        assert out is not None
        return out.cpu()

    def propose(self, seqs: Sequence[Any], ks: Sequence[int]
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        todo = [i for i, k in enumerate(ks) if k > 0]
        if not todo:
            return [([], None) for _ in seqs]
        rows = []
        for i in todo:
            seq = seqs[i]
            state = self._state.get(seq)
            if state is None:
                state = self._state[seq] = [self._free.pop(), 0]
            rows.append((state[0], seq.tokens[state[1]:], state[1]))
            state[1] = len(seq.tokens)
        logits = self._pass(rows)  # catch up: everything accepted since the last step
        for step in range(max(ks)):
            for j, i in enumerate(todo):
                seq = seqs[i]
                p = seq.params
                if p.temperature <= 0:
                    drafts[i].append(int(logits[j].float().argmax()))
                    continue
                q = processed_probs(logits[j], p.temperature, p.top_k, p.top_p)
                drafts[i].append(sample_from(q, seq.generator))
                probs[i].append(q)
            todo = [i for i in todo if ks[i] > step + 1]
            if not todo:
                break
            rows = []
            for i in todo:  # feed the newest draft token
                state = self._state[seqs[i]]
                rows.append((state[0], drafts[i][-1:], state[1]))
                state[1] += 1
            logits = self._pass(rows)
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, probs)]


class Speculator:
    """The engine's speculative decoding: proposals each step, verification of a row."""

    def __init__(self, config: SpeculativeConfig, proposer: NgramProposer | DraftProposer):
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self._q: dict[Any, torch.Tensor] = {}

    @staticmethod
    def eligible(seq: Any) -> bool:
        """Whether `seq` may speculate this step: decoding (its prompt done, one token to run)
        with settings that verification reproduces exactly."""
        p = seq.params
        return (seq.n_generated > 0 and seq.cached == len(seq.tokens) - 1
                and p.repetition_penalty == 1.0 and not p.presence_penalty
                and not p.frequency_penalty and seq.n_generated >= p.min_tokens)

    def propose(self, running: Sequence[Any], max_step_tokens: int) -> None:
        """Set `draft` on every running sequence ([] for those that do not speculate). The
        drafts fit the step's budget beside one token for every running sequence, and never
        run past a request's `max_new` (the verified step emits one more token than it
        accepts)."""
        self._q.clear()
        self.proposer.forget(running)
        spare = max_step_tokens - len(running)
        chosen, ks = [], []
        for seq in running:
            seq.draft = []
            if spare <= 0 or not self.eligible(seq):
                continue
            k = min(self.k, seq.max_new - seq.n_generated - 1, spare)
            if k > 0:
                chosen.append(seq)
                ks.append(k)
                spare -= k
        if not chosen:
            return
        for seq, (draft, q) in zip(chosen, self.proposer.propose(chosen, ks)):
            grammar = getattr(seq, "grammar", None)
            seq.draft = list(draft) if grammar is None else grammar.valid_prefix(draft)
            if len(seq.draft) < len(draft):  # the draft's cache keeps only what may be verified
                self.proposer.accepted(seq, len(seq.tokens), len(seq.draft))
            if q is not None:
                self._q[seq] = q

    def fit(self, rows: list[tuple[Any, int]], seqs: Sequence[Any]) -> None:
        """After scheduling `seqs` (the running and the just preempted): cut each draft to what
        its row runs (the budget may have cut it); drop the drafts of rows not run."""
        planned = dict(rows)
        for seq in seqs:
            if seq.draft:
                keep = max(planned.get(seq, 1) - 1, 0)
                if keep == 0:  # nothing of it will be verified: the draft's cache forgets it
                    self.proposer.accepted(seq, len(seq.tokens), 0)
                del seq.draft[keep:]

    def verify(self, seq: Any, draft: list[int], logits: torch.Tensor) -> list[int]:
        """The tokens to emit for `seq`'s row: `logits (len(draft) + 1, V)` from the target at
        the row's positions."""
        p = seq.params
        q = self._q.pop(seq, None)
        grammar = getattr(seq, "grammar", None)
        if grammar is not None:
            rows = len(draft) + 1
            logits = mask_logits(logits[:rows].float(), grammar.step_masks(rows))
        if p.temperature <= 0:
            return verify_greedy(logits, draft)
        target = processed_probs(logits, p.temperature, p.top_k, p.top_p)
        return verify_sampled(target, draft, None if q is None else q[:len(draft)],
                              seq.generator)

    def accepted(self, seq: Any, n_before: int, n_accepted: int) -> None:
        self.proposer.accepted(seq, n_before, n_accepted)


def config_from_flags(method: str | None, k: int | None, draft_checkpoint: str | None,
                      ngram_min: int | None, ngram_max: int | None) -> SpeculativeConfig | None:
    """`tessera serve`'s speculative flags as a config (None when off); a flag that needs
    another one is refused with what to add."""
    if method is None:
        given = [flag for flag, value in (("--num-speculative-tokens", k),
                                          ("--draft-checkpoint", draft_checkpoint),
                                          ("--ngram-min", ngram_min), ("--ngram-max", ngram_max))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --speculative ngram or --speculative "
                             "draft")
        return None
    if method == "draft" and (ngram_min is not None or ngram_max is not None):
        raise ValueError("--ngram-min and --ngram-max are for --speculative ngram")
    defaults = SpeculativeConfig()
    return SpeculativeConfig(
        method, k if k is not None else defaults.num_speculative_tokens,
        ngram_min if ngram_min is not None else defaults.ngram_min,
        ngram_max if ngram_max is not None else max(defaults.ngram_max, ngram_min or 0),
        draft_checkpoint)


def check_same_vocabulary(target_vocab: int, draft_vocab: int, target_tok: Any,
                          draft_tok: Any) -> None:
    """Refuse a draft whose vocabulary differs from the target's (sizes, then tokenizers)."""
    if target_vocab != draft_vocab:
        raise ValueError(f"the draft model's vocabulary ({draft_vocab} tokens) differs from the "
                         f"served model's ({target_vocab}): a draft must share the tokenizer")
    if target_tok is None or draft_tok is None:
        if target_tok is not None or draft_tok is not None:
            log.warning("the draft or the served checkpoint has no tokenizer: only the "
                        "vocabulary sizes (%d) could be compared", target_vocab)
        return
    if target_tok.model_bytes() == draft_tok.model_bytes():
        return
    for i in range(min(target_tok.vocab_size, target_vocab)):
        if target_tok.token_text(i) != draft_tok.token_text(i):
            raise ValueError(f"the draft model's tokenizer differs from the served model's "
                             f"(token {i}: {draft_tok.token_text(i)!r} vs "
                             f"{target_tok.token_text(i)!r}): a draft must share the tokenizer")


def build_speculator(config: SpeculativeConfig, *, vocab_size: int, max_batch: int,
                     context: int, pad_id: int, tokenizer: Any, dtype: torch.dtype,
                     device: torch.device) -> Speculator:
    """The engine's `Speculator` for `config`; loads and checks the draft model."""
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config))
    model, draft_tok = config.draft_model, None
    if model is None:
        from tessera.core.checkpoint import load_checkpoint, read_manifest
        from tessera.core.tokenizer import load_tokenizer

        manifest = read_manifest(config.draft_checkpoint)
        model = load_checkpoint(config.draft_checkpoint, dtype=dtype, device=device)
        draft_tok = load_tokenizer(config.draft_checkpoint) if manifest.tokenizer else None
        check_same_vocabulary(vocab_size, model.config.vocab_size, tokenizer, draft_tok)
    else:
        check_same_vocabulary(vocab_size, model.config.vocab_size, None, None)
    return Speculator(config, DraftProposer(model, max_batch, context, pad_id))
