"""`tessera.clients.Client` / `AsyncClient` against the in-process app, and their retry policy."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tessera.clients import AsyncClient, Client, TesseraError
from tessera.clients.client import retry_delay
from tessera.serving.http.app import create_app
from tessera.serving.http.schemas import CompletionResponse

from .fake_engine import FakeEngine


def test_client_generate_stream_models_tasks_and_chat(make_client):
    http = make_client(api_key="k")
    with Client("http://testserver", api_key="k", http_client=http) as client:
        assert client.health()
        assert [m.id for m in client.models()] == ["fake", "fake:qa", "fake:sentiment"]
        assert client.tasks() == ["qa", "sentiment"]
        answer = client.generate("abc", max_tokens=4)
        assert isinstance(answer, CompletionResponse) and answer.text == "cbac"
        assert answer.usage.completion_tokens == 4
        chunks = list(client.stream("abc", max_tokens=4, task="qa"))
        assert "".join(c.text for c in chunks) == "[qa]" and chunks[-1].usage.total_tokens == 8
        assert client.chat([{"role": "user", "content": "x"}], max_tokens=3).text == ":tn"
        assert "".join(c.text for c in client.chat_stream([{"role": "user", "content": "x"}],
                                                           max_tokens=3)) == ":tn"
        with pytest.raises(TesseraError) as err:
            client.generate("abc", max_tokens=-1)
        assert err.value.status == 400 and "max_tokens" in err.value.message
        with pytest.raises(TesseraError, match="injected failure"):
            list(client.stream("FAIL", max_tokens=5))
    with pytest.raises(TesseraError) as err:
        Client("http://testserver", http_client=http).models()
    assert err.value.status == 401 and err.value.type == "authentication_error"


def test_async_client():
    app = create_app(FakeEngine(), model_name="fake")

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        async with AsyncClient("http://t", http_client=http) as client:
            assert await client.tasks() == ["qa", "sentiment"]
            answers = await asyncio.gather(*[client.generate("ab", max_tokens=3) for _ in range(4)])
            assert [a.text for a in answers] == ["bab"] * 4
            text = "".join([c.text async for c in client.stream("ab", max_tokens=3, task="qa")])
            assert text == "[qa"
            chat = await client.chat([{"role": "user", "content": "x"}], max_tokens=2)
            assert chat.text == ":t"
        await http.aclose()

    asyncio.run(main())


def test_retries_429_and_503_honoring_retry_after(monkeypatch):
    answers = iter([httpx.Response(429, headers={"Retry-After": "2"}, json={"error": "busy"}),
                    httpx.Response(503, json={"error": "busy"}),
                    httpx.Response(200, json={"data": [{"id": "m"}]})])
    slept: list[float] = []
    monkeypatch.setattr("tessera.clients.client.time.sleep", slept.append)
    transport = httpx.MockTransport(lambda request: next(answers))
    client = Client("http://x", http_client=httpx.Client(transport=transport, base_url="http://x"),
                    backoff_s=0.1)
    assert [m.id for m in client.models()] == ["m"]
    assert slept[0] >= 2.0 and 0.15 <= slept[1] <= 0.25  # Retry-After, then 0.1 * 2**1 jittered

    always_busy = httpx.MockTransport(lambda request: httpx.Response(429, json={"error": "busy"}))
    client = Client("http://x", http_client=httpx.Client(transport=always_busy, base_url="http://x"),
                    max_retries=2)
    with pytest.raises(TesseraError) as err:
        client.models()
    assert err.value.status == 429 and len(slept) == 4


def test_retry_delay_grows_and_is_capped():
    delays = [retry_delay(a, None, 0.5, max_backoff_s=4) for a in range(6)]
    assert delays[0] < delays[2] < delays[3] and max(delays) <= 4 * 1.2
    response = httpx.Response(429, headers={"Retry-After": "7"})
    assert retry_delay(0, response, 0.5) >= 7


def test_error_bodies_of_both_shapes_become_tessera_errors():
    for body, message in ((json.dumps({"error": {"message": "m1", "type": "t"}}), "m1"),
                          (json.dumps({"error": "m2"}), "m2"), ("plain", "plain")):
        transport = httpx.MockTransport(lambda request, b=body: httpx.Response(400, content=b))
        client = Client("http://x", http_client=httpx.Client(transport=transport, base_url="http://x"))
        with pytest.raises(TesseraError, match=message):
            client.models()
