"""Task data: templates, answer-only labels, truncation, batches by step, and YAML task settings."""

from __future__ import annotations

import json

import pytest
import yaml

from tessera.tuning.config import load_config
from tessera.tuning.data import (
    DataError,
    TaskSpec,
    load_examples,
    make_batch,
    read_jsonl,
    step_indices,
)
from tessera.tuning.loop import base_tokenizer


@pytest.fixture(scope="module")
def tok(base):
    return base_tokenizer(str(base))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_template_fields_and_answer_only_labels(tok, tmp_path):
    spec = TaskSpec("qa", template="Q: {question} Hint: {hint} A: {answer}",
                    truncate_field="question")
    path = _write(tmp_path / "x.jsonl", [{"task": "qa", "question": "we saw a red box",
                                          "hint": 3, "answer": "color"}])
    ex = load_examples(path, {"qa": spec}, {"qa": 4}, tok, 128, add_eos=True).examples[0]
    assert ex.prompt == tok.encode("Q: we saw a red box Hint: 3 A:")
    assert ex.answer == tok.encode("color") + [tok.eos_id] and ex.where == f"{path}:1"
    tokens, labels = make_batch([ex], {"qa": 2}, {"qa": 4}, 40, tok.pad_id)
    full = [2] * 4 + ex.prompt + ex.answer
    n = len(full) - 1
    assert tokens[0, :n].tolist() == full[:-1] and set(tokens[0, n:].tolist()) == {tok.pad_id}
    start = 4 + len(ex.prompt) - 1
    assert labels[0, start:n].tolist() == ex.answer
    assert set(labels[0, :start].tolist()) == {-100} and set(labels[0, n:].tolist()) == {-100}


def test_truncation_cuts_the_chosen_field_to_fit(tok, tmp_path):
    spec = TaskSpec("t", template="{input} | {note} {answer}", truncate_field="note")
    long = " ".join(["we saw a big dog"] * 40)
    path = _write(tmp_path / "x.jsonl", [{"task": "t", "input": "keep me", "note": long,
                                          "answer": "animal"}])
    data = load_examples(path, {"t": spec}, {"t": 10}, tok, 64, add_eos=True)
    ex = data.examples[0]
    assert data.truncated["t"] == 1 and 10 + len(ex.prompt) + len(ex.answer) <= 64
    assert tok.decode(ex.prompt).startswith("keep me | we saw a big dog")


@pytest.mark.parametrize("row, message", [
    ({"input": "x", "answer": "y"}, "x.jsonl:2: missing field 'task'"),
    ({"task": "t", "answer": "y"}, "x.jsonl:2: task 't' needs field 'input'"),
    ({"task": "t", "input": ["a"], "answer": "y"}, "x.jsonl:2: field 'input' must be text"),
    ({"task": "other", "input": "a", "answer": "y"}, "x.jsonl:2: unknown task 'other'"),
])
def test_bad_examples_name_file_and_line(tok, tmp_path, row, message):
    path = _write(tmp_path / "x.jsonl", [{"task": "t", "input": "a", "answer": "b"}, row])
    with pytest.raises(DataError, match=message):
        load_examples(path, {"t": TaskSpec("t")}, {"t": 2}, tok, 64, True)


def test_no_room_for_the_input_is_an_error(tok, tmp_path):
    path = _write(tmp_path / "x.jsonl", [{"task": "t", "input": "we saw a red box",
                                          "answer": "color"}])
    with pytest.raises(DataError, match="x.jsonl:1: .*leave no room for field 'input'"):
        load_examples(path, {"t": TaskSpec("t")}, {"t": 14}, tok, 16, True)
    with pytest.raises(DataError, match="no truncate_field"):
        load_examples(path, {"t": TaskSpec("t", truncate_field=None)}, {"t": 14}, tok, 16, True)
    (tmp_path / "bad.jsonl").write_text('{"task": "t"}\n{not json\n')
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        read_jsonl(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("kwargs, message", [
    (dict(template="{answer} {input}"), "must end the template"),
    (dict(template="{input}"), "must contain {answer} exactly once"),
    (dict(truncate_field="note"), "truncate_field 'note' is not a field"),
    (dict(name="a.b"), "must be letters"),
])
def test_bad_templates(kwargs, message):
    with pytest.raises(DataError, match=message):
        TaskSpec(**{"name": "t", **kwargs})


def test_batches_depend_on_the_step_alone_and_cover_each_epoch():
    a = [step_indices(s, 10, 4, seed=5) for s in range(5)]
    assert a == [step_indices(s, 10, 4, seed=5) for s in range(5)]
    flat = [i for batch in a for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert a != [step_indices(s, 10, 4, seed=6) for s in range(5)]


def test_yaml_tasks_and_flags(tmp_path):
    config = tmp_path / "tune.yaml"
    config.write_text(yaml.safe_dump({
        "tune": {"method": "prompt-tuning", "virtual_tokens": 4},
        "train": {"steps": 7, "lr": "1e-2"},
        "tasks": {"qa": {"template": "Q: {q} A: {a}", "answer_field": "a",
                         "truncate_field": "q", "virtual_tokens": 12}},
    }))
    cfg, _ = load_config(["--config", str(config), "--steps", "9", "--encoder", "lstm"])
    assert (cfg.tune.method, cfg.tune.virtual_tokens, cfg.tune.encoder) == ("prompt-tuning", 4,
                                                                             "lstm")
    assert (cfg.train.steps, cfg.train.lr, cfg.loop.output) == (9, 1e-2, "runs/tune")
    assert cfg.tasks["qa"].virtual_tokens == 12 and cfg.tasks["qa"].answer_field == "a"
    config.write_text(yaml.safe_dump({"tasks": {"qa": {"templte": "{a}"}}}))
    with pytest.raises(ValueError, match="tasks.qa: unknown settings"):
        load_config(["--config", str(config)])
    with pytest.raises(ValueError, match="unknown method 'ia3'"):  # (lora is a method now)
        load_config(["--method", "ia3"])
