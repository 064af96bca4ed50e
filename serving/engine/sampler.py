"""The engine's sampler: per-request settings into one batched `core.sampling` call, logprobs,
and the per-request state penalties need.

Rows never interact (`core.sampling`): each row's token comes from its own uniform number,
drawn from its request's generator, so a request's tokens do not depend on its batch. The
sequences passed in need `params` (`SamplingParams`), `n_generated`, `stop_ids`, `tokens`,
`n_virtual`, `n_input`, `seen` and `counts` (the engine's sequences have them), and may have
`grammar` (`serving.engine.grammar.RequestGrammar`): such rows sample only the tokens their
grammar allows (logprobs stay those of the raw distribution).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tessera.core.sampling import RowSettings, apply_penalties, choose_tokens, token_logprobs
from tessera.serving.engine.grammar import MaskFiller, mask_logits
from tessera.serving.engine.transfer import to_device
from tessera.serving.types import TokenLogprob

Chooser = Callable[..., torch.Tensor]  # core.sampling.choose_tokens' signature


class Sampler:
    """Samples batches of requests. Each batch's settings live on the device, built once when
    the batch's requests change (a request joins or leaves) and reused by every step between."""

    def __init__(self, vocab_size: int, eos_id: int | None, device: torch.device | str = "cpu"):
        self.vocab_size, self.eos_id, self.device = vocab_size, eos_id, torch.device(device)
        self._batch: tuple[Any, ...] = ()  # the requests `_settings` was built for, in order
        self._settings: RowSettings | None = None
        self.masks = MaskFiller()

    def prepare_masks(self, rows: Sequence[tuple[Any, int]]) -> None:
        """Start filling the grammar masks of a scheduled step's rows `(seq, tokens run)` that
        sample (their prompt done by this step), to overlap the forward pass."""
        self.masks.start([(seq, seq.draft) for seq, n in rows
                          if getattr(seq, "grammar", None) is not None
                          and seq.cached + n >= len(seq.tokens)])

    def settings(self, seqs: Sequence[Any], device: torch.device) -> RowSettings:
        """The rows' `RowSettings` on `device`: reused while the same requests come in the same
        order, else built with one copy to the device."""
        same = (self._settings is not None and len(seqs) == len(self._batch)
                and self._settings.temperature.device == device
                and all(a is b for a, b in zip(seqs, self._batch)))
        if same:
            assert self._settings is not None
            return self._settings
        params = [s.params for s in seqs]
        table = to_device(torch.tensor(
            [[p.temperature for p in params], [max(p.top_k, 0) for p in params],
             [p.top_p for p in params], [p.repetition_penalty for p in params],
             [p.presence_penalty for p in params], [p.frequency_penalty for p in params]],
            dtype=torch.float64), device)
        temperature, top_k, top_p, repetition, presence, frequency = table.unbind(0)
        self._batch = tuple(seqs)
        self._settings = RowSettings(
            temperature.float(), top_k.long(), top_p.float(), repetition.float(),
            presence.float(), frequency.float(),
            all_greedy=all(p.temperature <= 0 for p in params))
        return self._settings

    def choose(self, seqs: Sequence[Any], logits: torch.Tensor, uniforms: torch.Tensor,
               choose: Chooser = choose_tokens) -> torch.Tensor:
        """Next token ids `(B,)` for the rows `logits (B, V)` of `seqs`, on the logits' device;
        reads nothing back to the host.

        `choose` is the token chooser (the engine passes its own reference, so a test can
        inject a failure)."""
        device, vocab = logits.device, logits.shape[-1]
        settings = self.settings(seqs, device)
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
                    if banned is None:  # built on the host, copied once
                        banned = torch.zeros(len(seqs), vocab, dtype=torch.bool)
                    banned[i, sorted(ban)] = True
        logits = logits.float()
        constrained = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
        if constrained:  # one masking op for the batch's constrained rows
            masks = torch.cat([seqs[i].grammar.step_masks(1) for i in constrained])
            index = torch.tensor(constrained, device=device)
            logits = logits.index_copy(0, index, mask_logits(logits[index], masks))
        if seen is not None or counts is not None:
            logits = apply_penalties(logits, settings, seen, counts)
        return choose(logits, settings, to_device(uniforms, device),
                      None if banned is None else to_device(banned, device))

    def read_back(self, seqs: Sequence[Any], logits: torch.Tensor, chosen: torch.Tensor
                  ) -> tuple[list[int], list[TokenLogprob | None]]:
        """The host's copy of a batch's tokens `chosen (B,)` (device), with the logprobs of the
        rows that asked for them (`sampled_logprobs`), in one device-to-host transfer."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return chosen.tolist(), [None] * len(seqs)
        # Every row's logprobs, so no row index goes to the device; float64 holds the ids
        # exactly.
        top = max(seqs[i].params.logprobs for i in rows)
        lp, values, ids = token_logprobs(logits, chosen, top)
        packed = torch.cat([chosen.unsqueeze(-1).double(), lp.unsqueeze(-1).double(),
                            values.double(), ids.double()], dim=-1).tolist()
        tokens = [int(row[0]) for row in packed]
        out: list[TokenLogprob | None] = [None] * len(seqs)
        for i in rows:
            k, row = seqs[i].params.logprobs, packed[i]
            out[i] = TokenLogprob(tokens[i], row[1],
                                  {int(t): v for t, v in zip(row[2 + top:2 + top + k],
                                                             row[2:2 + k])})
        return tokens, out

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
        """Update `seq`'s penalty and grammar state with its new `token`."""
        p = seq.params
        if getattr(seq, "grammar", None) is not None:
            seq.grammar.accept(token)
        if p.repetition_penalty != 1.0:
            if seq.seen is None:
                seq.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                seq.seen[torch.tensor(seq.tokens[seq.n_virtual:seq.n_input])] = True
            seq.seen[token] = True
        if p.presence_penalty or p.frequency_penalty:
            if seq.counts is None:
                seq.counts = torch.zeros(self.vocab_size, device=self.device)
            seq.counts[token] += 1
