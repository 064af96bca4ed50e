"""The model runner's interface: the scheduler's output in, each scheduled request's logits out.

Reference: the model's own full forward pass (no KV cache) over each request's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.serving.engine.kv_config import KVCacheConfig
from tessera.serving.engine.kv_space import SeqState, SlotSpace
from tessera.serving.engine.runner import ModelRunner
from tessera.serving.engine.scheduler import StepPlan


@dataclass(eq=False, kw_only=True)
class _Row(SeqState):
    """The fields of an engine request that input preparation reads."""

    n_input: int
    n_virtual: int = 0
    task: int = -1
    adapter: int = -1
    prompt_logprobs: list | None = None


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.from_name("llama-tiny", init_std=0.1), seed=0).eval()


def _runner_and_space(model) -> tuple[ModelRunner, SlotSpace]:
    return ModelRunner(model, 4, kv=KVCacheConfig(kind="slots")), SlotSpace(4)


def _row(space: SlotSpace, tokens: list[int], **fields) -> _Row:
    row = _Row(tokens=list(tokens), n_input=len(tokens), **fields)
    space.admit(row)
    return row


def _full(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens]))[0].float()


def test_a_prefill_pass_returns_the_prompt_and_next_token_logits_each_request_asked_for(model):
    runner, space = _runner_and_space(model)
    scored = _row(space, [5, 9, 14, 3, 7], prompt_logprobs=[None] * 5)
    plain = _row(space, [11, 2, 8])
    out = runner.execute_model(StepPlan(rows=[(scored, 5), (plain, 3)], kv_rows=space.rows),
                               pad_id=0, run=runner.forward)
    assert out.failed == [] and len(out.passes) == 1
    ran = out.passes[0]
    # Prompt positions 0..3 score tokens 1..4; None marks the position to sample from.
    assert ran.wanted == [(scored, 0), (scored, 1), (scored, 2), (scored, 3), (scored, None),
                          (plain, None)]
    expected = torch.cat([_full(model, scored.tokens)[[0, 1, 2, 3, 4]],
                          _full(model, plain.tokens)[[2]]])
    torch.testing.assert_close(ran.logits, expected, rtol=1e-5, atol=1e-5)


def test_decodes_and_prefills_run_as_separate_passes_decodes_first(model):
    runner, space = _runner_and_space(model)
    decoding = _row(space, [5, 9, 14])
    runner.execute_model(StepPlan(rows=[(decoding, 3)], kv_rows=space.rows), 0, runner.forward)
    decoding.cached = 3
    decoding.tokens.append(6)
    prefilling = _row(space, [1, 2, 3, 4])
    out = runner.execute_model(
        StepPlan(rows=[(prefilling, 4), (decoding, 1)], kv_rows=space.rows), 0, runner.forward)
    assert [p.rows for p in out.passes] == [[(decoding, 1)], [(prefilling, 4)]]
    torch.testing.assert_close(out.passes[0].logits[0], _full(model, decoding.tokens)[-1],
                               rtol=1e-5, atol=1e-5)


def test_a_failing_pass_fails_only_its_own_rows(model):
    runner, space = _runner_and_space(model)
    decoding = _row(space, [5, 9, 14])
    runner.execute_model(StepPlan(rows=[(decoding, 3)], kv_rows=space.rows), 0, runner.forward)
    decoding.cached = 3
    decoding.tokens.append(6)
    prefilling = _row(space, [1, 2, 3, 4])

    def run(batch):
        if batch.ids.shape[1] > 1:
            raise RuntimeError("out of memory")
        return runner.forward(batch)

    out = runner.execute_model(
        StepPlan(rows=[(prefilling, 4), (decoding, 1)], kv_rows=space.rows), 0, run)
    assert out.failed == [(prefilling, "out of memory")]
    assert [p.rows for p in out.passes] == [[(decoding, 1)]]


def test_a_speculative_row_returns_the_logits_of_its_token_and_every_draft(model):
    runner, space = _runner_and_space(model)
    seq = _row(space, [5, 9, 14])
    runner.execute_model(StepPlan(rows=[(seq, 3)], kv_rows=space.rows), 0, runner.forward)
    seq.cached, seq.draft = 2, [21, 30]  # the last token (14) runs with two drafts
    out = runner.execute_model(StepPlan(rows=[(seq, 3)], kv_rows=space.rows), 0, runner.forward)
    (ran,) = out.passes
    assert ran.wanted == [] and [s for s, _ in ran.drafts] == [seq]
    torch.testing.assert_close(ran.drafts[0][1], _full(model, [5, 9, 14, 21, 30])[2:],
                               rtol=1e-5, atol=1e-5)
