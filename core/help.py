"""`--help` that reads well: prose wrapped, examples kept line by line, each default shown once.

Every `tessera` verb's parser uses `HelpFormatter` (clients, which may not import core, write
their defaults into the help texts themselves).
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any


def default_text(value: Any) -> str:
    """How `--help` shows a default: true/false, `none` for an empty value, lists space-joined."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None or value == "" or value == []:
        return "none"
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def with_default(help_: str, value: Any) -> str:
    """`help_` ending in "(default: VALUE)", unless it already says its default in its own words."""
    return help_ if "default" in help_ else f"{help_} (default: {default_text(value)})"


class HelpFormatter(argparse.HelpFormatter):
    """Wraps prose paragraphs but keeps indented lines (examples) as written, one per line, and
    appends "(default: X)" to a flag's help unless the text already names its default.

    A flag whose default is None, False (a switch) or suppressed gets no default appended: write
    what "not given" means into its help instead.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for line in text.split("\n"):
            if not line.strip() or line[0].isspace():
                out.append(indent + line)
            else:
                out.append(textwrap.fill(line, width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        default = action.default
        if (default is None or default is False or default == argparse.SUPPRESS
                or not action.option_strings or "default" in help_):
            return help_
        return f"{help_} (default: {default_text(default)})".replace("%", "%%")
