"""The `tessera` command's surface: help lists every verb, version, unknown verbs, lazy imports."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from tessera import __version__
from tessera.__main__ import VERBS, main


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help_lists_every_verb(flag, capsys):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"tessera {__version__}")
    for verb, (_, help_) in VERBS.items():
        assert f"  {verb} " in out and help_ in out


def test_version_matches_the_installed_package(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == __version__
    assert importlib.metadata.version("tessera") == __version__  # pyproject and code agree


def test_unknown_verb_exits_2_with_a_clear_message(capsys):
    assert main(["frobnicate"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "tessera: unknown verb 'frobnicate'" in captured.err
    assert all(verb in captured.err for verb in VERBS)  # and shows what would have worked


def test_verb_table_entries_point_into_tessera():
    for verb, (target, help_) in VERBS.items():
        module, _, func = target.partition(":")
        assert module.startswith("tessera.") and func.isidentifier(), verb
        assert help_ and "\n" not in help_, verb


def test_python_dash_m_tessera_in_a_fresh_process():
    unknown = subprocess.run(
        [sys.executable, "-m", "tessera", "frobnicate"], capture_output=True, text=True, timeout=60
    )
    assert unknown.returncode == 2
    assert "unknown verb 'frobnicate'" in unknown.stderr

    # `--help` must not import any verb's module (that is what keeps it fast).
    code = (
        "import sys; from tessera.__main__ import main; main(['--help']); "
        "print([m for m in sys.modules if m.startswith('tessera.')])"
    )
    helped = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert helped.stdout.splitlines()[-1] == "['tessera.__main__']"
    assert all(verb in helped.stdout for verb in VERBS)

