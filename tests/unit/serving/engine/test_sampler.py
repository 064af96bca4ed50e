"""The engine's sampler against `core.sampling` and plain torch: per-row settings, the EOS ban
before `min_tokens`, penalties from the request's own history, logprobs of the raw logits."""

from types import SimpleNamespace

import torch

from tessera.core.sampling import RowSettings, apply_penalties, choose_tokens
from tessera.serving.engine.sampler import Sampler
from tessera.serving.types import SamplingParams


def _seq(tokens, **params):
    return SimpleNamespace(params=SamplingParams(**params), tokens=list(tokens), n_virtual=0,
                           n_input=len(tokens), n_generated=0, stop_ids=frozenset(),
                           seen=None, counts=None, prompt_logprobs=None)


def test_rows_follow_their_own_settings():
    V, eos = 12, 3
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    logits[1, eos] = 50.0  # row 1 wants EOS but must make 2 tokens first
    greedy, banned, penalized = (_seq([1, 2], temperature=0),
                                 _seq([1], temperature=0, min_tokens=2),
                                 _seq([5, 6], temperature=0, repetition_penalty=2.0))
    sampler = Sampler(V, eos)
    sampler.track(penalized, 7)  # the prompt (5, 6) and the output so far (7) are penalized
    assert penalized.seen.nonzero().flatten().tolist() == [5, 6, 7]
    seqs = [greedy, banned, penalized]
    out = sampler.choose(seqs, logits, torch.zeros(3))
    assert int(out[0]) == int(logits[0].argmax())
    assert int(out[1]) != eos and int(out[1]) == int(logits[1].masked_fill(
        torch.arange(V) == eos, float("-inf")).argmax())
    settings = RowSettings(torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                           torch.tensor([2.0]))
    want = choose_tokens(apply_penalties(logits[2:], settings, penalized.seen[None]), settings)
    assert int(out[2]) == int(want[0])


def test_logprobs_are_those_of_the_raw_distribution():
    V = 10
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    seqs = [_seq([1], temperature=0, logprobs=3), _seq([2], temperature=0)]
    lps = Sampler(V, None).sampled_logprobs(seqs, logits, [4, 5])
    assert lps[1] is None
    logp = logits[0].log_softmax(-1)
    assert lps[0].token_id == 4 and abs(lps[0].logprob - float(logp[4])) < 1e-6
    assert list(lps[0].top) == logp.topk(3).indices.tolist()
    scored = _seq([1, 8, 9], temperature=0, logprobs=1)
    scored.prompt_logprobs = [None] * 3
    Sampler(V, None).score_prompts([(scored, 0), (scored, None), (scored, 1)], logits[[0, 1, 1]])
    assert scored.prompt_logprobs[1].token_id == 8
    assert abs(scored.prompt_logprobs[1].logprob - float(logp[8])) < 1e-6
    assert abs(scored.prompt_logprobs[2].logprob - float(logits[1].log_softmax(-1)[9])) < 1e-6
