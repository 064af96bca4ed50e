"""`tessera VERB --help`: fast (no torch imported), every flag's default shown once, examples
kept line by line, no secret from the environment; and the model presets table."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import subprocess
import sys

import pytest

from tessera.__main__ import VERBS, main
from tessera.core.config import PRESETS, ModelConfig
from tessera.core.help import default_text
from tessera.core.parallel.sharding import num_parameters
from tessera.training.config import _PARALLEL_HELP, SECTIONS, PretrainConfig
from tessera.tuning.config import SECTIONS as TUNE_SECTIONS
from tessera.tuning.config import TuneRunConfig

HELP_WITHOUT_TORCH = sorted(VERBS)


@pytest.fixture
def help_text(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """`tessera ARGV --help` run in this process (argparse reads COLUMNS when it formats); a fresh
    interpreter is what test_help_imports_no_torch is about, not what these tests check."""

    def run(*argv: str, columns: int = 80, env: dict[str, str] | None = None) -> str:
        with monkeypatch.context() as patch:
            for name, value in {"COLUMNS": str(columns), **(env or {})}.items():
                patch.setenv(name, value)
            capsys.readouterr()
            with pytest.raises(SystemExit) as exit_info:
                main([*argv, "--help"])
            out, err = capsys.readouterr()
        assert exit_info.value.code in (0, None), err
        return out

    return run


def _option_blocks(text: str) -> dict[str, str]:
    """Each option's help block by its first flag, whitespace collapsed."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            blocks[current] = [line]
        elif current and line.startswith("    "):
            blocks[current].append(line)
        else:
            current = None
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in blocks.items()}


# One fresh interpreter prints every verb's help in turn, each followed by a line naming the torch
# modules loaded so far: a verb that imports torch shows in its own line (and hides any later
# verb that would too, until it is fixed).
_NO_TORCH_CHILD = """
import json, sys
from tessera.__main__ import main
for verb in sys.argv[1:]:
    try:
        main([verb, "--help"])
    except SystemExit:
        pass
    torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:3]
    print("TORCH-AFTER " + json.dumps([verb, torch]))
"""


@pytest.fixture(scope="module")
def help_in_one_fresh_process() -> dict[str, tuple[str, list[str]]]:
    """Each verb's `--help` text and the torch modules loaded once it had printed."""
    done = subprocess.run([sys.executable, "-c", _NO_TORCH_CHILD, *HELP_WITHOUT_TORCH],
                          capture_output=True, text=True, timeout=120, check=True)
    by_verb, text = {}, []
    for line in done.stdout.splitlines():
        if line.startswith("TORCH-AFTER "):
            verb, torch = json.loads(line.removeprefix("TORCH-AFTER "))
            by_verb[verb] = ("\n".join(text), torch)
            text = []
        else:
            text.append(line)
    return by_verb


@pytest.mark.parametrize("verb", HELP_WITHOUT_TORCH)
def test_help_imports_no_torch(verb, help_in_one_fresh_process):
    text, torch = help_in_one_fresh_process[verb]
    assert "usage: tessera" in text
    assert torch == [], f"`tessera {verb} --help` imported torch"


@pytest.mark.parametrize("verb, sections, defaults", [
    ("pretrain", SECTIONS, PretrainConfig()),
    ("tune", TUNE_SECTIONS, TuneRunConfig()),
])
def test_every_field_shows_its_own_default_once(verb, sections, defaults, help_text):
    blocks = _option_blocks(help_text(verb))
    for section, owner in sections.items():
        for f in dataclasses.fields(owner):
            flag = f"--{f.name.replace('_', '-')}"
            block = blocks[flag]
            assert block.count("default") == 1, block
            own_words = f.metadata.get("help") or _PARALLEL_HELP.get(f.name, "")
            if "default" not in own_words:  # else the help says what the default means
                value = getattr(getattr(defaults, section), f.name)
                assert block.endswith(f"(default: {default_text(value)})"), block
    # Tuning's own defaults, not pretraining's.
    if verb == "tune":
        assert "(default: 0.03)" in blocks["--lr"] and "(default: runs/tune)" in blocks["--output"]
    else:
        assert "(default: 0.003)" in blocks["--lr"] and "(default: runs/pretrain)" in blocks["--output"]


@pytest.mark.parametrize("verb", ["pretrain", "tune", "serve", "convert", "generate"])
def test_no_flag_prints_two_defaults(verb, help_text):
    for block in _option_blocks(help_text(verb)).values():
        assert block.count("(default:") <= 1, block


@pytest.mark.parametrize("verb, example", [
    ("pretrain", "  torchrun --nproc-per-node 8 -m tessera pretrain --config run.yaml --tp 2 --pp 2\n"),
    ("tune", "  tessera tune --import-peft ADAPTER --checkpoint BASE --task NAME --output DIR\n"),
    ("serve", "  TESSERA_API_KEY=secret tessera serve --checkpoint CKPT --host 0.0.0.0\n"),
    ("convert", "  tessera convert --input ckpt/tp8pp4 --output ckpt/serve-fp8 --tp 1 --pp 1 --fp8\n"),
    ("generate", '  tessera generate "Return the" --url http://127.0.0.1:8000 --model demo:qa\n'),
])
def test_examples_keep_their_lines(verb, example, help_text):
    text = help_text(verb, columns=60)  # narrower than the example: it must not be reflowed
    assert example in text
    assert "\nexamples:\n" in text


def test_help_never_prints_the_api_key(help_text):
    for verb in ("generate", "serve"):
        text = help_text(verb, env={"TESSERA_API_KEY": "s3cret-key"})
        assert "s3cret-key" not in text and "$TESSERA_API_KEY" in text


def test_list_models_prints_every_preset_with_its_sizes(capsys):
    assert main(["pretrain", "--list-models"]) == 0
    table = capsys.readouterr().out
    assert main(["models"]) == 0
    assert capsys.readouterr().out == table
    header, rule, *rows = table.split("\n\n")[0].splitlines()
    assert header.split()[:3] == ["preset", "family", "params"]
    assert set(rule) == {"-", " "}
    assert len(rows) == len(PRESETS)
    by_name = {row.split()[0]: row.split() for row in rows}
    assert set(by_name) == set(PRESETS)
    llama3 = ModelConfig.from_name("llama3-8b")
    assert by_name["llama3-8b"] == ["llama3-8b", "llama", "8.0B", "32", "4096", "32", "8", "14336",
                                    "128256", "8192"]
    assert num_parameters(llama3) == 8_030_261_248  # Meta's published count for Llama 3 8B
    assert "(=" in " ".join(by_name["gpt2-124m"])  # an alias says what it repeats


def test_server_version_is_the_installed_one():
    from tessera.serving.http.version import SERVER_VERSION

    assert SERVER_VERSION == importlib.metadata.version("tessera")


def test_convert_shard_size_default_is_the_exporters():
    from tessera.converters.cli import DEFAULT_SHARD_SIZE, parse_size
    from tessera.converters.hf_io import DEFAULT_SHARD_SIZE as EXPORT_DEFAULT

    assert parse_size(DEFAULT_SHARD_SIZE) == EXPORT_DEFAULT


def test_generate_dispatches_local_and_remote(tmp_path, capsys):
    """--checkpoint runs beside the engine (through the root command), never inside clients."""
    from tessera.clients.cli import main as client_main

    assert main(["generate", "x", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "tessera generate:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        client_main(["x", "--checkpoint", str(tmp_path)])  # no local generator handed in
    assert exit_info.value.code == 2
    assert "tessera.serving.generate" in capsys.readouterr().err
