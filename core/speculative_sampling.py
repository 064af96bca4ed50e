"""Exact rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A proposer guesses `k` tokens `x_1..x_k`; one target pass scores them all, giving the target's
(processed) distributions `p_0..p_k` (`p_i` predicts the token after `x_1..x_i`). Then, left
to right, `x_i` is accepted with probability `min(1, p(x_i) / q(x_i))`, where `q` is the
distribution the proposer drew `x_i` from; the first rejection is replaced by a draw from
`normalize(max(0, p - q))` and ends the run; if all `k` are accepted, one more token is drawn
from `p_k`. Every emitted token is then distributed exactly as plain sampling from the target
would be. A deterministic proposer (prompt lookup) is a one-hot `q`: accept with probability
`p(x)`, residual `p` without `x`.

Greedy (temperature 0): `x_i` is accepted iff it is the argmax of its target logits, and the
first mismatch (or the bonus) is that argmax, so the output is the plain greedy output.

Draws come from the caller's generator (one request's own), in a fixed order, so a seeded
request's tokens do not depend on what else is in the batch. `processed_probs` turns logits
into the distribution `core.sampling.choose_tokens` samples from (temperature, top-k with ties
kept, nucleus), so the target and the draft use one definition.
"""

from __future__ import annotations

import numpy as np
import torch


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                    top_p: float = 1.0) -> torch.Tensor:
    """Probabilities `(..., V)` fp64 that `choose_tokens` samples from for `logits (..., V)`
    with these settings (temperature > 0; no penalties or bans)."""
    if temperature <= 0:
        raise ValueError("processed_probs is for sampled rows (temperature > 0)")
    x = logits.double() / temperature
    ordered, order = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    k = min(top_k, vocab) if top_k > 0 else vocab
    kth = ordered[..., k - 1:k]
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # ties with the k-th stay in
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before > top_p, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, order, probs)


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _draw(probs: np.ndarray, u: float) -> int:
    """Inverse CDF of `probs (V,)` at `u` in [0, 1): a token with positive mass."""
    cdf = np.cumsum(probs)
    index = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(probs) - 1)
    while probs[index] <= 0 and index > 0:  # rounding at the top end: step back to a real token
        index -= 1
    return index


def _numpy(probs: torch.Tensor) -> np.ndarray:
    return probs.detach().to("cpu", torch.float64).numpy()


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs (V,)` by inverse CDF with one uniform draw from `generator`."""
    return _draw(_numpy(probs), _uniform(generator))


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> list[int]:
    """Tokens emitted for `draft` (k tokens) given the target's logits `(k + 1, V)`: the
    accepted prefix of the draft, then the target's argmax after it."""
    best = target_logits.float().argmax(dim=-1).tolist()
    out: list[int] = []
    for i, x in enumerate(draft):
        if x != best[i]:
            break
        out.append(x)
    out.append(best[len(out)])
    return out


def verify_sampled(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """Tokens emitted for `draft` (k tokens) by exact rejection sampling.

    `target_probs (k + 1, V)`: the target's processed distributions; `draft_probs (k, V)`: the
    distributions the draft tokens were drawn from, or None for a deterministic proposer. Uses
    one uniform per examined draft token, plus one for the rejection's or the bonus's draw.
    Returns the accepted tokens and then the one drawn token (between 1 and k + 1 tokens).
    """
    target = _numpy(target_probs)
    proposal = None if draft_probs is None else _numpy(draft_probs)
    out: list[int] = []
    for i, x in enumerate(draft):
        p = target[i]
        qx = 1.0 if proposal is None else float(proposal[i, x])
        u = _uniform(generator)
        if qx > 0 and u * qx < p[x]:  # u < p(x) / q(x), without dividing
            out.append(x)
            continue
        if proposal is None:
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - proposal[i], 0.0)
        if residual.sum() <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = p
        out.append(_draw(residual, _uniform(generator)))
        return out
    out.append(_draw(target[len(draft)], _uniform(generator)))
    return out
