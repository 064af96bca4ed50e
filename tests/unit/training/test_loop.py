"""The pretraining loop in one process: config precedence, clear errors, exact resume, signals.

Every run is a tiny 4-layer model on the synthetic corpus of `tests.pretrain_helper`, a few
steps long. Runs go through `load_config` + `pretrain` in this process, or through
`python -m tessera pretrain` in a subprocess where a signal has to reach a real process.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from tessera.core.checkpoint import load_checkpoint
from tessera.core.tokenizer import train_tokenizer
from tessera.training import cli
from tessera.training import loop as loop_module
from tessera.training.config import (
    DataConfig,
    LoopConfig,
    ParallelSection,
    TrainConfig,
    build_parser,
    load_config,
)
from tessera.training.loop import pretrain
from tessera.training.state import latest_checkpoint, read_training_record
from tests.pretrain_helper import (
    TinyData,
    pretrain_argv,
    read_losses,
    rewind_run,
    tessera_command,
)

# One thread here and in the subprocesses: their arithmetic then matches bit for bit, and a tiny
# model runs no slower (two threads on a busy 2-core machine run up to 10x slower).
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def run8(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 8-step run with checkpoints at steps 4 and 8."""
    run = tmp_path_factory.mktemp("run8") / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run))
    summary = pretrain(cfg)
    assert summary["steps"] == 8 and not summary["stopped_early"]
    return run


LONG = ("--steps", "30", "--warmup-steps", "5", "--save-interval", "0", "--log-interval", "10")


@pytest.fixture(scope="module")
def run30(tiny: TinyData, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of an uninterrupted 30-step run (saving only at the end)."""
    run = tmp_path_factory.mktemp("run30") / "run"
    cfg, _ = load_config(pretrain_argv(tiny, run, *LONG))
    pretrain(cfg)
    return read_losses(run)



# ------------------------------------------------------------------------------------ config


def test_yaml_fields_are_overridden_by_flags(tmp_path: Path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"preset": "gpt2-tiny", "num_layers": 3, "norm_eps": "1e-6"},
        "train": {"lr": "3e-4", "steps": 7},  # YAML reads 3e-4 as a string
        "seq_len": 64,
        "micro_batches": 2,
        "data": "corpus_a",  # the flat field, not the section
        "loop": {"output": "from-yaml", "progress": False, "tensorboard": "off"},
    }))
    cfg, _ = load_config(["--config", str(config), "--train.steps", "9", "--warmup-steps", "3",
                          "--model-overrides", "num_layers=5", "--tensorboard", "true"])
    assert (cfg.train.lr, cfg.train.steps, cfg.train.warmup_steps, cfg.train.seq_len) == (3e-4, 9, 3, 64)
    assert cfg.parallel.micro_batches == 2 and cfg.data.data == ["corpus_a"]
    assert (cfg.loop.output, cfg.loop.progress, cfg.loop.tensorboard) == ("from-yaml", False, True)
    assert (cfg.model.name, cfg.model.num_layers, cfg.model.norm_eps) == ("gpt2-tiny", 5, 1e-6)
    assert cfg.train.beta2 == TrainConfig().beta2  # untouched fields keep their defaults

    cfg, _ = load_config(["--config", str(config), "--model", "llama-tiny", "--lr", "1e-3"])
    assert (cfg.model.name, cfg.model.num_layers, cfg.train.lr) == ("llama-tiny", 3, 1e-3)
    config.write_text("data:\n  data: [corpus_a, corpus_b]\n  split: 90,5,5\n")
    cfg, _ = load_config(["--config", str(config)])
    assert cfg.data.data == ["corpus_a", "corpus_b"] and cfg.data.split == "90,5,5"


def test_help_lists_every_field(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for section in (TrainConfig, DataConfig, LoopConfig, ParallelSection):
        for f in dataclasses.fields(section):
            assert f"--{f.name.replace('_', '-')}" in text, f"--help does not list {f.name}"
    undocumented = [a.dest for a in build_parser()._actions if "." in a.dest and not a.help]
    assert not undocumented


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("lrr: 0.1\n", "'lrr'"),
        ("train:\n  lrr: 0.1\n", "train.lrr"),
        ("loop:\n  lr: 0.1\n", "loop.lr"),  # a real field, in the wrong section
        ("model:\n  preset: llama-tiny\n  num_layerz: 3\n", "'num_layerz'"),
        ("train:\n  steps: many\n", "train.steps"),
        ("model: [llama-tiny]\n", "model"),
    ],
)
def test_bad_yaml_is_an_error_naming_the_key(tmp_path: Path, capsys, text: str, named: str):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert cli.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


# ------------------------------------------------------------------------------------ errors


def _corrupt_copy(tiny: TinyData, directory: Path) -> Path:
    prefix = directory / "corrupt"
    shutil.copyfile(f"{tiny.prefix}.bin", f"{prefix}.bin")
    idx = Path(f"{tiny.prefix}.idx").read_bytes()
    Path(f"{prefix}.idx").write_bytes(idx[:-5])  # a truncated index
    return prefix


def _other_tokenizer(tiny: TinyData, directory: Path) -> Path:
    path = directory / "other.model"
    train_tokenizer([tiny.prefix.parent / "corpus.jsonl"], tiny.vocab_size - 20, path, num_threads=1)
    return path


# (case, flags after the defaults, words the message must contain, caught before the model is built)
ERROR_CASES = [
    ("missing data", lambda t, d: ["--data", str(d / "nope")], "missing dataset file", True),
    ("corrupt idx", lambda t, d: ["--data", str(_corrupt_copy(t, d))], "truncated or corrupt", True),
    ("foreign tokenizer", lambda t, d: ["--tokenizer", str(_other_tokenizer(t, d))],
     "belongs to another tokenizer", True),
    ("model vocab too small", lambda t, d: ["--model-overrides", "vocab_size=100"],
     "vocab_size=320", True),
    ("output under a file", lambda t, d: ["--output", str(_file(d) / "run")],
     "cannot write to the output directory", True),
    ("output is a file", lambda t, d: ["--output", str(_file(d))],
     "cannot write to the output directory", True),
    ("tp larger than the world", lambda t, d: ["--tp", "2"], "world size 1 != tp 2", False),
    ("seq_len past positions", lambda t, d: ["--seq-len", "512"], "max_position_embeddings", False),
]


def _file(directory: Path) -> Path:
    path = directory / "a-file"
    path.write_text("not a directory")
    return path


@pytest.mark.parametrize(("flags", "message", "early"), [c[1:] for c in ERROR_CASES],
                         ids=[c[0] for c in ERROR_CASES])
def test_clear_errors(tiny, tmp_path, capsys, monkeypatch, flags, message, early):
    if early:  # data and output problems must surface before any model is built
        def no_setup(*args):
            raise AssertionError("the model was built before the inputs were checked")

        monkeypatch.setattr(loop_module, "setup", no_setup)
    argv = pretrain_argv(tiny, tmp_path / "run", *flags(tiny, tmp_path))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tessera pretrain: ") and message in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_demo_checks_its_output_before_preparing_data(tmp_path, capsys):
    assert cli.main(["--output", str(_file(tmp_path) / "run"), "--steps", "1"]) == 2
    assert "cannot write to the output directory" in capsys.readouterr().err


# ------------------------------------------------------------------------ resume, checkpoints


def test_resume_is_bit_identical(tiny, run8, tmp_path, capsys):
    part = tmp_path / "part"
    rewind_run(run8, part, 4)
    # A crash mid-save leaves a temporary directory: resuming ignores it and the next save prunes it.
    stale = part / "checkpoints" / ".step-00000005.tmp-deadbeef"
    stale.mkdir()
    (stale / "model-tp00-pp00.safetensors").write_bytes(b"\x00" * 100)
    replaced = part / "checkpoints" / ".step-00000003.old-deadbeef"  # killed mid-replace
    shutil.copytree(part / "checkpoints" / "step-00000004", replaced)
    assert latest_checkpoint(part).name == "step-00000004"

    cfg, _ = load_config(pretrain_argv(tiny, part, "--resume"))
    summary = pretrain(cfg)
    assert "resumed from" in capsys.readouterr().out
    full, resumed = read_losses(run8), read_losses(part)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert [resumed[s] for s in range(5, 9)] == [full[s] for s in range(5, 9)]  # bit-identical
    assert summary["steps"] == 8 and summary["checkpoint"].endswith("step-00000008")
    assert not stale.exists() and not replaced.exists()
    assert read_training_record(latest_checkpoint(part))["consumed_samples"] == 8 * 8

    # A pointer naming a pruned checkpoint falls back to the newest complete one.
    (part / "checkpoints" / "latest").write_text("step-00000099\n")
    assert latest_checkpoint(part).name == "step-00000008"
    # Resuming into another model is refused, naming the difference.
    argv = pretrain_argv(tiny, part, "--resume", "--model-overrides", "vocab_size=320", "num_layers=2")
    assert cli.main(argv) == 2
    assert "num_layers" in capsys.readouterr().err


def test_loss_falls(run30):
    losses = [run30[s] for s in sorted(run30)]
    assert len(losses) == 30
    assert losses[-1] < losses[0] - 1.0, losses


# --------------------------------------------------------------------------------- signals


class _Lines:
    """The stdout lines of a subprocess, read on a thread so waiting can time out."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.seen, self._queue = proc, [], queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, prefix: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        self.proc.kill()
        raise AssertionError(f"no line starting {prefix!r}; output:\n{''.join(self.seen)}")


def _start(argv: list[str]) -> tuple[subprocess.Popen, _Lines]:
    proc = subprocess.Popen(tessera_command("pretrain", *argv), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=SUBPROCESS_ENV)
    return proc, _Lines(proc)


def test_sigterm_saves_then_resume_continues(tiny, run30, tmp_path):
    run = tmp_path / "run"
    argv = pretrain_argv(tiny, run, *LONG, "--log-interval", "1")
    proc, lines = _start(argv)
    lines.wait_for("step ")
    proc.send_signal(signal.SIGTERM)
    lines.wait_for("saved checkpoint")
    # 128 + SIGTERM: saved, but interrupted, so a scheduler requeues it with --resume.
    assert proc.wait(timeout=60) == 143, "".join(lines.seen)
    ckpt = latest_checkpoint(run)
    stopped_at = read_training_record(ckpt)["step"]
    assert 1 <= stopped_at < 30, "the run ended before the signal arrived"
    assert sorted(read_losses(run)) == list(range(1, stopped_at + 1))
    load_checkpoint(ckpt)

    cfg, _ = load_config([*argv, "--resume"])
    summary = pretrain(cfg)
    assert summary["steps"] == 30 and not summary["stopped_early"]
    losses = read_losses(run)
    assert [losses[s] for s in range(1, 31)] == [run30[s] for s in range(1, 31)]


# The async case also runs in the default run as test_async_save.py's kill mid-write.
@pytest.mark.parametrize("mode", [(), pytest.param(("--async-save",), marks=pytest.mark.slow)],
                         ids=["sync", "async"])
def test_sigkill_while_saving_leaves_a_resumable_checkpoint(tiny, run30, tmp_path, mode):
    """Kill the run at random moments while it saves every step; every time, the latest
    checkpoint must load and the run must resume from it, ending on the uninterrupted losses."""
    run = tmp_path / "run"
    argv = pretrain_argv(tiny, run, *LONG, "--save-interval", "1", "--keep-last", "2", "--resume",
                         *mode)
    rng = random.Random(0)
    previous = 0
    for _ in range(3):
        proc, lines = _start(argv)
        lines.wait_for("saved checkpoint")
        time.sleep(rng.uniform(0.0, 0.2))
        proc.kill()
        proc.wait(timeout=30)
        ckpt = latest_checkpoint(run)
        step = read_training_record(ckpt)["step"]
        assert ckpt.name == f"step-{step:08d}" and step > previous
        load_checkpoint(ckpt)
        previous = step
        if step >= 25:  # (on a fast machine) too few steps left for another round
            break
    cfg, _ = load_config(argv)
    summary = pretrain(cfg)
    assert summary["steps"] == 30
    losses = read_losses(run)
    assert [losses[s] for s in range(1, 31)] == [run30[s] for s in range(1, 31)]
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]
    assert not leftovers


def test_compiled_training_follows_the_eager_losses(tiny, run8, tmp_path, monkeypatch):
    """`--compile` compiles each block (regional compilation), keeps parameter names
    (checkpoints load) and the loss curve (fusion may reorder float sums, so equal to 1e-4
    relative, not bitwise)."""
    compiled_blocks = []

    def compile_blocks(model):
        compiled_blocks.extend(real_compile_blocks(model))
        return compiled_blocks

    real_compile_blocks = loop_module.compile_blocks
    monkeypatch.setattr(loop_module, "compile_blocks", compile_blocks)
    run = tmp_path / "compiled"
    cfg, _ = load_config(pretrain_argv(tiny, run, "--compile", "--steps", "8"))
    pretrain(cfg)
    assert compiled_blocks == [f"layers.{i}" for i in range(4)]
    eager, compiled = read_losses(run8), read_losses(run)
    for step in range(1, 5):
        assert compiled[step] == pytest.approx(eager[step], rel=1e-4)
    assert (run / "checkpoints" / "step-00000008" / "manifest.json").is_file()


def test_sharded_data_parallel_is_accepted_but_not_with_fp16(tiny, tmp_path):
    from tessera.core.config import ConfigError
    from tessera.training.run_plan import resolve_plan

    for flavour in ("zero1", "fsdp"):
        cfg, _ = load_config(pretrain_argv(tiny, tmp_path / "run", "--data-parallel", flavour))
        resolve_plan(cfg, 1)  # dp 1: nothing to shard, nothing to refuse
        resolve_plan(cfg, 2)  # wired into the loop and its checkpoints (tests/distributed)
        cfg, _ = load_config(pretrain_argv(tiny, tmp_path / "run", "--data-parallel", flavour,
                                           "--precision", "fp16"))
        with pytest.raises(ConfigError, match=f"data_parallel '{flavour}' does not support fp16"):
            resolve_plan(cfg, 2)
