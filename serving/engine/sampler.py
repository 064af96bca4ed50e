"""The engine's sampler: per-request settings into one batched `core.sampling` call, logprobs,
and the per-request state penalties need.

Rows never interact (`core.sampling`): each row's token comes from its own uniform number,
drawn from its request's generator, so a request's tokens do not depend on its batch. The
sequences passed in need `params` (`SamplingParams`), `n_generated`, `stop_ids`, `tokens`,
`n_virtual`, `n_input`, `seen` and `counts` (the engine's sequences have them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tessera.core.sampling import RowSettings, apply_penalties, choose_tokens, token_logprobs
from tessera.serving.types import TokenLogprob

Chooser = Callable[..., torch.Tensor]  # core.sampling.choose_tokens' signature


class Sampler:
    def __init__(self, vocab_size: int, eos_id: int | None, device: torch.device | str = "cpu"):
        self.vocab_size, self.eos_id, self.device = vocab_size, eos_id, torch.device(device)

    def choose(self, seqs: Sequence[Any], logits: torch.Tensor, uniforms: torch.Tensor,
               choose: Chooser = choose_tokens) -> torch.Tensor:
        """Next token ids `(B,)` for the rows `logits (B, V)` of `seqs`.

        `choose` is the token chooser (the engine passes its own reference, so a test can
        inject a failure)."""
        device, vocab = logits.device, logits.shape[-1]
        params = [s.params for s in seqs]

        def column(values, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        settings = RowSettings(column([p.temperature for p in params]),
                               column([max(p.top_k, 0) for p in params], torch.long),
                               column([p.top_p for p in params]),
                               column([p.repetition_penalty for p in params]),
                               column([p.presence_penalty for p in params]),
                               column([p.frequency_penalty for p in params]))
        seen = counts = banned = None
        if any(s.seen is not None for s in seqs):
            seen = torch.stack([s.seen if s.seen is not None else
                                torch.zeros(vocab, dtype=torch.bool, device=device) for s in seqs])
        if any(s.counts is not None for s in seqs):
            counts = torch.stack([s.counts if s.counts is not None else
                                  torch.zeros(vocab, device=device) for s in seqs])
        for i, s in enumerate(seqs):
            if s.n_generated < s.params.min_tokens:
                ban = set(s.stop_ids)
                if self.eos_id is not None and not s.params.ignore_eos:
                    ban.add(self.eos_id)
                if ban:
                    if banned is None:
                        banned = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
                    banned[i, sorted(ban)] = True
        logits = logits.float()
        if seen is not None or counts is not None:
            logits = apply_penalties(logits, settings, seen, counts)
        return choose(logits, settings, uniforms.to(device), banned)

    def sampled_logprobs(self, seqs: Sequence[Any], logits: torch.Tensor,
                         tokens: list[int | None]) -> list[TokenLogprob | None]:
        """The logprob (and top alternatives) of each row's chosen token, for the rows whose
        request asked for logprobs (None elsewhere), under the raw distribution."""
        rows = [i for i, s in enumerate(seqs)
                if s.params.logprobs is not None and tokens[i] is not None]
        out: list[TokenLogprob | None] = [None] * len(seqs)
        if not rows:
            return out
        top = max(seqs[i].params.logprobs for i in rows)
        chosen, values, ids = token_logprobs(
            logits[rows], torch.tensor([tokens[i] for i in rows], device=logits.device), top)
        chosen, values, ids = chosen.tolist(), values.tolist(), ids.tolist()
        for j, i in enumerate(rows):
            k = seqs[i].params.logprobs
            out[i] = TokenLogprob(tokens[i], chosen[j], dict(zip(ids[j][:k], values[j][:k])))
        return out

    def score_prompts(self, wanted: Sequence[tuple[Any, int | None]],
                      logits: torch.Tensor) -> None:
        """Fill `seq.prompt_logprobs` for the rows of `wanted` `(seq, prompt position t)`:
        row i of `logits` predicts token `t + 1`. Rows with t None are skipped."""
        rows = [i for i, (_, t) in enumerate(wanted) if t is not None]
        if not rows:
            return
        targets = torch.tensor([wanted[i][0].tokens[wanted[i][1] + 1] for i in rows],
                               device=logits.device)
        top = max(wanted[i][0].params.logprobs or 0 for i in rows)
        chosen, values, ids = token_logprobs(logits[rows], targets, top)
        chosen, values, ids = chosen.tolist(), values.tolist(), ids.tolist()
        for j, i in enumerate(rows):
            seq, t = wanted[i]
            k = seq.params.logprobs or 0
            seq.prompt_logprobs[t + 1 - seq.n_virtual] = TokenLogprob(
                int(targets[j]), chosen[j], dict(zip(ids[j][:k], values[j][:k])))

    def track(self, seq: Any, token: int) -> None:
        """Update `seq`'s penalty state with its new `token`."""
        p = seq.params
        if p.repetition_penalty != 1.0:
            if seq.seen is None:
                seq.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                seq.seen[torch.tensor(seq.tokens[seq.n_virtual:seq.n_input])] = True
            seq.seen[token] = True
        if p.presence_penalty or p.frequency_penalty:
            if seq.counts is None:
                seq.counts = torch.zeros(self.vocab_size, device=self.device)
            seq.counts[token] += 1
