"""API key, body and prompt limits, admission (429/503), malformed input, metrics, docs."""

from __future__ import annotations

import asyncio
import gzip
import json

import httpx
import pytest

from tessera.serving.http.app import create_app

from ..fake_engine import FakeEngine

KEY = {"Authorization": "Bearer s3cret"}


def test_api_key_is_enforced_everywhere_but_health(make_client):
    client = make_client(api_key="s3cret")
    for path in ("/health", "/v2/health/live", "/v2/health/ready"):
        assert client.get(path).status_code == 200, path
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v2"),
                         ("GET", "/v2/models/fake"), ("POST", "/v2/models/fake/infer"),
                         ("PUT", "/api"), ("GET", "/metrics"), ("GET", "/docs"),
                         ("GET", "/openapi.json")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = client.request(method, path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.headers["www-authenticate"] == "Bearer"
    r = client.get("/v1/models")
    assert r.json()["error"]["type"] == "authentication_error"
    assert isinstance(client.get("/v2").json()["error"], str)
    assert client.get("/v1/models", headers=KEY).status_code == 200
    r = client.post("/v1/completions", headers=KEY, json={"prompt": "ab", "max_tokens": 1})
    assert r.status_code == 200


def test_body_size_limit_declared_chunked_and_decompressed(make_client):
    client = make_client(max_body_bytes=200)
    r = client.post("/v1/completions", json={"prompt": "a" * 300})
    assert r.status_code == 413 and "limit of 200 bytes" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=iter([b'{"prompt": "', b"a" * 300, b'"}']))
    assert r.status_code == 413
    bomb = gzip.compress(json.dumps({"inputs": [{"name": "text_input", "datatype": "BYTES",
                                                 "shape": [1], "data": ["a" * 5000]}]}).encode())
    assert len(bomb) < 200
    r = client.post("/v2/models/fake/infer", content=bomb, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413 and "decompressed" in r.json()["error"]


def test_prompt_token_limit(make_client):
    client = make_client(max_prompt_tokens=4)
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1}).status_code == 200
    r = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
    r = client.put("/api", json={"prompts": ["abcd"], "tokens_to_generate": 1})
    assert r.status_code == 400 and "at most 4" in r.json()["error"]


@pytest.mark.parametrize("content, fragment", [
    (b'{"prompt": "ab", "max_tokens": 2', "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b"", "empty"),
    (b'["prompt"]', "JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"max_tokens": 2}', "prompt: Field required"),
    (b'{"prompt": 5}', "prompt must be"),
    (b'{"prompt": [1, "a"]}', "prompt must be"),
    (b'{"prompt": []}', "empty list"),
    (b'{"prompt": "ab", "max_tokens": "2"}', "max_tokens"),
    (b'{"prompt": "ab", "max_tokens": -1}', "greater than or equal to 0"),
    (b'{"prompt": "ab", "max_tokens": 100000000000}', "at most 253"),
    (b'{"prompt": "ab", "temperature": true}', "temperature"),
    (b'{"prompt": "ab", "n": 0}', "n:"),
    (b'{"prompt": "ab", "n": 100}', "n:"),
    (b'{"prompt": "ab", "logit_bias": {"1": 2}}', "logit_bias"),
    (b'{"prompt": "ab", "stream_options": {"include_usage": "yes"}}', "include_usage"),
    (b'{"prompt": "", "max_tokens": 1}', None),  # BOS alone is a valid prompt
])
def test_malformed_requests_are_4xx_never_5xx(client, content, fragment):
    r = client.post("/v1/completions", content=content)
    if fragment is None:
        assert r.status_code == 200
        return
    assert 400 <= r.status_code < 500, r.text
    assert fragment in r.json()["error"]["message"], r.text


def test_unknown_routes_and_methods_answer_in_the_dialect_of_the_path(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    r = client.get("/v1/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


async def _burst(app, n: int, prompt: str = "SLOW", path: str = "/v1/completions") -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        return await asyncio.gather(*[http.post(path, json={"prompt": prompt, "max_tokens": 2})
                                      for _ in range(n)])


def test_admission_limit_answers_429_with_retry_after():
    engine = FakeEngine()
    app = create_app(engine, model_name="fake", max_concurrency=2)
    responses = asyncio.run(_burst(app, 5))
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 429, 429, 429]
    busy = next(r for r in responses if r.status_code == 429)
    assert busy.headers["retry-after"] == "1" and busy.json()["error"]["code"] == "overloaded"
    assert len(engine.started) == 2  # the rejected ones did no work
    n_too_big = asyncio.run(_burst(app, 1, path="/v1/completions"))  # slots are free again
    assert n_too_big[0].status_code == 200


def test_engine_overloaded_answers_503_with_retry_after(make_client):
    client = make_client(FakeEngine(capacity=0))
    r = client.post("/v1/completions", json={"prompt": "ab"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    r = client.post("/v2/models/fake/generate", json={"text_input": "ab"})
    assert r.status_code == 503 and "overloaded" in r.json()["error"]


def test_metrics_count_requests_tokens_and_latency(make_client):
    client, other = make_client(), make_client()
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": -3})
    client.put("/api", json={"prompts": ["FAIL"], "tokens_to_generate": 5})
    text = client.get("/metrics").text
    for line in ('tessera:num_requests_running{model_name="fake"} 0.0',
                 'tessera:kv_cache_usage_perc{model_name="fake"} 0.0',
                 'tessera:engine_steps_total{model_name="fake"} 7.0',
                 'tessera:requests_total{dialect="openai",model_name="fake",status="length"} 1.0',
                 'tessera:requests_total{dialect="megatron",model_name="fake",status="error"} 1.0',
                 'tessera:prompt_tokens_total{model_name="fake"} 9.0',
                 'tessera:generation_tokens_total{model_name="fake"} 5.0',
                 'tessera:time_to_first_token_seconds_count{model_name="fake"} 2.0',
                 'tessera:inter_token_latency_seconds_count{model_name="fake"} 3.0',
                 'tessera:e2e_request_latency_seconds_count{model_name="fake"} 2.0'):
        assert line in text, line
    # each app has its own registry
    assert 'status="length"' not in other.get("/metrics").text


def test_docs_and_openapi_document_the_bodies(client):
    assert client.get("/docs").status_code == 200
    schema = client.get("/openapi.json").json()
    assert {"ChatMessage", "StreamOptions", "CompletionResponse"} <= set(schema["components"]["schemas"])
    for path, method, title in [("/v1/completions", "post", "CompletionRequest"),
                                ("/api", "put", "MegatronRequest"),
                                ("/v2/models/{model}/generate", "post", "TritonInputs")]:
        body = schema["paths"][path][method]["requestBody"]["content"]["application/json"]
        assert body["schema"]["title"] == title


def test_a_bad_chat_template_fails_at_startup():
    with pytest.raises(ValueError, match="chat template is not valid Jinja"):
        create_app(FakeEngine(), model_name="fake", chat_template="{% for %}")


class _ShuttingDown(FakeEngine):
    """Every request ends as the real engine ends them when it stops: aborted, with a message."""

    async def _run(self, request):
        from tessera.serving.types import GenerationOutput

        self.active.discard(request.request_id)
        yield GenerationOutput(request.request_id, [], "", finished=True, finish_reason="abort",
                               error="the server is shutting down")


def test_an_engine_abort_is_a_503_in_every_dialect(make_client):
    client = make_client(_ShuttingDown())
    r = client.post("/v1/completions", json={"prompt": "ab"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down"
    assert client.put("/api", json={"prompts": ["ab"]}).status_code == 503
    r = client.post("/v2/models/fake/generate", json={"text_input": "ab"})
    assert r.status_code == 503 and r.json() == {"error": "the server is shutting down"}


def test_health_follows_the_engine(make_client):
    engine = FakeEngine()
    client = make_client(engine)
    assert client.get("/health").status_code == 200
    engine.alive = False
    assert client.get("/health").status_code == 503
    assert client.get("/v2/health/ready").status_code == 503
    assert client.get("/v2/health/live").status_code == 200
