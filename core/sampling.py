"""Batched next-token choice with per-row settings: penalties, bans, temperature, top-k, top-p.

The one sampling implementation of the codebase: `core.generation` (one sequence) and the
server's engine (many requests, each with its own settings) both call it. Rows never interact:
a sampled row draws its token by inverse-CDF from one uniform number that the caller supplies
(from the request's own generator), so the token a row gets does not depend on which other rows
share the batch. Temperature 0 is greedy (argmax of the processed logits).

Order of operations, as in most serving stacks: penalties on the raw logits, then bans (tokens
that may not be chosen yet, e.g. EOS before `min_tokens`), then temperature, top-k, top-p.
Logprobs reported to clients are those of the *raw* model distribution (`token_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSettings:
    """Per-row sampling settings, each a tensor of shape `(B,)` on the logits' device."""

    temperature: torch.Tensor  # float; <= 0 means greedy
    top_k: torch.Tensor  # long; <= 0 means no top-k cut
    top_p: torch.Tensor  # float in (0, 1]
    repetition_penalty: torch.Tensor | None = None  # float; 1 = off
    presence_penalty: torch.Tensor | None = None  # float; 0 = off
    frequency_penalty: torch.Tensor | None = None  # float; 0 = off
    # Whether every row is greedy, when the caller knows it on the host; None reads it from
    # `temperature` (a device sync on a GPU).
    all_greedy: bool | None = None


def apply_penalties(logits: torch.Tensor, settings: RowSettings, seen: torch.Tensor | None = None,
                    counts: torch.Tensor | None = None) -> torch.Tensor:
    """Penalize tokens already used. `logits (B, V)` float; returns a new tensor.

    - repetition (CTRL-style, over `seen (B, V)` bool: tokens in the prompt or the output):
      a positive logit is divided by the penalty, a negative one multiplied by it;
    - presence / frequency (OpenAI-style, over `counts (B, V)`: occurrences in the output):
      `logit -= presence * (count > 0) + frequency * count`.
    """
    if seen is not None and settings.repetition_penalty is not None:
        penalty = settings.repetition_penalty.unsqueeze(-1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if counts is not None:
        counts = counts.to(logits.dtype)
        if settings.frequency_penalty is not None:
            logits = logits - settings.frequency_penalty.unsqueeze(-1) * counts
        if settings.presence_penalty is not None:
            logits = logits - settings.presence_penalty.unsqueeze(-1) * (counts > 0).to(logits.dtype)
    return logits


def choose_tokens(logits: torch.Tensor, settings: RowSettings, uniforms: torch.Tensor | None = None,
                  banned: torch.Tensor | None = None) -> torch.Tensor:
    """Next token ids `(B,)` from processed logits `(B, V)`.

    `uniforms (B,)` in [0, 1) drive the sampled rows (ignored for greedy ones); `banned (B, V)`
    bool marks tokens that may not be chosen.
    """
    logits = logits.float()
    if banned is not None:
        logits = logits.masked_fill(banned, float("-inf"))
    greedy = settings.temperature <= 0
    out = logits.argmax(dim=-1)
    all_greedy = settings.all_greedy
    if all_greedy is None:
        all_greedy = bool(greedy.all())
    if all_greedy:
        return out
    if uniforms is None:
        raise ValueError("sampled rows (temperature > 0) need uniforms")
    # Every row goes through the sampling arithmetic (rows never interact, so a sampled row's
    # token is what it would be alone) and greedy rows keep their argmax: no host read of which
    # rows sample.
    temperature = torch.where(greedy, torch.ones_like(settings.temperature),
                              settings.temperature)
    x = logits / temperature.unsqueeze(-1).float()
    ordered, order = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    k = settings.top_k
    k = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    kth = ordered.gather(-1, (k - 1).unsqueeze(-1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # ties with the k-th stay in
    probs = ordered.softmax(dim=-1)
    # Nucleus: drop a token once the mass before it exceeds top_p (the crossing token stays).
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before > settings.top_p.unsqueeze(-1), 0.0)
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Kept tokens form a prefix of the sorted order; never step past the last of them.
    index = torch.minimum(index, (probs > 0).sum(dim=-1) - 1).clamp(min=0)
    sampled = order.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return torch.where(greedy, out, sampled)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   top: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs under the raw distribution of `logits (B, V)`.

    Returns the logprob of `tokens (B,)` `(B,)`, and the `top` best logprobs and their ids,
    each `(B, top)`, best first.
    """
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    return chosen, values, ids


def uniforms_from(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform number in [0, 1) per row, each from its own CPU generator (0 for None)."""
    out = torch.zeros(len(generators), dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.rand((), generator=g, dtype=torch.float64)
    return out
