"""A process-wide `auto | on | off` switch read from an environment variable on first use,
which tests and callers may set instead (`TESSERA_FUSED_KERNELS`, `TESSERA_CHUNKED_CE`)."""

from __future__ import annotations

import os

MODES = ("auto", "on", "off")


class EnvSwitch:
    """`get()`: the mode set with `set()`, else `variable`'s value (default `auto`), checked
    to be one of `MODES`; `set(None)` reads the variable again on the next `get()`."""

    def __init__(self, variable: str, what: str) -> None:
        self.variable, self.what = variable, what
        self._mode: str | None = None

    def set(self, mode: str | None) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"{self.what} mode {mode!r} is not one of {MODES}")
        self._mode = mode

    def get(self) -> str:
        if self._mode is None:
            value = os.environ.get(self.variable, "auto").lower()
            if value not in MODES:
                raise ValueError(f"{self.variable}={value!r} is not one of {MODES}")
            self._mode = value
        return self._mode
