"""Exact rejection sampling (`core.speculative_sampling`) against the distributions it must keep.

References: `core.sampling.choose_tokens` (the engine's one sampler: `processed_probs` must be
its distribution, measured on a fine grid of its uniform input), the target `p` itself
(chi-square over many seeded draws: emitted tokens are distributed as `p`, whatever `q`), and
plain argmax for greedy.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from tessera.core.sampling import RowSettings, choose_tokens
from tessera.core.speculative_sampling import (
    processed_probs,
    sample_from,
    verify_greedy,
    verify_sampled,
)

V, K = 8, 3


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of `counts` against `probs` (cells with expected >= 5;
    a count in a zero-probability cell fails outright)."""
    n = float(counts.sum())
    expected = probs.double() * n
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    cells = expected >= 5
    stat = float((((counts.double() - expected) ** 2) / expected)[cells].sum())
    rest = float(counts[~cells].sum()), float(expected[~cells].sum())  # pooled small cells
    df = int(cells.sum()) - 1
    if rest[1] > 0:
        stat += (rest[0] - rest[1]) ** 2 / rest[1]
        df += 1
    return float(chi2.sf(stat, df))


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0),
                                                        (1.3, 0, 0.8), (0.9, 4, 0.7)])
def test_processed_probs_is_the_distribution_choose_tokens_samples(temperature, top_k, top_p):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 2
    logits[3] = logits[5]  # a tie, kept together by top-k
    grid = (torch.arange(10000, dtype=torch.float64) + 0.5) / 10000
    settings = RowSettings(torch.full((len(grid),), temperature),
                           torch.full((len(grid),), top_k, dtype=torch.long),
                           torch.full((len(grid),), top_p))
    chosen = choose_tokens(logits.expand(len(grid), V), settings, grid)
    measured = torch.bincount(chosen, minlength=V).double() / len(grid)
    probs = processed_probs(logits, temperature, top_k, top_p)
    assert torch.allclose(probs, measured, atol=2e-4), (probs, measured)
    assert abs(float(probs.sum()) - 1) < 1e-12


def test_sample_from_draws_only_tokens_with_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = {sample_from(probs, g) for _ in range(200)}
    assert draws == {1, 3}


def test_greedy_accepts_the_argmax_prefix_then_takes_the_argmax():
    logits = torch.full((4, V), -1.0)
    for i, best in enumerate([2, 6, 1, 4]):
        logits[i, best] = 3.0
    assert verify_greedy(logits, [2, 6, 1]) == [2, 6, 1, 4]  # all accepted, then the bonus
    assert verify_greedy(logits, [2, 5, 1]) == [2, 6]  # first mismatch replaced by the argmax
    assert verify_greedy(logits, [0, 6, 1]) == [2]


def _draws(p: torch.Tensor, q: torch.Tensor | None, fixed: list[int] | None, n: int, seed: int):
    """Run the verification `n` times; count the first and the second emitted token."""
    g = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(V), torch.zeros(V)
    drafts = None if q is None else torch.multinomial(q, n, replacement=True, generator=g).T
    for j in range(n):
        draft = fixed if drafts is None else drafts[j].tolist()
        out = verify_sampled(p, draft, q, g)
        assert 1 <= len(out) <= K + 1
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def _target_and_draft() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    # p, q: random, peaked differently; a zero in q where p has mass, and the reverse.
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1).double()
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1).double()
    p[:, 0] = 0
    q[:, 1] = 0
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def test_emitted_tokens_follow_the_target_whatever_the_draft_distribution():
    p, q = _target_and_draft()
    first, second = _draws(p, q, None, 3000, seed=11)
    # The first token is p_0's; the second exists iff the first draft was accepted, and the
    # targets here do not depend on the prefix, so given that, it is p_1's.
    assert _chi2_pvalue(first, p[0]) > 1e-3
    assert second.sum() > 500 and _chi2_pvalue(second, p[1]) > 1e-3
    # The same bound rejects wrong distributions at this sample size: it can fail.
    assert _chi2_pvalue(first, q[0]) < 1e-3  # the draft's own distribution
    biased = p[0] * torch.linspace(0.7, 1.3, V, dtype=torch.float64)
    assert _chi2_pvalue(first, biased / biased.sum()) < 1e-3


def test_emitted_tokens_follow_the_target_with_a_deterministic_proposer():
    p, _ = _target_and_draft()
    draft = [int(p[i].argmax()) for i in range(K)]  # likely, so the second token is seen often
    first, second = _draws(p, None, draft, 2000, seed=12)
    assert _chi2_pvalue(first, p[0]) > 1e-3
    assert second.sum() > 300 and _chi2_pvalue(second, p[1]) > 1e-3
    wrong = p[0].clone()
    wrong[draft[0]] = 0  # e.g. forgetting to accept: the residual alone
    assert _chi2_pvalue(first, wrong / wrong.sum()) < 1e-3
