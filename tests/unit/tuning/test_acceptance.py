"""Acceptance: on a pretrained base, tuned prompts lift exact match from near chance.

The base (see `tuning_helper`) knows both tasks only after their header words; the prompts start
random and must find that behaviour. P-tuning must reach >= 85% exact match on a held-out split
of the two-label `kind` task; prompt tuning's figure is reported beside it. Then two tasks tuned
in one job must each answer their own task, including through the `tasks` dict a server takes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from tessera.core.checkpoint import load_checkpoint
from tessera.core.prompt_table import load_prompt_tables
from tessera.core.prompts import attach_prompts, fixed_prompts
from tessera.tuning.config import load_config
from tessera.tuning.data import TaskSpec, load_examples
from tessera.tuning.loop import base_tokenizer, tune
from tests.unit.tuning.tuning_helper import tune_argv

# Each job trains to convergence, so that rounding differences between CPU vector ISAs cannot
# flip the outcome: at 40 steps p-tuning stood at the edge (62.5% exact match with
# ATEN_CPU_CAPABILITY=default, 100% with avx2, from the same seed); at 80 steps it reaches 100%
# under both, and the two-task job (100 -> 200 steps) clears 85% on both tasks.
pytestmark = pytest.mark.usefixtures("compiled_kernels")


def _tune(base: Path, out: Path, train: Path, valid: Path, *extra: str) -> dict:
    cfg, _ = load_config(tune_argv(base, out, train, valid, *extra))
    return tune(cfg)


def test_p_tuning_lifts_exact_match_from_chance(base, data, tmp_path, capsys):
    figures = {}
    for method, lr in (("p-tuning", "3e-2"), ("prompt-tuning", "1e-1")):
        summary = _tune(base, tmp_path / method, data["kind_train"], data["kind_valid"],
                        "--method", method, "--lr", lr, "--steps", "80")
        figures[method] = (summary["before"]["kind"]["accuracy"],
                           summary["after"]["kind"]["accuracy"])
    with capsys.disabled():
        for method, (before, after) in figures.items():
            print(f"\n  {method:<14} exact match on held-out 'kind': {before:.1%} -> {after:.1%}")
    before, after = figures["p-tuning"]
    assert before <= 0.5, f"random prompts should be near chance or below, got {before:.1%}"
    assert after >= 0.85, f"p-tuning reached only {after:.1%} ({figures})"
    assert figures["prompt-tuning"][1] > figures["prompt-tuning"][0]


@torch.no_grad()
def _greedy_label(model, ids: list[int]) -> int:
    return int(model(torch.tensor([ids]))[0, -1].argmax())


@pytest.fixture(scope="module")
def both(base, data, tmp_path_factory) -> tuple[Path, dict]:
    """One p-tuning job over both tasks: its output directory and summary."""
    out = tmp_path_factory.mktemp("both") / "run"
    return out, _tune(base, out, data["both_train"], data["both_valid"], "--method", "p-tuning",
                      "--steps", "200")


def test_two_tasks_in_one_job_each_answer_their_own(base, data, both):
    out, summary = both
    for task in ("kind", "count"):
        assert summary["after"][task]["accuracy"] >= 0.85, summary["after"]

    # The server's view: {task: table}, fixed prompts, rows named per request, mixed batch.
    tables = load_prompt_tables([out], base)
    assert sorted(tables) == ["count", "kind"] and tables["kind"].shape == (8, 64)
    model = load_checkpoint(base)
    hook = attach_prompts(model, fixed_prompts(tables))
    tok = base_tokenizer(str(base))
    spec = {t: TaskSpec(t) for t in ("kind", "count")}
    n = {"kind": 8, "count": 8}
    kind = load_examples(data["kind_valid"], spec, n, tok, 128, False).examples[:8]
    count = load_examples(data["count_valid"], spec, n, tok, 128, False).examples[:8]
    rows = [(e, "kind") for e in kind] + [(e, "count") for e in count]
    width = max(len(e.prompt) for e, _ in rows) + 8
    ids = torch.full((len(rows), width), tok.pad_id)
    for r, (e, _) in enumerate(rows):
        ids[r, 8: 8 + len(e.prompt)] = torch.tensor(e.prompt)  # slot ids are irrelevant here
    hook.set_rows([task for _, task in rows])
    with torch.no_grad():
        logits = model(ids)
    last = torch.tensor([8 + len(e.prompt) - 1 for e, _ in rows])
    predicted = [tok.decode([i]).strip() for i in logits[torch.arange(len(rows)), last].argmax(-1)]
    right = sum(p == e.answer_text for p, (e, _) in zip(predicted, rows))
    assert right >= 0.85 * len(rows), list(zip(predicted, [e.answer_text for e, _ in rows]))

    # Asked the other task, each prompt answers in its own labels.
    hook.set_rows(["count" if t == "kind" else "kind" for _, t in rows])
    with torch.no_grad():
        swapped = model(ids)[torch.arange(len(rows)), last].argmax(-1)
    labels = {"kind": {"color", "animal"}, "count": {"one", "two"}}
    swapped_words = [tok.decode([i]).strip() for i in swapped]
    own = sum(w in labels["count" if t == "kind" else "kind"] for w, (_, t) in zip(swapped_words, rows))
    assert own >= 0.85 * len(rows), swapped_words
    hook.set_rows(None)  # and no task at all: the base is untouched
    with torch.no_grad():
        plain = load_checkpoint(base)(ids)
        assert torch.equal(model(ids), plain)


def test_the_serving_engine_answers_each_task_from_the_tables(base, data, both):
    engine = pytest.importorskip("tessera.serving.engine")
    from tessera.serving.types import GenerationRequest, SamplingParams

    tables = load_prompt_tables([both[0]], base)
    tok = base_tokenizer(str(base))
    rows = [(r, "kind") for r in _rows(data["kind_valid"])[:6]]
    rows += [(r, "count") for r in _rows(data["count_valid"])[:6]]
    requests = [GenerationRequest(f"r{i}", tok.encode(r["input"]),
                                  SamplingParams(max_tokens=1, temperature=0), task=task)
                for i, (r, task) in enumerate(rows)]

    async def run(eng) -> list[list[int]]:
        async def drain(request) -> list[int]:
            return [t async for event in eng.generate(request) for t in event.token_ids]
        return await asyncio.gather(*(drain(r) for r in requests))  # one mixed batch

    with engine.LLMEngine(load_checkpoint(base), tok, tasks=tables, max_batch=12) as eng:
        assert eng.tasks() == ["count", "kind"]
        answers = asyncio.run(run(eng))
    got = [tok.decode(a).strip() for a in answers]
    right = sum(g == r["answer"] for g, (r, _) in zip(got, rows))
    assert right >= 0.85 * len(rows), list(zip(got, [r["answer"] for r, _ in rows]))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
