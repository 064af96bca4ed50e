"""Bad input fails fast with a clear message and writes nothing: missing fields, unknown tasks,
virtual tokens past the context, a prompt table for another base, damaged or foreign files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tessera.converters.cli import main as convert
from tessera.core import save_checkpoint
from tessera.core.checkpoint import load_checkpoint
from tessera.core.prompt_table import (
    TABLE_FILE,
    PromptTableError,
    base_fingerprint,
    load_prompt_tables,
)
from tessera.tuning import cli
from tests.unit.tuning.tuning_helper import tune_argv


@pytest.fixture(scope="module")
def table(base, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("table") / "run"
    assert cli.main(tune_argv(base, out, data["kind_train"], None, "--steps", "2")) == 0
    return out


def _fails(argv, capsys, *needles):
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    return err


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_missing_field_names_file_and_line_and_writes_nothing(base, data, tmp_path, capsys):
    rows = _rows(data["kind_train"])
    del rows[2]["answer"]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _fails(tune_argv(base, tmp_path / "out", train), capsys, f"{train}:3", "needs field 'answer'")
    assert not (tmp_path / "out").exists()


def test_unknown_task_in_validation_data(base, data, tmp_path, capsys):
    valid = tmp_path / "valid.jsonl"
    valid.write_text(json.dumps({"task": "sentiment", "input": "a", "answer": "b"}) + "\n")
    _fails(tune_argv(base, tmp_path / "out", data["kind_train"], valid), capsys,
           f"{valid}:1: unknown task 'sentiment'", "kind")
    assert not (tmp_path / "out").exists()


def test_unknown_task_at_evaluation(table, data, capsys):
    _fails(["--evaluate", "--prompts", str(table), "--data", str(data["count_valid"])], capsys,
           "unknown task 'count'", "the prompt table")


def test_virtual_tokens_past_the_context(base, data, tmp_path, capsys):
    _fails(tune_argv(base, tmp_path / "out", data["kind_train"], None, "--virtual-tokens", "128"),
           capsys, "128 virtual tokens leave no room in the context of 128")
    _fails(tune_argv(base, tmp_path / "out", data["kind_train"], None, "--virtual-tokens", "15",
                     "--seq-len", "16"), capsys, "leave no room for field 'input'")
    assert not (tmp_path / "out").exists()


def test_a_table_for_another_base_is_refused(base, table, data, tmp_path, capsys):
    other_model = load_checkpoint(base)
    with torch.no_grad():
        other_model.layers["1"].ffn_norm.weight.mul_(1.01)  # same shapes, other weights
    other = save_checkpoint(tmp_path / "other", other_model,
                            tokenizer=base / read_tokenizer_name(base))
    with pytest.raises(PromptTableError, match="was tuned for the base .*different weights"):
        load_prompt_tables([table], other)
    _fails(["--evaluate", "--prompts", str(table), "--data", str(data["kind_valid"]),
            "--checkpoint", str(other)], capsys, "fingerprint")
    assert load_prompt_tables([table], base)["kind"].shape == (8, 64)


def read_tokenizer_name(path):
    return json.loads((path / "manifest.json").read_text())["tokenizer"]


def test_fingerprint_is_the_same_for_a_resharded_or_bf16_copy(base, tmp_path):
    assert convert(["--input", str(base), "--output", str(tmp_path / "tp2"), "--tp", "2"]) == 0
    bf16 = save_checkpoint(tmp_path / "bf16", load_checkpoint(base, dtype=torch.bfloat16))
    assert base_fingerprint(tmp_path / "tp2") == base_fingerprint(base) == base_fingerprint(bf16)


def test_damaged_or_foreign_tables(table, base, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(table, damaged)
    data = bytearray((damaged / TABLE_FILE).read_bytes())
    data[-1] ^= 0xFF
    (damaged / TABLE_FILE).write_bytes(bytes(data))
    with pytest.raises(PromptTableError, match="does not match prompts.json"):
        load_prompt_tables(damaged, base)
    with pytest.raises(PromptTableError, match="prompts.json is missing"):
        load_prompt_tables(tmp_path, base)
    with pytest.raises(PromptTableError, match="task 'kind' is in both"):
        load_prompt_tables([table, table], base)
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    _fails(["--import-peft", str(lora), "--checkpoint", str(base), "--task", "x", "--output",
            str(tmp_path / "imported")], capsys, "is a LORA adapter")
    _fails(["--import-peft", str(lora), "--checkpoint", str(base)], capsys,
           "needs --task, --output")
    assert not (tmp_path / "imported").exists()


def test_a_failed_run_leaves_an_earlier_table_alone(base, table, data, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(table, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "kind", "input": "x"}\n')
    _fails(tune_argv(base, run, bad), capsys, "bad.jsonl:1")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
