"""Numbers for people: counts like `254.31M` and sizes like `1.5 GB`, one way everywhere (the
banner, `tessera models`, `tessera inspect`, conversion summaries)."""

from __future__ import annotations


def _scaled(n: float, base: int, units: tuple[str, ...]) -> tuple[float, str]:
    i = 0
    while abs(n) >= base and i < len(units) - 1:
        n, i = n / base, i + 1
    return n, units[i]


def human_count(n: float, digits: int = 2) -> str:
    """Counts like `254.31M` (K, M, B, T in steps of 1000; `digits` after the point)."""
    value, unit = _scaled(n, 1000, ("", "K", "M", "B", "T"))
    return f"{value:.0f}" if not unit else f"{value:.{digits}f}{unit}"


def human_bytes(n: float) -> str:
    """Sizes like `1.5 GB` (binary units)."""
    value, unit = _scaled(n, 1024, ("B", "KB", "MB", "GB", "TB"))
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
