"""Speculative decoding in the engine: greedy output equals plain decoding, sampled output keeps
the model's distribution, and the KV cache (paged or slots) holds nothing unverified.

References: the same engine without speculation (itself checked against the model's full forward
pass in test_engine.py and test_engine_paged.py), and the exact next-token distributions
computed here from the model's full forward pass over every continuation.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from scipy.stats import chi2

from tessera.core import ModelConfig, build_model
from tessera.serving.engine import LLMEngine
from tessera.serving.engine.kv_config import KVCacheConfig
from tessera.serving.engine.speculative import SpeculativeConfig, config_from_flags, ngram_proposal
from tessera.serving.http.metrics import ServingMetrics
from tessera.serving.types import GenerationRequest, SamplingParams
from tests.serving_helper import collect, full_forward_greedy, train_tiny_tokenizer

KV = {"paged": KVCacheConfig(block_size=4), "slots": KVCacheConfig(kind="slots")}


def _model(name: str, seed: int = 0, **overrides):
    # init_std 0.3: greedy continuations vary (at 0.1 a tiny model repeats one token)
    overrides.setdefault("init_std", 0.3)
    return build_model(ModelConfig.from_name(name, **overrides), seed=seed).eval()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _run(model, requests, tokenizer=None, **kwargs):
    with LLMEngine(model, tokenizer, max_batch=3, max_step_tokens=24, **kwargs) as engine:
        results = collect(engine, requests)
        stats = engine.stats()
    return results, stats


def _same(results, reference) -> None:
    """Equal tokens, text, finish reasons and logprob tokens; logprob values within 1e-5 (a
    batch of another shape rounds its matmuls differently: ~1e-7 here)."""
    assert len(results) == len(reference)
    for r, ref in zip(results, reference):
        assert (r.token_ids, r.text, r.finish_reason) == (ref.token_ids, ref.text,
                                                          ref.finish_reason), r.final.request_id
        assert [(lp.token_id, sorted(lp.top)) for lp in r.logprobs] == \
            [(lp.token_id, sorted(lp.top)) for lp in ref.logprobs]
        for lp, lp_ref in zip(r.logprobs, ref.logprobs):
            assert abs(lp.logprob - lp_ref.logprob) < 1e-5


def _greedy_requests(model, tokenizer, kv) -> list[GenerationRequest]:
    """Repetitive prompts of different lengths; one cut by a stop string and one by a stop
    token chosen from the middle of its plain output, one asking for logprobs and one that
    cannot speculate (a penalty)."""
    g = torch.Generator().manual_seed(5)
    passages = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 9, 13, 7, 6, 8)]
    prompts = [p * 3 for p in passages]
    greedy = dict(temperature=0, ignore_eos=True)
    probe = GenerationRequest("probe", prompts[0], SamplingParams(max_tokens=14, **greedy))
    (plain,), _ = _run(model, [probe], tokenizer, kv=kv)
    # A stop string from the text of tokens 6-7, a stop token: the first from the 6th on not
    # seen before (both must cut where plain decoding cuts, inside a run of accepted drafts).
    ids = plain.token_ids
    stop = tokenizer.decode(ids[:8])[len(tokenizer.decode(ids[:6])):]
    stop_id = next(t for i, t in enumerate(ids) if i >= 5 and t not in ids[:i])
    assert stop.strip(), ids
    return [GenerationRequest("stop-string", prompts[0],
                              SamplingParams(max_tokens=14, stop=[stop], **greedy)),
            GenerationRequest("stop-token", prompts[0], SamplingParams(
                max_tokens=14, temperature=0, stop_token_ids=[stop_id])),
            *(GenerationRequest(f"r{i}", prompts[i], SamplingParams(max_tokens=m, **greedy))
              for i, m in ((1, 11), (2, 17), (3, 6))),
            GenerationRequest("penalty", prompts[4], SamplingParams(
                max_tokens=9, presence_penalty=0.7, **greedy)),
            GenerationRequest("logprobs", prompts[5], SamplingParams(
                max_tokens=9, logprobs=2, **greedy))]


@pytest.mark.parametrize("name, kind", [("gpt2-tiny", "paged"), ("gpt2-tiny", "slots"),
                                        ("llama-tiny", "paged"), ("llama-tiny", "slots")])
def test_greedy_output_is_unchanged_by_speculation(name, kind, tokenizer):
    model = _model(name)
    kv = KV[kind]
    requests = _greedy_requests(model, tokenizer, kv)
    plain, _ = _run(model, requests, tokenizer, kv=kv)
    assert plain[0].finish_reason == "stop" and plain[1].finish_reason == "stop"
    assert plain[0].final.completion_tokens < 14 and 5 < plain[1].final.completion_tokens < 14
    drafts = {"ngram": SpeculativeConfig("ngram", 4),
              # the model itself: every draft accepted, so every cut is inside a run
              "draft=self": SpeculativeConfig("draft", 4, draft_model=model),
              # an unrelated smaller model: mostly rejected
              "draft=other": SpeculativeConfig("draft", 3, draft_model=_model(
                  name, seed=9, num_layers=1))}
    for label, config in drafts.items():
        spec, stats = _run(model, requests, tokenizer, kv=kv, speculative=config)
        _same(spec, plain)
        assert stats["spec_verify_steps_total"] > 0, label
        assert stats.get("kv_blocks_used", 0) == 0, label  # no block leaked
        if label == "draft=self":
            assert stats["spec_accepted_tokens_total"] == stats["spec_draft_tokens_total"]


def test_requests_that_cannot_be_verified_exactly_decode_plainly_and_logprobs_speculate():
    model = _model("llama-tiny")
    prompt = [5, 6, 7, 8] * 4
    requests = [GenerationRequest("pen", prompt, SamplingParams(
                    max_tokens=8, temperature=0.8, seed=1, repetition_penalty=1.3)),
                GenerationRequest("min", prompt, SamplingParams(max_tokens=8, temperature=0.8,
                                                                seed=3, min_tokens=8))]
    plain, _ = _run(model, requests)
    spec, stats = _run(model, requests, speculative=SpeculativeConfig("ngram", 3))
    _same(spec, plain)
    assert stats["spec_verify_steps_total"] == 0 and stats["spec_draft_tokens_total"] == 0
    # logprobs do speculate: each emitted token's come from its own position's logits
    logprobs = [GenerationRequest("lp", prompt, SamplingParams(max_tokens=12, temperature=0,
                                                               logprobs=3, ignore_eos=True))]
    plain, _ = _run(model, logprobs)
    spec, stats = _run(model, logprobs, speculative=SpeculativeConfig("draft", 3,
                                                                      draft_model=model))
    _same(spec, plain)
    assert len(spec[0].logprobs) == 12
    # 11 tokens after the first in rows of 4 + 4 + 3: 8 drafts, all accepted
    assert stats["spec_accepted_tokens_total"] == stats["spec_draft_tokens_total"] == 8


def test_a_seeded_request_does_not_depend_on_its_batch():
    model = _model("llama-tiny")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() * 3 for n in (4, 6, 9)]
    mine = GenerationRequest("mine", prompts[0], SamplingParams(max_tokens=12, temperature=0.7,
                                                                seed=42, ignore_eos=True))
    others = [GenerationRequest(f"o{i}", p, SamplingParams(max_tokens=5 + i, temperature=1.0,
                                                           ignore_eos=True))
              for i, p in enumerate(prompts[1:])]
    config = SpeculativeConfig("draft", 3, draft_model=_model("llama-tiny", seed=4, num_layers=1))
    alone, _ = _run(model, [mine], speculative=config)
    batched, stats = _run(model, [*others, mine], speculative=config)
    assert alone[0].token_ids == batched[-1].token_ids
    assert stats["spec_verify_steps_total"] > 0


# --------------------------------------------------------------------------- distribution

V = 16  # a small vocabulary: exact distributions of three tokens are cheap to enumerate
TEMPERATURE, TOP_K = 0.9, 12


def _processed(logits: torch.Tensor) -> torch.Tensor:
    """softmax(logits / T) over the top-k logits: what the requests below sample from."""
    kth = logits.topk(TOP_K, dim=-1).values[..., -1:]
    return (logits / TEMPERATURE).masked_fill(logits < kth, float("-inf")).softmax(-1).double()


@torch.no_grad()
def _exact_marginals(model, prompt: list[int]) -> list[torch.Tensor]:
    """Distributions of the 1st, 2nd and 3rd sampled token, from the full forward pass over
    every continuation (no KV cache, no engine)."""
    p1 = _processed(model(torch.tensor([prompt]))[0, -1])
    seconds = torch.tensor([prompt + [a] for a in range(V)])
    p2 = _processed(model(seconds)[:, -1])  # (V, V): p(x2 | x1)
    thirds = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
    p3 = _processed(model(thirds)[:, -1]).reshape(V, V, V)  # p(x3 | x1, x2)
    joint12 = p1[:, None] * p2
    return [p1, joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))]


def _pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value (cells expected >= 5; the rest pooled)."""
    expected = probs * counts.sum()
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    big = expected >= 5
    stat = float((((counts - expected) ** 2) / expected)[big].sum())
    df = int(big.sum()) - 1
    small_e, small_c = float(expected[~big].sum()), float(counts[~big].sum())
    if small_e > 0:
        stat, df = stat + (small_c - small_e) ** 2 / small_e, df + 1
    return float(chi2.sf(stat, df))


def _frequency_check(method: str, n: int, init_std: float = 0.5) -> None:
    model = _model("llama-tiny", vocab_size=V, init_std=init_std)
    # The draft: the model with noise on its output layer, so that its distribution is near
    # the target's but not equal (drafts are often accepted, often not).
    draft = copy.deepcopy(model)
    with torch.no_grad():
        head = draft.output.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(1)) * init_std)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0)).tolist()
    # Every token occurs (prompt lookup always has a proposal), then the model's own greedy
    # continuation (so that proposals are often what the model samples).
    prompt = perm + full_forward_greedy(model, perm, 16)[0]
    config = (SpeculativeConfig("ngram", 2) if method == "ngram"
              else SpeculativeConfig("draft", 2, draft_model=draft))
    requests = [GenerationRequest(f"s{i}", prompt, SamplingParams(
        max_tokens=4, temperature=TEMPERATURE, top_k=TOP_K, seed=1000 + i, ignore_eos=True))
        for i in range(n)]
    with LLMEngine(model, max_batch=48, max_queue=n, max_step_tokens=256,
                   speculative=config) as engine:
        results = collect(engine, requests)
        stats = engine.stats()
    counts = torch.zeros(3, V, dtype=torch.float64)
    for r in results:
        assert len(r.token_ids) == 4
        for pos, token in enumerate(r.token_ids[:3]):
            counts[pos, token] += 1
    exact = _exact_marginals(model, prompt)
    # The first token is sampled plainly after the prompt; the 2nd and 3rd come from a verified
    # speculative row of two drafts (accepted drafts, residual draws; the 4th is the bonus).
    accepted, drafted = stats["spec_accepted_tokens_total"], stats["spec_draft_tokens_total"]
    assert stats["spec_verify_steps_total"] >= n
    assert 0.05 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    for pos in range(3):
        assert _pvalue(counts[pos], exact[pos]) > 1e-3, (pos, counts[pos], exact[pos] * n)
    # The check has power: the 3rd token's counts are not the 2nd's distribution.
    assert _pvalue(counts[2], exact[1]) < 1e-3


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_tokens_keep_the_model_distribution(method):
    _frequency_check(method, 300)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_tokens_keep_the_model_distribution_many_draws(method):
    _frequency_check(method, 3000)


# --------------------------------------------------------------------------- KV accounting


def test_blocks_published_by_speculative_rows_give_the_output_of_a_miss():
    model = _model("llama-tiny", seed=2)
    g = torch.Generator().manual_seed(3)
    first = torch.randint(3, 512, (7,), generator=g).tolist() * 3
    config = SpeculativeConfig("draft", 4, draft_model=model)  # all accepted
    kv = KVCacheConfig(block_size=4)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLMEngine(model, max_batch=2, kv=kv, speculative=config) as engine:
        (a,) = collect(engine, [GenerationRequest("a", first, params)])
        # b's prompt runs into a's output: its cached blocks include tokens that a verified
        follow = GenerationRequest("b", first + a.token_ids[:16] + [9], params)
        (b,) = collect(engine, [follow])
        stats = engine.stats()
    assert stats["spec_accepted_tokens_total"] > 0
    assert stats["prefix_cache_hits_tokens_total"] >= (len(first) + 16) // 4 * 4
    assert stats["kv_blocks_used"] == 0
    with LLMEngine(model, max_batch=2, kv=KVCacheConfig(block_size=4, prefix_caching=False)) as cold:
        (miss,) = collect(cold, [follow])
    assert b.token_ids == miss.token_ids


def test_preemption_under_speculation_loses_nothing():
    model = _model("gpt2-tiny", seed=3)
    g = torch.Generator().manual_seed(4)
    requests = [GenerationRequest(f"p{i}", torch.randint(3, 512, (6,), generator=g).tolist() * 3,
                                  SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
                for i in range(4)]
    small = KVCacheConfig(block_size=4, num_blocks=24)  # 23 usable blocks: 4 x 38 tokens do not fit
    plain, _ = _run(model, requests, kv=small)
    spec, stats = _run(model, requests, kv=small, speculative=SpeculativeConfig("ngram", 4))
    _same(spec, plain)
    assert stats["preemptions_total"] > 0 and stats["kv_blocks_used"] == 0


# --------------------------------------------------------------------------- config, metrics


def test_ngram_proposal_takes_the_most_recent_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_proposal(tokens, 3, 1, 3) == [7, 8, 5]  # "2 3" last seen before 7 8 5
    assert ngram_proposal(tokens, 2, 3, 3) == []  # "5 2 3" never occurred before
    assert ngram_proposal([4, 4, 4], 5, 1, 2) == [4]
    assert ngram_proposal([1], 3, 1, 3) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="eagle"), "choose one of ngram, draft"),
    (dict(num_speculative_tokens=0), ">= 1"),
    (dict(ngram_min=3, ngram_max=2), "ngram-min"),
    (dict(method="draft"), "--draft-checkpoint"),
    (dict(method="ngram", draft_checkpoint="x"), "for --speculative draft"),
])
def test_bad_speculative_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_flags_and_a_draft_with_another_vocabulary_are_refused():
    with pytest.raises(ValueError, match="need --speculative"):
        config_from_flags(None, 3, None, None, None)
    with pytest.raises(ValueError, match="for --speculative ngram"):
        config_from_flags("draft", 3, "ckpt", 2, None)
    assert config_from_flags(None, None, None, None, None) is None
    assert config_from_flags("ngram", None, None, 4, None) == SpeculativeConfig("ngram", 4, 4, 4)
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(_model("llama-tiny"), background=False, speculative=SpeculativeConfig(
            "draft", draft_model=_model("llama-tiny", vocab_size=256)))


def test_metrics_expose_the_acceptance_counters():
    model = _model("gpt2-tiny", init_std=0.1)  # repeats itself: prompt lookup hits
    request = GenerationRequest("m", [3, 4, 5, 6] * 4, SamplingParams(max_tokens=10,
                                                                       temperature=0))
    with LLMEngine(model, speculative=SpeculativeConfig("ngram", 3)) as engine:
        collect(engine, [request])
        stats = engine.stats()
        text = ServingMetrics(engine, "m", lambda: 0).render().decode()
    for stat, metric in (("spec_draft_tokens_total", "spec_decode_num_draft_tokens_total"),
                         ("spec_accepted_tokens_total", "spec_decode_num_accepted_tokens_total"),
                         ("spec_verify_steps_total", "spec_decode_num_drafts_total")):
        assert f'tessera:{metric}{{model_name="m"}} {float(stats[stat])}' in text
    assert stats["spec_accepted_tokens_total"] > 0


# --------------------------------------------------------------------------- tessera serve


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    from tessera.core.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    tok = tokenizer.save(root / "tok")
    target = save_checkpoint(root / "target", _model("llama-tiny"), tokenizer=tok)
    draft = save_checkpoint(root / "draft", _model("llama-tiny", seed=1, num_layers=1),
                            tokenizer=tok)
    other = save_checkpoint(root / "other", _model("llama-tiny", num_layers=1, vocab_size=300))
    return target, draft, other


def _serve(argv, monkeypatch):
    import sys
    import types

    import uvicorn

    from tessera.serving.cli import main

    seen = {}
    app_module = types.ModuleType("tessera.serving.http.app")
    app_module.create_app = lambda engine, **kwargs: seen.update(engine=engine) or "the-app"
    monkeypatch.setitem(sys.modules, "tessera.serving.http.app", app_module)

    def run(server):
        seen["speculator"] = seen["engine"].speculator
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    return main(argv), seen


def test_serve_speculative_flags(checkpoints, monkeypatch, capsys):
    from tessera.serving.engine.speculative import DraftProposer, NgramProposer

    target, draft, other = checkpoints
    code, seen = _serve(["--checkpoint", str(target), "--speculative", "draft",
                         "--draft-checkpoint", str(draft), "--num-speculative-tokens", "3"],
                        monkeypatch)
    assert code == 0 and isinstance(seen["speculator"].proposer, DraftProposer)
    assert seen["speculator"].k == 3
    code, seen = _serve(["--checkpoint", str(target), "--speculative", "ngram", "--ngram-max",
                         "5"], monkeypatch)
    assert code == 0 and isinstance(seen["speculator"].proposer, NgramProposer)
    assert seen["speculator"].config == SpeculativeConfig("ngram", 4, 1, 5)
    capsys.readouterr()
    for argv, message in ((["--draft-checkpoint", str(draft)], "need --speculative"),
                          (["--speculative", "draft"], "--draft-checkpoint PATH"),
                          (["--speculative", "draft", "--draft-checkpoint", str(other)],
                           "vocabulary \\(300 tokens\\)")):
        code, _ = _serve(["--checkpoint", str(target), *argv], monkeypatch)
        assert code == 2
        assert re.search(message, capsys.readouterr().err), argv


def test_a_draft_with_another_tokenizer_is_refused():
    from tessera.serving.engine.speculative import check_same_vocabulary

    class Tok:
        vocab_size = 4

        def __init__(self, pieces):
            self.pieces = pieces

        def model_bytes(self):
            return "|".join(self.pieces).encode()

        def token_text(self, i):
            return self.pieces[i]

    check_same_vocabulary(4, 4, Tok(["a", "b", "c", "d"]), Tok(["a", "b", "c", "d"]))
    with pytest.raises(ValueError, match="token 2: 'x' vs 'c'"):
        check_same_vocabulary(4, 4, Tok(["a", "b", "c", "d"]), Tok(["a", "b", "x", "d"]))
