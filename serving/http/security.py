"""The guard in front of every route: API key and request body size.

A plain ASGI middleware (not FastAPI's `BaseHTTPMiddleware`, which would hide the client's
disconnect from the handlers): it refuses a request before any route runs when

- an API key is configured and the `Authorization: Bearer KEY` header does not carry it (401),
  except on the health routes, which load balancers probe without credentials;
- the declared `Content-Length` exceeds the limit (413).

A body without a declared length (chunked) is counted as it arrives; `read_body` turns the
overflow into the same 413. A body that stops arriving (no chunk for `body_timeout_s`, the
slowloris pattern) ends the request with a 408 and closes the connection.
"""

from __future__ import annotations

import hmac

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.serving.http.errors import ApiError, error_response
from tessera.serving.http.triton_codec import decompress

OPEN_PATHS = ("/health", "/v2/health/live", "/v2/health/ready")


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 body_timeout_s: float | None = None) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            response = error_response(path, 401, "missing or wrong API key: send the header "
                                      "'Authorization: Bearer <key>'", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _too_large(path, self.max_body_bytes)(scope, receive, send)
            return
        await self.app(scope, _counting(receive, self.max_body_bytes, self.body_timeout_s), send)

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                  self.api_key.encode())


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _counting(receive: Receive, limit: int, timeout_s: float | None = None) -> Receive:
    """`receive` counting body bytes, and (until the body is complete) timing out each wait."""
    seen, complete = 0, False

    async def wrapped() -> Message:
        nonlocal seen, complete
        if complete or timeout_s is None:
            message = await receive()  # e.g. waiting for the disconnect: no deadline
        else:
            try:
                with anyio.fail_after(timeout_s):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout() from None
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            complete = not message.get("more_body", False)
            if seen > limit:
                raise BodyTooLarge()
        return message

    return wrapped


def _too_large(path: str, limit: int):
    return error_response(path, 413, f"request body exceeds the limit of {limit} bytes")


async def read_body(request: Request) -> bytes:
    """The request body, decoded from its `Content-Encoding` (gzip or deflate; others: 415);
    413 past the size limit (also once decompressed), 400 if the client hung up mid-body."""
    limit = request.app.state.service.limits.max_body_bytes
    try:
        raw = await request.body()
    except BodyTooLarge:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes") from None
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected before sending the whole body") from None
    except BodyTimeout:
        timeout = request.app.state.service.limits.body_timeout_s
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s",
                       headers={"Connection": "close"}) from None
    return decompress(raw, request.headers.get("content-encoding"), limit)
