"""Connection-level limits against slow and idle clients (slowloris), for uvicorn.

uvicorn times out idle keep-alive connections, but a connection that opens and never finishes
its request headers is kept forever, and so is a request whose body never comes. Here:

- `GuardedH11Protocol`: uvicorn's h11 protocol, closing a connection whose request headers are
  not complete `header_timeout_s` after the connection opened or the previous response ended;
- the body read timeout lives in `security.GuardMiddleware` (a 408 when a body chunk is late);
- `server_config(...)` builds the `uvicorn.Config` with these and with `limit_concurrency`
  (connections beyond `max_connections` are answered 503), `timeout_keep_alive` and
  `h11_max_incomplete_event_size` (request line plus headers at most 16 KiB).
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 16 * 1024


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with a deadline for each request's headers (set by `server_config`)."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._headers_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_late(self) -> None:
        self._headers_timer = None
        if self.cycle is None or self.cycle.response_complete:  # still no (new) request
            if not self.transport.is_closing():
                self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the next request's headers are due within the deadline too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def server_config(app: Any, *, host: str, port: int, log_level: str = "info",
                  header_timeout_s: float = 10.0, keep_alive_s: float = 5.0,
                  max_connections: int | None = 1024) -> uvicorn.Config:
    """The uvicorn config serving `app` with the limits of the module docstring."""
    protocol = type("GuardedH11", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_keep_alive=keep_alive_s, limit_concurrency=max_connections,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES)
