"""Range-checked numbers for every `tessera` verb's flags, as argparse `type=` callables.

`--port 99999` or `--global-batch 0` fails at parse time with argparse's one-line error and exit
status 2 ("argument --port: must be between 1 and 65535, got 99999"), before anything is loaded.
The same ranges check YAML values (`Bounded.problem`), so a config file cannot slip past them.

This module imports only the standard library: the clients' CLI, which may not import torch,
uses it too.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Bounded:
    """An int or float flag value within [low, high] (either end optional, either end open).

    Calling it parses a flag's text (argparse `type=`); `problem` checks a value already parsed,
    e.g. from YAML. NaN and infinities are refused: no flag means them.
    """

    kind: type  # int or float
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            noun = "a whole number" if self.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        problem = self.problem(value, shown=text)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    @property
    def __name__(self) -> str:  # argparse names the type in some of its own messages
        return self.kind.__name__

    def problem(self, value: int | float, shown: str | None = None) -> str | None:
        """What is wrong with `value` ("must be >= 1, got 0"), or None when it is in range.
        `shown` is how the user wrote it (the flag's text), else the value is shown."""
        shown = str(value) if shown is None else shown
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {shown}"
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open
                                              else value > self.high)
        if too_low or too_high:
            return f"must be {self.describe()}, got {shown}"
        return None

    def describe(self) -> str:
        """The range in words: ">= 1", "> 0", "between 1 and 65535", "in [0, 1)"."""
        if self.low is not None and self.high is not None:
            if not (self.low_open or self.high_open):
                return f"between {_num(self.low)} and {_num(self.high)}"
            return (f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return "a number"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


positive_int = Bounded(int, low=1)
non_negative_int = Bounded(int, low=0)
positive_float = Bounded(float, low=0, low_open=True)
non_negative_float = Bounded(float, low=0)
fraction_below_one = Bounded(float, low=0, high=1, high_open=True)  # dropout, Adam's betas
top_p = Bounded(float, low=0, high=1, low_open=True)  # nucleus sampling mass: (0, 1]
port = Bounded(int, low=1, high=65535)


def str2bool(text: str) -> bool:
    """`true/false` (also 1/0, yes/no, on/off) as a bool; anything else is an argparse error."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


RESUME_MODES = ("auto", "true", "false")


def resume_mode(value: str | bool) -> str:
    """`--resume` as one of `RESUME_MODES`: `auto`, or any true/false spelling `str2bool`
    takes (a YAML bool too) as `true` / `false`; anything else is an argparse error."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if str(value).lower() == "auto":
        return "auto"
    try:
        return "true" if str2bool(str(value)) else "false"
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, true or false, got {value!r}") from None
