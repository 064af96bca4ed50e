"""Config values written as text or YAML, converted to their dataclass field's type.

One conversion for every config surface (flags, YAML sections, `--model-overrides`), so a value
means the same wherever it is written.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from tessera.core.arg_types import Bounded, str2bool
from tessera.core.config import ConfigError


def coerce_field(where: str, value: Any, typ: Any, bounds: Bounded | None = None) -> Any:
    """`value` as a field of type `typ`, converted (and range-checked against `bounds`) as the
    flag parser would convert it.

    YAML reads `3e-4` as a string and `data: corpus` as one string rather than a list; both are
    converted here, and a value that cannot be, or is out of range, raises `ConfigError` naming
    `where`.
    """
    if typing.get_origin(typ) in (typing.Union, types.UnionType):  # optional: `int | None`
        if value is None:
            return None
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    if typing.get_origin(typ) is typing.Literal:
        typ = str
    scalar = isinstance(value, (str, int, float)) and not isinstance(value, bool)
    converted: Any = None
    try:
        if typ is bool:
            converted = value if isinstance(value, bool) else str2bool(str(value))
        elif typ in (int, float) and scalar:
            converted = typ(value)
            if typ is int and float(value) != converted:  # 2.5 is not an int
                converted = None
        elif typ is str and scalar:
            converted = str(value)
        elif typing.get_origin(typ) is list and isinstance(value, (list, tuple)):
            converted = [str(v) for v in value]
        elif typing.get_origin(typ) is list and scalar:
            converted = str(value).split()
    except (ValueError, argparse.ArgumentTypeError):
        converted = None
    if converted is None:
        name = getattr(typ, "__name__", str(typ))
        raise ConfigError(f"{where}: expected {name}, got {value!r}")
    problem = bounds.problem(converted) if bounds is not None and typ in (int, float) else None
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return converted
