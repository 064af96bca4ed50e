"""Running the demo again never deletes the demo run already in its directory."""

from pathlib import Path

import pytest

from tessera.core.checkpoint import MANIFEST
from tessera.training import cli, demo
from tessera.training import loop as loop_module
from tessera.training.run_dir import claim_run_dir


def fake_demo_run(run: Path, step: int) -> Path:
    """A run directory as the demo leaves it, with its last checkpoint at `step`."""
    ckpt = run / "checkpoints" / f"step-{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / MANIFEST).write_text("{}")
    (run / "checkpoints" / "latest").write_text(ckpt.name)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 7.6}\n')
    return ckpt


@pytest.fixture
def demo_calls(monkeypatch):
    """The demo with its data, training and sampling stubbed: training only claims the run
    directory (where an old run would be deleted or refused), sampling is recorded."""
    calls = {"trained": [], "samples": []}

    def fake_pretrain(cfg, **plan_options):
        claim_run_dir(cfg.loop.output, resume=cfg.loop.resume, overwrite=cfg.loop.overwrite)
        calls["trained"].append(cfg.loop.output)
        return {}

    monkeypatch.setattr(demo, "prepare_data", lambda run_dir, vocab: (None, None))
    monkeypatch.setattr(loop_module, "pretrain", fake_pretrain)
    monkeypatch.setattr(demo, "print_samples", calls["samples"].append)
    return calls


def test_a_finished_demo_is_kept_and_its_samples_printed(tmp_path, monkeypatch, demo_calls,
                                                        capsys):
    monkeypatch.chdir(tmp_path)
    ckpt = fake_demo_run(tmp_path / "runs" / "demo", 300)
    assert cli.main([]) == 0
    assert demo_calls["trained"] == []
    assert demo_calls["samples"] == [str(Path("runs/demo/checkpoints/step-00000300"))]
    assert (ckpt / MANIFEST).is_file() and (tmp_path / "runs" / "demo" / "metrics.jsonl").is_file()
    out = capsys.readouterr().out
    assert "already holds a finished demo run" in out
    assert "`python -m tessera pretrain --overwrite`" in out  # a command that runs as written


def test_an_unfinished_demo_continues_by_default_and_is_never_deleted(tmp_path, monkeypatch,
                                                                     demo_calls, capsys):
    monkeypatch.chdir(tmp_path)
    ckpt = fake_demo_run(tmp_path / "runs" / "demo", 100)
    assert cli.main([]) == 0  # --resume auto: the (stubbed) training continues it
    assert demo_calls["trained"] == ["runs/demo"] and (ckpt / MANIFEST).is_file()
    demo_calls["trained"].clear()
    assert cli.main(["--resume", "false"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err, err
    assert (ckpt / MANIFEST).is_file()
    assert demo_calls["trained"] == []


def test_overwrite_trains_the_demo_anew(tmp_path, monkeypatch, demo_calls):
    monkeypatch.chdir(tmp_path)
    ckpt = fake_demo_run(tmp_path / "runs" / "demo", 300)
    assert cli.main(["--overwrite"]) == 0
    assert demo_calls["trained"] == ["runs/demo"]
    assert not ckpt.exists()


def test_a_demo_that_cannot_run_is_refused_before_making_anything(tmp_path, monkeypatch,
                                                                  demo_calls, capsys):
    monkeypatch.chdir(tmp_path)
    prepared = []
    monkeypatch.setattr(demo, "prepare_data", lambda run_dir, vocab: prepared.append(run_dir))
    assert cli.main(["--output", "new/run", "--tp", "3"]) == 2
    assert "invalid parallel layout" in capsys.readouterr().err
    assert prepared == [] and list(tmp_path.iterdir()) == []
