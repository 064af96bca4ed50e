"""Structured outputs in the engine: every constrained output parses and validates, greedy and
sampled, with and without speculative decoding (prompt lookup and a draft model), under
preemption and prefix caching; bad constraints are refused before any work.

References: `jsonschema` (the validator nobody here wrote) and Python's `re` and `json`."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.serving.engine import LLMEngine
from tessera.serving.engine.kv_config import KVCacheConfig
from tessera.serving.engine.speculative import SpeculativeConfig
from tessera.serving.types import (
    GenerationRequest,
    RequestError,
    SamplingParams,
    StructuredOutput,
)
from tests.serving_helper import collect, train_tiny_tokenizer

from .schema_gen import random_schemas

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MAX_TOKENS = 240  # the longest output of these schemas here is ~200 tokens; they must close
NGRAM = SpeculativeConfig("ngram", 3, ngram_min=1, ngram_max=2)


def _model(seed: int = 0, layers: int = 2):
    # init_std 0.3: varied continuations (a tiny model at 0.1 repeats one token)
    return build_model(ModelConfig.from_name("llama-tiny", vocab_size=512, init_std=0.3,
                                             num_layers=layers), seed=seed).eval()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def schemas():
    return random_schemas(50, seed=0)


def _requests(tokenizer, constraints, temperature: float, max_tokens: int = MAX_TOKENS):
    prompt = tokenizer.encode("Answer in JSON:", bos=True)
    return [GenerationRequest(f"r{i}", prompt, SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=i, structured=c))
        for i, c in enumerate(constraints)]


def _run(model, tokenizer, requests, **kwargs):
    kwargs.setdefault("max_batch", 16)
    with LLMEngine(model, tokenizer, max_step_tokens=256, **kwargs) as engine:
        results = collect(engine, requests)
        stats = engine.stats()
    return results, stats


def _check_valid(results, schemas) -> None:
    for r, schema in zip(results, schemas):
        assert r.finish_reason == "stop", (r.final.request_id, r.finish_reason, r.text)
        jsonschema.validate(json.loads(r.text), schema)


@pytest.fixture(scope="module")
def plain_greedy(model, tokenizer, schemas):
    constraints = [StructuredOutput("json_schema", s) for s in schemas]
    results, _ = _run(model, tokenizer, _requests(tokenizer, constraints, 0.0))
    return results


def test_fifty_random_schemas_greedy_all_validate(plain_greedy, schemas):
    _check_valid(plain_greedy, schemas)
    assert len({r.text for r in plain_greedy}) > 40  # the schemas shape the outputs


def test_fifty_random_schemas_greedy_with_speculation_equal_plain_greedy(
        model, tokenizer, schemas, plain_greedy):
    constraints = [StructuredOutput("json_schema", s) for s in schemas]
    results, stats = _run(model, tokenizer, _requests(tokenizer, constraints, 0.0),
                          speculative=NGRAM)
    assert stats["spec_accepted_tokens_total"] > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in plain_greedy]
    _check_valid(results, schemas)


@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram"])
def test_fifty_random_schemas_sampled_all_validate(model, tokenizer, schemas, speculative):
    constraints = [StructuredOutput("json_schema", s) for s in schemas]
    results, stats = _run(model, tokenizer, _requests(tokenizer, constraints, 1.0),
                          speculative=speculative)
    _check_valid(results, schemas)
    if speculative is not None:
        assert stats["spec_accepted_tokens_total"] > 0


def test_draft_model_speculation_keeps_outputs_valid(model, tokenizer, schemas):
    """A draft model proposes tokens the grammar forbids: they are cut before verification."""
    draft = SpeculativeConfig("draft", 3, draft_model=_model(seed=1, layers=1))
    picked = schemas[:12]
    constraints = [StructuredOutput("json_schema", s) for s in picked]
    for temperature in (0.0, 1.0):
        results, stats = _run(model, tokenizer, _requests(tokenizer, constraints, temperature),
                              speculative=draft)
        _check_valid(results, picked)
        assert stats["spec_draft_tokens_total"] > 0


def test_preemption_and_prefix_caching_keep_the_grammar_state(model, tokenizer, schemas):
    """A KV pool too small for the batch preempts and recomputes requests (from the prefix
    cache): their grammar state follows their tokens, not their KV."""
    picked = schemas[:10]
    constraints = [StructuredOutput("json_schema", s) for s in picked]
    results, stats = _run(model, tokenizer, _requests(tokenizer, constraints, 0.0),
                          kv=KVCacheConfig(block_size=4, num_blocks=62), max_batch=10)
    assert stats["preemptions_total"] > 0
    _check_valid(results, picked)
    alone, _ = _run(model, tokenizer, _requests(tokenizer, constraints, 0.0), max_batch=1)
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]


def test_regex_choice_grammar_and_any_json(model, tokenizer):
    constraints = [
        StructuredOutput("regex", r"[a-z]{2,5}-[0-9]{1,3}"),
        StructuredOutput("choice", ["yes", "no", "don't \"know\""]),
        StructuredOutput("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)? ")"'),
        StructuredOutput("json_schema", {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}),
    ]
    for temperature in (0.0, 1.0):
        results, _ = _run(model, tokenizer, _requests(tokenizer, constraints, temperature))
        regex, choice, grammar, schema = results
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", regex.text), regex.text
        assert choice.text in ("yes", "no", "don't \"know\""), choice.text
        assert re.fullmatch(r"\([0-9]+(\+[0-9]+)?\)", grammar.text), grammar.text
        assert 0 <= json.loads(schema.text)["a"] <= 9
        assert all(r.finish_reason == "stop" for r in results[:2])


def test_any_json_object_parses_when_it_closes(model, tokenizer):
    """`json_object` bounds nothing, so a random model may run to the length limit; every
    output that finished with "stop" parses."""
    results, _ = _run(model, tokenizer, _requests(
        tokenizer, [StructuredOutput("json")] * 8, 1.0, max_tokens=64))
    assert any(r.finish_reason == "stop" for r in results)
    for r in results:
        if r.finish_reason == "stop":
            json.loads(r.text)


def test_logprobs_stay_those_of_the_raw_model(model, tokenizer):
    """The mask chooses among allowed tokens; the reported logprobs are the model's own."""
    constraint = StructuredOutput("choice", ["alpha", "beta"])
    prompt = tokenizer.encode("Pick:", bos=True)
    request = GenerationRequest("lp", prompt, SamplingParams(
        max_tokens=8, temperature=0, logprobs=2, structured=constraint))
    (result,), _ = _run(model, tokenizer, [request])
    first = result.logprobs[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1].float()
    raw = torch.log_softmax(logits, -1)
    assert first.logprob == pytest.approx(float(raw[first.token_id]), abs=1e-4)
    assert result.text in ("alpha", "beta")


@pytest.mark.parametrize("constraint, reason", [
    (StructuredOutput("json_schema", {"type": "object", "properties": {"a": {"type": "nope"}}}),
     "invalid json schema constraint"),
    (StructuredOutput("json_schema", "not a schema"), "must be an object"),
    (StructuredOutput("regex", "[a-"), "invalid regex constraint"),
    (StructuredOutput("grammar", "root ::= missing_rule"), "invalid grammar constraint"),
    (StructuredOutput("choice", []), "non-empty list"),
])
def test_invalid_constraints_are_refused_with_the_reason(model, tokenizer, constraint, reason):
    with LLMEngine(model, tokenizer, max_batch=2) as engine:
        with pytest.raises(RequestError, match=reason):
            collect(engine, _requests(tokenizer, [constraint], 0.0))


def test_ignore_eos_is_refused_with_a_constraint(model, tokenizer):
    request = GenerationRequest("e", [1, 5, 6], SamplingParams(
        ignore_eos=True, structured=StructuredOutput("json")))
    with LLMEngine(model, tokenizer, max_batch=2) as engine:
        with pytest.raises(RequestError, match="ignore_eos"):
            engine.validate(request)


def test_without_xgrammar_a_constraint_is_refused_with_the_install_command(
        model, tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now fails
    with LLMEngine(model, tokenizer, max_batch=2) as engine:
        with pytest.raises(RequestError, match=r"pip install 'tessera\[structured\]'"):
            collect(engine, _requests(tokenizer, [StructuredOutput("json")], 0.0))
        # unconstrained requests are served as before
        (plain,) = collect(engine, [GenerationRequest("p", [1, 5, 6], SamplingParams(
            max_tokens=3, temperature=0))])
        assert len(plain.token_ids) == 3


def test_a_draft_that_ends_with_eos_is_masked_and_verified(tokenizer):
    """A draft may propose EOS where the grammar is complete: masks stop there (filling past
    EOS is an error in xgrammar), and the matcher's state is left as it was."""
    from tessera.serving.engine.grammar import GrammarCompiler, mask_logits

    grammar = GrammarCompiler(tokenizer, 512, tokenizer.eos_id).matcher(
        StructuredOutput("choice", ["yes"]))
    words = 16  # 512 tokens / 32 bits
    path = []
    while True:  # the first allowed token each time, up to EOS
        mask = torch.full((1, words), -1, dtype=torch.int32)
        grammar.fill(mask, 0)
        token = int(mask_logits(torch.zeros(1, 512), mask).isfinite()[0].nonzero()[0])
        path.append(token)
        if token == tokenizer.eos_id:
            break
        grammar.accept(token)
    grammar.matcher.rollback(len(path) - 1)
    assert tokenizer.decode(path[:-1]) == "yes"
    draft = grammar.valid_prefix([*path, 5])
    assert draft == path  # nothing after EOS
    bitmask = torch.full((len(draft) + 1, words), -1, dtype=torch.int32)
    assert grammar.fill(bitmask, 0, draft) == len(draft) + 1
    allowed = mask_logits(torch.zeros(len(draft) + 1, 512), bitmask).isfinite()
    for j, token in enumerate(draft):  # each position allows its draft token
        assert allowed[j, token]
    assert allowed[len(draft) - 1].sum() == 1  # only EOS once "yes" is complete
    grammar.accept(path[0])  # the state was left at the start
