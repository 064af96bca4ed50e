"""The Python API page's snippets (docs/python-api.md, linked from the PAGE) run as written, in
order, in one namespace, so they cannot drift from the code. The setup is what Getting started
leaves behind that the snippets read: a `tok.model` from `tessera tokenizer train` (here a small
one on made-up text) in the working directory."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"
SECTION = "## Models, checkpoints and the engine"


def python_snippets(text: str, section: str = SECTION) -> list[str]:
    """The ```python blocks of `section` (up to the next `## ` heading), in order."""
    start = text.index(f"\n{section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start:end if end >= 0 else None]
    return re.findall(r"^```python\n(.*?)^```", body, flags=re.S | re.M)


def test_the_section_has_the_snippets_the_test_runs():
    snippets = python_snippets(PAGE.read_text(encoding="utf-8"))
    assert len(snippets) == 2 and "save_checkpoint" in snippets[0] and "LLMEngine" in snippets[1]


def test_python_api_snippets_run_in_order(workdir: Path, capsys: pytest.CaptureFixture[str]):
    from tessera.core.tokenizer import train_tokenizer

    words = ("return the value", "def main", "print the result", "open a file", "read lines",
             "the loop ends", "call the function", "write a test")
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(6)) for i in range(400)]
    train_tokenizer([], 320, workdir / "tok.model", "bpe", texts=texts, num_threads=1)
    namespace: dict = {"__name__": "readme"}
    for number, snippet in enumerate(python_snippets(PAGE.read_text(encoding="utf-8")), 1):
        try:
            exec(compile(snippet, f"docs/python-api.md snippet {number}", "exec"), namespace)
        except Exception as exc:  # name the snippet that broke
            raise AssertionError(f"Python API snippet {number} failed: {exc!r}") from exc
    completions = ast.literal_eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(completions, list) and len(completions) == 2
    # Strings, possibly empty: the snippets sample (unseeded) from a model with random weights,
    # whose first draw may be the end-of-sequence token.
    assert all(isinstance(c, str) for c in completions), completions
