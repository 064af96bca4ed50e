"""MkDocs hook: the command reference is generated from the verbs' own argparse parsers, and every
`tessera VERB --flag` in a page's shell blocks is checked against them.

Inputs: the verb table `tessera.__main__.VERBS` (verb -> "module:function"). Each verb's parser is
captured by calling its function with `--help` while `ArgumentParser.parse_args` is patched to
hand back the parser instead of parsing, so no verb needs a special entry point.
Outputs: generated pages `reference/cli/index.md` and `reference/cli/VERB.md`; a warning (which
`mkdocs build --strict` turns into a failure) for every flag or verb a page names that no parser
knows. `tests/unit/test_docs.py` imports the same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.tessera_cli")

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGS = ("bash", "sh", "shell", "console")
SEPARATORS = {"&&", "||", "|", ";", "&", ">", ">>", "<", "2>", "(", ")"}


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def verb_parser(verb: str) -> argparse.ArgumentParser:
    """The parser `tessera VERB` parses its argv with (nothing is run)."""
    from tessera.__main__ import VERBS

    module_name, func_name = VERBS[verb][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            func(["--help"])
    except _Captured as found:
        return found.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    raise RuntimeError(f"tessera {verb} returned without parsing its arguments")


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    from tessera.__main__ import VERBS

    return {verb: verb_parser(verb) for verb in VERBS}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


# --- reference pages --------------------------------------------------------------------------

def _usage(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"  # argparse wraps to $COLUMNS: fixed, so the page is stable
    try:
        return parser.format_usage().strip()
    finally:
        if old is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = old


def _escape(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = ["| option | what it does |", "|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        names = ", ".join(action.option_strings) or action.dest
        if action.option_strings and action.nargs != 0:
            names += f" {formatter._format_args(action, action.dest.upper())}"
        text = formatter._expand_help(action) if action.help else ""
        rows.append(f"| `{_escape(names)}` | {_escape(text)} |")
    return rows


def verb_page(verb: str, summary: str, parser: argparse.ArgumentParser) -> str:
    lines = [f"# tessera {verb}", "", f"{summary[:1].upper()}{summary[1:]}.", "",
             "Generated from the command's own parser when the site is built; `tessera "
             f"{verb} --help` prints the same.", ""]
    sections = [(f"tessera {verb}", parser)]
    sections += [(f"tessera {verb} {name}", sub) for name, sub in _subparsers(parser).items()]
    for title, p in sections:
        if len(sections) > 1:
            lines += [f"## `{title}`", ""]
        if p.description:
            lines += [_escape(p.description), ""]
        lines += ["```text", _usage(p), "```", ""]
        lines += _options_table(p) + [""]
        if p.epilog:
            lines += ["```text", p.epilog.strip("\n"), "```", ""]
    return "\n".join(lines)


def index_page(summaries: dict[str, str]) -> str:
    lines = ["# Command reference", "",
             "`tessera VERB [options]`; `tessera VERB --help` prints the same. These pages are "
             "generated from the parsers when the site is built, so they cannot drift from the "
             "code.", "", "| verb | what it does |", "|---|---|"]
    lines += [f"| [`tessera {verb}`]({verb}.md) | {text} |" for verb, text in summaries.items()]
    return "\n".join(lines) + "\n"


# --- stale flags in the prose ------------------------------------------------------------------

def shell_blocks(markdown: str) -> Iterator[tuple[int, str, str]]:
    """(line number, language, body) of every fenced block in a shell language."""
    for match in re.finditer(r"^ *```(\w*)[^\n]*\n(.*?)^ *```", markdown, flags=re.S | re.M):
        if match.group(1) in SHELL_LANGS:
            yield markdown.count("\n", 0, match.start()) + 1, match.group(1), match.group(2)


def _commands(lang: str, body: str) -> Iterator[list[str]]:
    body = body.replace("\\\n", " ")
    for line in body.splitlines():
        line = line.strip()
        if lang == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:  # an unbalanced quote: a heredoc or a fragment, not a command
            continue
        command: list[str] = []
        for token in tokens + [";"]:
            if token in SEPARATORS:
                if command:
                    yield command
                command = []
            else:
                command.append(token)


def stale_flags(markdown: str, parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """Problems with the `tessera VERB --flag ...` commands of the shell blocks, one per line."""
    problems = []
    for line_no, lang, body in shell_blocks(markdown):
        for tokens in _commands(lang, body):
            for i, token in enumerate(tokens):
                if token == "tessera" or (token == "-m" and tokens[i + 1:i + 2] == ["tessera"]):
                    start = i + 1 if token == "tessera" else i + 2
                    problems += _check(tokens[start:], parsers, line_no)
                    break
    return problems


def _check(args: list[str], parsers: dict[str, argparse.ArgumentParser], line_no: int) -> list[str]:
    if not args or args[0].startswith("-"):
        return []  # `tessera`, `tessera --help`: the demo and the verb table
    verb, rest = args[0], args[1:]
    if verb not in parsers:
        return [f"block at line {line_no}: `tessera {verb}` is not a verb ({', '.join(parsers)})"]
    parser, name = parsers[verb], f"tessera {verb}"
    options = _options(parser)
    subs = _subparsers(parser)
    if subs and rest and rest[0] in subs:
        parser, name = subs[rest[0]], f"{name} {rest[0]}"
        options |= _options(parser)
    problems = []
    for arg in rest:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag != "--" and flag not in options:
            problems.append(f"block at line {line_no}: `{name}` has no option {flag}")
    return problems


# --- MkDocs events -----------------------------------------------------------------------------

IMPORT_TREE = ROOT / "build" / "docs-import-tree"
SUBPACKAGES = ("core", "training", "tuning", "converters", "serving", "clients", "plan")


def import_tree() -> Path:
    """The package laid out as installed (links), where mkdocstrings reads the docstrings: the
    subpackages live in top-level folders that pyproject's package-dir maps onto `tessera.*`."""
    package = IMPORT_TREE / "tessera"
    package.mkdir(parents=True, exist_ok=True)
    for source in [*(ROOT / "tessera").glob("*.py"), *(ROOT / name for name in SUBPACKAGES)]:
        link = package / source.name
        if not link.is_symlink():
            link.symlink_to(source)
    return IMPORT_TREE


def on_startup(command, dirty):
    import_tree()


_parsers: dict[str, argparse.ArgumentParser] = {}


def on_config(config):
    import_tree()
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    from tessera.__main__ import VERBS

    _parsers.clear()
    _parsers.update(all_parsers())
    summaries = {verb: help_ for verb, (_, help_) in VERBS.items()}
    files.append(File.generated(config, "reference/cli/index.md", content=index_page(summaries)))
    for verb, parser in _parsers.items():
        files.append(File.generated(config, f"reference/cli/{verb}.md",
                                    content=verb_page(verb, summaries[verb], parser)))
    return files


def on_pre_build(config):
    readme = ROOT / "README.md"
    for problem in stale_flags(readme.read_text(encoding="utf-8"), _parsers or all_parsers()):
        log.warning("README.md %s", problem)


def on_page_markdown(markdown, page, config, files):
    for problem in stale_flags(markdown, _parsers):
        log.warning("%s %s", page.file.src_uri, problem)
    return markdown
