"""Python client for a Tessera server: `Client` (sync) and `AsyncClient`, over httpx.

    from tessera.clients import Client

    with Client("http://127.0.0.1:8000", api_key="secret") as client:
        print(client.generate("The cat", max_tokens=20).text)
        for chunk in client.stream("The cat", max_tokens=20, task="qa"):
            print(chunk.text, end="", flush=True)

It speaks the server's OpenAI routes and returns the typed bodies of `tessera.serving.http.schemas`
(the only server module it imports). `task="qa"` selects the prompt-tuned task by asking for the
model `BASE:qa`. A 429 or 503 (server busy) is retried with exponential backoff, waiting at
least as long as the server's `Retry-After` asks; other errors raise `TesseraError` with the
server's message.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from tessera.serving.http.schemas import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
)

RETRY_STATUSES = frozenset({429, 503})
T = TypeVar("T", bound=BaseModel)


class TesseraError(Exception):
    """The server refused or failed a request. `status` is the HTTP status (0: mid-stream)."""

    def __init__(self, status: int, message: str, type: str | None = None) -> None:
        super().__init__(f"{status} {message}" if status else message)
        self.status, self.message, self.type = status, message, type


def _error_of(status: int, body: bytes) -> TesseraError:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return TesseraError(status, body.decode("utf-8", "replace")[:500] or "no message")
    if isinstance(error, dict):  # OpenAI shape
        return TesseraError(status, str(error.get("message")), error.get("type"))
    return TesseraError(status, str(error))


def retry_delay(attempt: int, response: httpx.Response | None, backoff_s: float,
                max_backoff_s: float = 30.0) -> float:
    """Seconds to wait before retry `attempt` (0-based): exponential, jittered, >= Retry-After."""
    delay = min(backoff_s * 2 ** attempt, max_backoff_s) * random.uniform(0.8, 1.2)
    header = response.headers.get("retry-after") if response is not None else None
    if header:
        try:
            asked = float(header)
        except ValueError:
            try:
                asked = parsedate_to_datetime(header).timestamp() - time.time()
            except (TypeError, ValueError):
                asked = 0.0
        delay = max(delay, min(asked, max_backoff_s))
    return max(delay, 0.0)


def _body(prompt: Any, model: str, stream: bool, **params: Any) -> dict[str, Any]:
    body = {k: v for k, v in params.items() if v is not None}
    body.update(model=model, stream=stream)
    if prompt is not None:
        body["prompt"] = prompt
    if stream:
        body.setdefault("stream_options", {"include_usage": True})
    return body


def _chunks(lines: Iterable[str], kind: type[T]) -> Iterator[T]:
    for line in lines:
        chunk = _parse_event(line, kind)
        if chunk is _DONE:
            return
        if chunk is not None:
            yield chunk


_DONE = object()


def _parse_event(line: str, kind: type[T]) -> Any:
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    event = json.loads(data)
    if "error" in event:
        raise _error_of(0, json.dumps(event).encode())
    return kind.model_validate(event)


class _Base:
    def __init__(self, url: str, api_key: str | None, model: str | None, max_retries: int,
                 backoff_s: float) -> None:
        self.url = url if "://" in url else f"http://{url}"
        self.model, self.max_retries, self.backoff_s = model, max_retries, backoff_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _model_name(self, base: str, model: str | None, task: str | None) -> str:
        name = model or self.model or base
        return f"{name.partition(':')[0]}:{task}" if task else name


class Client(_Base):
    """Synchronous client. `http_client` replaces the internal `httpx.Client` (tests)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 model: str | None = None, timeout: float = 600.0, max_retries: int = 4,
                 backoff_s: float = 0.5, http_client: httpx.Client | None = None) -> None:
        super().__init__(url, api_key, model, max_retries, backoff_s)
        self._http = http_client or httpx.Client(base_url=self.url, timeout=timeout)
        self._owns_http = http_client is None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def _send(self, method: str, path: str, body: dict | None = None,
              stream: bool = False) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            request = self._http.build_request(method, path, json=body, headers=self.headers)
            try:
                response = self._http.send(request, stream=stream)
            except httpx.ConnectError:
                if attempt == self.max_retries:
                    raise
                time.sleep(retry_delay(attempt, None, self.backoff_s))
                continue
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                response.close()
                time.sleep(retry_delay(attempt, response, self.backoff_s))
                continue
            if response.status_code >= 400:
                error = _error_of(response.status_code, response.read())
                response.close()
                raise error
            return response
        raise AssertionError("unreachable")

    def health(self) -> bool:
        """True when the server answers /health with 200."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def models(self) -> list[ModelCard]:
        return ModelList.model_validate(self._send("GET", "/v1/models").json()).data

    def tasks(self) -> list[str]:
        """The prompt-tuned tasks the server offers (pass one as `task=`)."""
        return [m.task for m in self.models() if m.task]

    def _base(self) -> str:
        if self.model is None:
            self.model = self.models()[0].id
        return self.model

    def generate(self, prompt: str | list[int], *, model: str | None = None,
                 task: str | None = None, max_tokens: int = 64, **params: Any) -> CompletionResponse:
        """One completion (`params`: temperature, top_p, top_k, seed, stop, n, logprobs, ...)."""
        name = self._model_name(self._base(), model, task)
        body = _body(prompt, name, False, max_tokens=max_tokens, **params)
        return CompletionResponse.model_validate(self._send("POST", "/v1/completions", body).json())

    def stream(self, prompt: str | list[int], *, model: str | None = None,
               task: str | None = None, max_tokens: int = 64, **params: Any) -> Iterator[CompletionResponse]:
        """Completion chunks as the server produces them; the last one carries `usage`."""
        name = self._model_name(self._base(), model, task)
        body = _body(prompt, name, True, max_tokens=max_tokens, **params)
        response = self._send("POST", "/v1/completions", body, stream=True)
        try:
            yield from _chunks(response.iter_lines(), CompletionResponse)
        finally:
            response.close()

    def chat(self, messages: list[dict[str, Any]], *, model: str | None = None,
             task: str | None = None, **params: Any) -> ChatCompletionResponse:
        name = self._model_name(self._base(), model, task)
        body = _body(None, name, False, messages=messages, **params)
        return ChatCompletionResponse.model_validate(
            self._send("POST", "/v1/chat/completions", body).json())

    def chat_stream(self, messages: list[dict[str, Any]], *, model: str | None = None,
                    task: str | None = None, **params: Any) -> Iterator[ChatCompletionChunk]:
        name = self._model_name(self._base(), model, task)
        body = _body(None, name, True, messages=messages, **params)
        response = self._send("POST", "/v1/chat/completions", body, stream=True)
        try:
            yield from _chunks(response.iter_lines(), ChatCompletionChunk)
        finally:
            response.close()


class AsyncClient(_Base):
    """The asyncio twin of `Client`; `stream` and `chat_stream` are async iterators."""

    def __init__(self, url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 model: str | None = None, timeout: float = 600.0, max_retries: int = 4,
                 backoff_s: float = 0.5, http_client: httpx.AsyncClient | None = None) -> None:
        super().__init__(url, api_key, model, max_retries, backoff_s)
        self._http = http_client or httpx.AsyncClient(base_url=self.url, timeout=timeout)
        self._owns_http = http_client is None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def _send(self, method: str, path: str, body: dict | None = None,
                    stream: bool = False) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            request = self._http.build_request(method, path, json=body, headers=self.headers)
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.ConnectError:
                if attempt == self.max_retries:
                    raise
                await asyncio.sleep(retry_delay(attempt, None, self.backoff_s))
                continue
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                await response.aclose()
                await asyncio.sleep(retry_delay(attempt, response, self.backoff_s))
                continue
            if response.status_code >= 400:
                error = _error_of(response.status_code, await response.aread())
                await response.aclose()
                raise error
            return response
        raise AssertionError("unreachable")

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def models(self) -> list[ModelCard]:
        return ModelList.model_validate((await self._send("GET", "/v1/models")).json()).data

    async def tasks(self) -> list[str]:
        return [m.task for m in await self.models() if m.task]

    async def _base(self) -> str:
        if self.model is None:
            self.model = (await self.models())[0].id
        return self.model

    async def generate(self, prompt: str | list[int], *, model: str | None = None,
                       task: str | None = None, max_tokens: int = 64,
                       **params: Any) -> CompletionResponse:
        name = self._model_name(await self._base(), model, task)
        body = _body(prompt, name, False, max_tokens=max_tokens, **params)
        response = await self._send("POST", "/v1/completions", body)
        return CompletionResponse.model_validate(response.json())

    async def stream(self, prompt: str | list[int], *, model: str | None = None,
                     task: str | None = None, max_tokens: int = 64,
                     **params: Any) -> AsyncIterator[CompletionResponse]:
        name = self._model_name(await self._base(), model, task)
        body = _body(prompt, name, True, max_tokens=max_tokens, **params)
        async for chunk in self._stream("/v1/completions", body, CompletionResponse):
            yield chunk

    async def chat(self, messages: list[dict[str, Any]], *, model: str | None = None,
                   task: str | None = None, **params: Any) -> ChatCompletionResponse:
        name = self._model_name(await self._base(), model, task)
        body = _body(None, name, False, messages=messages, **params)
        response = await self._send("POST", "/v1/chat/completions", body)
        return ChatCompletionResponse.model_validate(response.json())

    async def chat_stream(self, messages: list[dict[str, Any]], *, model: str | None = None,
                          task: str | None = None, **params: Any) -> AsyncIterator[ChatCompletionChunk]:
        name = self._model_name(await self._base(), model, task)
        body = _body(None, name, True, messages=messages, **params)
        async for chunk in self._stream("/v1/chat/completions", body, ChatCompletionChunk):
            yield chunk

    async def _stream(self, path: str, body: dict, kind: type[T]) -> AsyncIterator[T]:
        response = await self._send("POST", path, body, stream=True)
        try:
            async for line in response.aiter_lines():
                chunk = _parse_event(line, kind)
                if chunk is _DONE:
                    return
                if chunk is not None:
                    yield chunk
        finally:
            await response.aclose()
