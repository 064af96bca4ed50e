"""Clients of a Tessera server: `Client` / `AsyncClient` (OpenAI routes, streaming, retries).

Imported lazily, so `tessera generate --checkpoint` (local generation) does not load httpx.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AsyncClient", "Client", "TesseraError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tessera.clients import client

        return getattr(client, name)
    raise AttributeError(f"module 'tessera.clients' has no attribute {name!r}")
