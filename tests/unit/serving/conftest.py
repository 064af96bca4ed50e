"""In-process app fixtures: the app over a `FakeEngine`, driven by Starlette's TestClient."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from tessera.serving.http.app import create_app

from .fake_engine import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def make_client(engine: FakeEngine) -> Iterator[Callable[..., TestClient]]:
    """make_client(**create_app kwargs, engine=...) -> a TestClient on a new app."""
    clients: list[TestClient] = []

    def make(engine_: FakeEngine | None = None, **kwargs) -> TestClient:
        client = TestClient(create_app(engine_ or engine, model_name="fake", **kwargs))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def client(make_client) -> TestClient:
    return make_client()


def sse_data(text: str) -> list[str]:
    """The `data:` payloads of a server-sent-events body, in order."""
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def sse_json(text: str) -> list[dict]:
    return [json.loads(d) for d in sse_data(text) if d != "[DONE]"]
