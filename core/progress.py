"""Progress of long work (training steps, preprocessing, conversion) that suits where it goes.

On a terminal: a tqdm bar. Anywhere else (stderr redirected to a log file, a batch scheduler's
output, a pipe) a bar would write a carriage-return frame per refresh into the log, so a plain
line is printed instead, at most once per `every_s` seconds, and once more at the end if any was
(work done within `every_s` prints nothing):

    pretrain: 120/300 step (40%) | loss=3.412 lr=2.9e-03 | 1.9 step/s

`Progress` is the one helper every verb uses, so the two modes look the same everywhere.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

T = TypeVar("T")


class Progress:
    """Count `update`s towards `total` (None: open-ended), shown as a bar or as plain lines.

    `enabled=False` shows nothing; `write` then still prints (it is the caller's log line).
    `stream` (default stderr) decides the mode: a terminal gets the bar. Use as a context
    manager or call `close`.
    """

    def __init__(self, desc: str, *, total: int | None = None, initial: int = 0,
                 unit: str = "it", enabled: bool = True, every_s: float = 30.0,
                 stream: TextIO | None = None) -> None:
        self.desc, self.total, self.unit, self.every_s = desc, total, unit, every_s
        self.stream = stream or sys.stderr
        self.enabled, self.n, self.postfix = enabled, initial, ""
        self._start = self._last = time.perf_counter()
        self._initial, self._printed_at = initial, None
        self.bar = None
        if enabled and _is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.stream,
                            dynamic_ncols=True, leave=False)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advance by `n`; `postfix` values (already formatted or numbers) follow the count."""
        self.n += n
        if postfix:
            self.postfix = " ".join(f"{k}={v}" for k, v in postfix.items())
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            self._line()

    def write(self, text: str) -> None:
        """Print a line of the caller's own (above the bar, on a terminal) to stdout."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Remove the bar; in line mode print the final count if any line was printed."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled and self._printed_at is not None and self._printed_at != self.n:
            self._line()
        self.enabled = False

    def _line(self) -> None:
        count = f"{self.n:,}" if self.total is None else f"{self.n:,}/{self.total:,}"
        parts = [f"{self.desc}: {count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        if self.postfix:
            parts.append(self.postfix)
        elapsed = time.perf_counter() - self._start
        if elapsed > 0 and self.n > self._initial:
            parts.append(f"{(self.n - self._initial) / elapsed:,.1f} {self.unit}/s")
        print(" | ".join(parts), file=self.stream, flush=True)
        self._printed_at = self.n


def progress_iter(items: Iterable[T], desc: str, *, total: int | None = None,
                  unit: str = "it", enabled: bool = True) -> Iterator[T]:
    """`items`, advancing a `Progress` by one for each."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(desc, total=total, unit=unit, enabled=enabled) as bar:
        for item in items:
            yield item
            bar.update()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False
