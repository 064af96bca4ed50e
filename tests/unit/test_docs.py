"""The documentation's examples work: every fenced block marked runnable in README.md and docs/
runs, in order, and every `tessera VERB --flag` a shell block names exists in that verb's parser.

A runnable block is a ```bash or ```python block right after a `<!-- runnable -->` line. A page's
runnable blocks run one after another in one fresh directory (later blocks use what earlier ones
wrote), bash with `-euo pipefail`, with this interpreter's `python3` and `tessera` first on PATH.
`<!-- runnable: "OLD" -> "NEW"; ... -->` runs the block with OLD replaced by NEW (the demo's
300 steps become 2: the test checks the commands, not the demo's length), and OLD must occur.
Port 8000 becomes a free port, so parallel runs do not collide. Background processes a block
leaves (a server) are ended when the page is done.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"^<!-- runnable(?::\s*(?P<subs>.*?))?\s*-->\n```(?P<lang>\w+)[^\n]*\n(?P<code>.*?)^```",
                    flags=re.S | re.M)
SUBSTITUTION = re.compile(r'"(?P<old>[^"]+)"\s*->\s*"(?P<new>[^"]*)"')
BLOCK_TIMEOUT_S = 600


def _hook():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs/hooks/cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def runnable_blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    blocks = []
    for match in MARKER.finditer(text):
        line = text.count("\n", 0, match.start()) + 2
        code = match.group("code")
        for sub in SUBSTITUTION.finditer(match.group("subs") or ""):
            assert sub.group("old") in code, (
                f"{page.name}:{line}: the runnable marker replaces {sub.group('old')!r}, "
                "which the block no longer contains")
            code = code.replace(sub.group("old"), sub.group("new"))
        lang = match.group("lang")
        assert lang in ("bash", "python"), f"{page.name}:{line}: cannot run {lang}"
        blocks.append(Block(page, line, match.group("lang"), code))
    return blocks


def test_the_newcomer_path_is_runnable():
    """README's tour (clone -> demo) and every later step in Getting started (own data -> serve ->
    tune -> Hugging Face) are marked runnable, so the test runs them."""
    readme = " ".join(b.code for b in runnable_blocks(ROOT / "README.md"))
    guide = " ".join(b.code for b in runnable_blocks(ROOT / "docs/getting-started.md"))
    for command in ("python3 -m tessera pretrain", "tessera generate", "tessera plan"):
        assert command in readme, command
    for command in ("tessera tokenizer train", "tessera preprocess", "tessera pretrain --data",
                    "--resume true", "tessera evaluate", "tessera generate", "tessera serve",
                    "from openai import OpenAI", "tessera tune", "tessera convert --to hf",
                    "AutoModelForCausalLM"):
        assert command in guide, command


def test_docs_name_only_flags_the_parsers_know():
    hook = _hook()
    parsers = hook.all_parsers()
    problems = [f"{page.relative_to(ROOT)} {problem}" for page in PAGES
                for problem in hook.stale_flags(page.read_text(encoding="utf-8"), parsers)]
    assert not problems, "\n".join(problems)


def test_a_stale_flag_is_reported():
    hook = _hook()
    page = "```bash\ntessera pretrain --steps 2 \\\n    --no-such-flag 3 && tessera nosuchverb\n```\n"
    problems = hook.stale_flags(page, hook.all_parsers())
    verbs = ", ".join(hook.all_parsers())
    assert problems == ["block at line 1: `tessera pretrain` has no option --no-such-flag",
                        f"block at line 1: `tessera nosuchverb` is not a verb ({verbs})"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(block: Block, workdir: Path, env: dict[str, str], port: int, groups: list[int]) -> None:
    code = re.sub(r"\b8000\b", str(port), block.code)
    log = workdir / f".block-{block.line}.log"
    if block.lang == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", code]
    else:
        argv = [sys.executable, "-c", code]
    # Output to a file, not a pipe: a server a block starts in the background keeps its copy of
    # stdout open, and reading a pipe would wait for it. Its own session lets us end it after.
    with open(log, "w") as out:
        process = subprocess.Popen(argv, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        groups.append(process.pid)
        try:
            rc = process.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        pytest.fail(f"{block.where()}: the {block.lang} block failed ({rc}):\n{code}\n--- output ---\n{tail}")


def _first_block_runs_on_an_earlier_page(page: Path, blocks: list[Block]) -> bool:
    """Whether this page's first block is, line for line, the start of an earlier page's first
    block: both run first, in a fresh directory, so the earlier page has run these very commands
    (Getting started repeats README's demo tour). Any difference and it runs here too."""
    mine = blocks[0].code.splitlines()
    for other in PAGES[:PAGES.index(page)]:
        theirs = runnable_blocks(other)
        if theirs and theirs[0].lang == blocks[0].lang and theirs[0].code.splitlines()[:len(mine)] == mine:
            return True
    return False


def test_only_a_repeated_first_block_is_left_to_the_earlier_page():
    readme, guide = ROOT / "README.md", ROOT / "docs/getting-started.md"
    tour = runnable_blocks(readme)[0]
    lines = tour.code.splitlines(keepends=True)
    assert not _first_block_runs_on_an_earlier_page(readme, [tour])  # nothing comes before it
    repeated = Block(guide, 1, tour.lang, "".join(lines[:2]))
    assert _first_block_runs_on_an_earlier_page(guide, [repeated])
    for code in ("".join(lines[1:3]), "".join(lines[:2]) + "tessera models --extra\n"):
        assert not _first_block_runs_on_an_earlier_page(guide, [Block(guide, 1, tour.lang, code)])
    assert not _first_block_runs_on_an_earlier_page(guide, [Block(guide, 1, "python", repeated.code)])


# A page runs a dozen commands, each importing torch: minutes on a loaded two-core machine.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", [p for p in PAGES if runnable_blocks(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_blocks_run(page: Path, tmp_path: Path):
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
           "TESSERA_FUSED_KERNELS": os.environ.get("TESSERA_FUSED_KERNELS", "off"),
           "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if not Path(bindir, "python3").exists():  # blocks say python3; make it this interpreter
        Path(tmp_path / "bin").mkdir()
        Path(tmp_path / "bin" / "python3").symlink_to(sys.executable)
        env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"
    workdir = tmp_path / "work"
    workdir.mkdir()
    port, groups = _free_port(), []
    blocks = runnable_blocks(page)
    if _first_block_runs_on_an_earlier_page(page, blocks):
        blocks = blocks[1:]
    try:
        for block in blocks:
            _run(block, workdir, env, port, groups)
    finally:
        for group in groups:  # a background server the page started and did not stop
            try:
                os.killpg(group, signal.SIGTERM)
            except ProcessLookupError:
                pass
