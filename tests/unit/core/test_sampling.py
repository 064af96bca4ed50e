"""The batched sampler: rows are independent, cuts and penalties do what they say."""

import torch

from tessera.core.generation import sample_next
from tessera.core.sampling import RowSettings, apply_penalties, choose_tokens, uniforms_from


def _settings(temperature, top_k=0, top_p=1.0, **penalties):
    n = len(temperature)

    def col(v, dtype=torch.float32):
        return torch.tensor(v if isinstance(v, list) else [v] * n, dtype=dtype)

    extra = {k: col(v) for k, v in penalties.items()}
    return RowSettings(col(temperature), col(top_k, torch.long), col(top_p), **extra)


def test_a_row_gets_the_same_token_whatever_it_is_batched_with():
    logits = torch.randn(6, 300)
    settings = _settings([0.0, 0.7, 1.0, 1.3, 0.9, 0.0], top_k=[0, 5, 0, 50, 0, 0],
                         top_p=[1.0, 1.0, 0.9, 0.8, 1.0, 1.0])
    uniforms = uniforms_from([torch.Generator().manual_seed(i) for i in range(6)])
    together = choose_tokens(logits, settings, uniforms)
    for i in range(6):
        alone = choose_tokens(logits[i:i + 1], _settings([float(settings.temperature[i])],
                              int(settings.top_k[i]), float(settings.top_p[i])), uniforms[i:i + 1])
        assert int(alone[0]) == int(together[i])
    assert int(together[0]) == int(logits[0].argmax())


def test_top_k_top_p_and_bans_limit_the_choice():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 200)
    uniforms = torch.rand(200, generator=torch.Generator().manual_seed(0))
    top2 = choose_tokens(logits, _settings([5.0] * 200, top_k=2), uniforms)
    assert set(top2.tolist()) == {0, 1}
    # probabilities at T=1: .64 .23 .09 .03 .01 -> top_p 0.7 keeps the first two
    nucleus = choose_tokens(logits, _settings([1.0] * 200, top_p=0.7), uniforms)
    assert set(nucleus.tolist()) == {0, 1}
    banned = torch.zeros(200, 5, dtype=torch.bool)
    banned[:, 0] = True
    greedy = choose_tokens(logits, _settings([0.0] * 200), None, banned)
    assert set(greedy.tolist()) == {1}


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_penalties(logits, _settings([0.0], repetition_penalty=2.0), seen=seen)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    counts = torch.tensor([[0.0, 0.0, 3.0, 1.0]])
    out = apply_penalties(logits, _settings([0.0], presence_penalty=0.5, frequency_penalty=0.25),
                          counts=counts)
    assert out.tolist() == [[2.0, -2.0, -0.25, -0.25]]


def test_sample_next_is_the_same_sampler():
    logits = torch.randn(3, 100)
    assert sample_next(logits).tolist() == logits.argmax(-1).tolist()
    a = sample_next(logits, 0.8, 10, 0.9, torch.Generator().manual_seed(1))
    b = sample_next(logits, 0.8, 10, 0.9, torch.Generator().manual_seed(1))
    assert a.tolist() == b.tolist()
