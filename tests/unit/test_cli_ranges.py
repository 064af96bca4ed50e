"""Every verb range-checks its numeric flags at parse time: argparse's one-line error, exit 2,
nothing run and no traceback."""

import subprocess
import sys

import pytest

from tessera.__main__ import main

CASES = [
    ("pretrain", ["--global-batch", "0"], "argument --global-batch: must be >= 1, got 0"),
    ("pretrain", ["--lr", "-1"], "argument --lr: must be > 0, got -1"),
    ("pretrain", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("pretrain", ["--steps", "-5"], "argument --steps: must be >= 1, got -5"),
    ("pretrain", ["--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
    ("pretrain", ["--train.warmup_steps", "-1"], "argument --train.warmup_steps: must be >= 0"),
    ("pretrain", ["--beta2", "1"], "argument --beta2: must be in [0, 1), got 1"),
    ("pretrain", ["--tp", "0"], "argument --tp: must be >= 1, got 0"),
    ("pretrain", ["--micro-batches", "0"], "argument --micro-batches: must be >= 1, got 0"),
    ("pretrain", ["--log-interval", "0"], "argument --log-interval: must be >= 1, got 0"),
    ("pretrain", ["--nproc-per-node", "-2"], "argument --nproc-per-node: must be >= 0, got -2"),
    ("pretrain", ["--fp8-margin", "-1"], "argument --fp8-margin: must be >= 0, got -1"),
    ("tune", ["--lr", "0"], "argument --lr: must be > 0, got 0"),
    ("tune", ["--seq-len", "-1"], "argument --seq-len: must be >= 0, got -1"),
    ("tune", ["--virtual-tokens", "0"], "argument --virtual-tokens: must be >= 1, got 0"),
    ("tune", ["--lora-rank", "0"], "argument --lora-rank: must be >= 1, got 0"),
    ("serve", ["--checkpoint", "x", "--port", "99999"],
     "argument --port: must be between 1 and 65535, got 99999"),
    ("serve", ["--checkpoint", "x", "--max-batch", "0"], "argument --max-batch: must be >= 1"),
    ("serve", ["--checkpoint", "x", "--request-timeout", "-1"],
     "argument --request-timeout: must be > 0, got -1"),
    ("serve", ["--checkpoint", "x", "--kv-block-size", "0"], "argument --kv-block-size: must be"),
    ("generate", ["--url", "http://x", "--top-p", "0", "hi"], "argument --top-p: must be in (0, 1]"),
    ("generate", ["--url", "http://x", "--max-tokens", "0", "hi"], "argument --max-tokens: must be"),
    ("generate", ["--url", "http://x", "--temperature", "-1", "hi"],
     "argument --temperature: must be >= 0, got -1"),
    ("evaluate", ["--checkpoint", "x", "--data", "y", "--batch", "0"], "argument --batch: must be"),
    ("evaluate", ["--checkpoint", "x", "--data", "y", "--seq-len", "-1"],
     "argument --seq-len: must be >= 0, got -1"),
    ("tokenizer", ["train", "--input", "x", "--output", "y", "--vocab-size", "0"],
     "argument --vocab-size: must be >= 1, got 0"),
    ("preprocess", ["--input", "x", "--tokenizer", "t", "--output-prefix", "p", "--workers", "0"],
     "argument --workers: must be >= 1, got 0"),
    ("convert", ["--input", "x", "--output", "y", "--tp", "0"], "argument --tp: must be >= 1"),
    ("convert", ["--input", "x", "--output", "y", "--shard-size", "0"],
     "argument --shard-size: must be at least 1 byte"),
    ("plan", ["--model", "llama-tiny", "--gpus", "0"], "argument --gpus: must be >= 1, got 0"),
    ("plan", ["--model", "llama-tiny", "--measure-warmup", "-1"],
     "argument --measure-warmup: must be >= 0, got -1"),
]


@pytest.mark.parametrize("verb, argv, message", CASES,
                         ids=[f"{v}{' '.join(a[-2:])}" for v, a, _ in CASES])
def test_out_of_range_flags_are_one_line_parse_errors(verb, argv, message, capsys, tmp_path,
                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written: a refused run leaves the cwd empty
    with pytest.raises(SystemExit) as exit_:
        main([verb, *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"tessera {verb}") and message in last, err
    assert "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_serve_port_out_of_range_is_one_line_not_a_traceback():
    run = subprocess.run([sys.executable, "-m", "tessera", "serve", "--checkpoint", "x",
                          "--port", "99999"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "tessera serve: error: argument --port: must be between 1 and 65535, got 99999")
    assert "Traceback" not in run.stderr
