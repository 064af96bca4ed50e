"""Progress in a log (stderr not a terminal) is plain lines, never carriage-return frames; on a
terminal it is a tqdm bar."""

from __future__ import annotations

import io

from tessera.core.progress import Progress, progress_iter
from tessera.training.preprocess import main as preprocess


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_plain_lines():
    log = io.StringIO()
    with Progress("work", total=4, unit="step", every_s=0, stream=log) as bar:
        for i in range(4):
            bar.update(1, loss=f"{4 - i:.1f}")
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 4  # one per update (every_s=0), none repeated by close
    assert lines[0].startswith("work: 1/4 step (25%) | loss=4.0 | ")
    assert lines[-1].startswith("work: 4/4 step (100%) | loss=1.0 | ")


def test_a_short_job_in_a_log_prints_nothing():
    log = io.StringIO()
    with Progress("work", total=3, stream=log) as bar:  # well under every_s
        bar.update(3)
    assert log.getvalue() == ""


def test_a_terminal_gets_a_bar():
    tty = _Terminal()
    with Progress("work", total=2, stream=tty) as bar:
        bar.update(2)
    assert "\r" in tty.getvalue() and "work" in tty.getvalue()


def test_disabled_prints_nothing():
    log = io.StringIO()
    with Progress("work", total=2, every_s=0, enabled=False, stream=log) as bar:
        bar.update(2)
    assert list(progress_iter([1, 2], "x", enabled=False)) == [1, 2]
    assert log.getvalue() == ""


def test_preprocess_into_a_log_writes_lines_not_frames(tmp_path, capsys, monkeypatch):
    from tessera.core import progress
    from tests.pretrain_helper import make_tiny_data

    tiny = make_tiny_data(tmp_path, documents=300)
    original = progress.Progress.__init__

    def every_update(self, *args, **kw):
        original(self, *args, **{**kw, "every_s": 0})

    monkeypatch.setattr(progress.Progress, "__init__", every_update)
    capsys.readouterr()
    assert preprocess(["--input", str(tmp_path / "corpus.jsonl"), "--tokenizer",
                       str(tiny.tokenizer), "--output-prefix", str(tmp_path / "again")]) == 0
    err = capsys.readouterr().err  # pytest's capture: not a terminal
    assert "\r" not in err
    assert "preprocess: 300 docs | tokens=" in err, err
