"""A malformed body is a 4xx on every route, never a 5xx.

For every operation in `/openapi.json` that takes a body: the top level replaced by each JSON
non-object (and by bytes that are not JSON), and every field, at every depth of a valid example
body plus every property the document lists at the top level, replaced by each JSON type in
turn. The answer must be below 500 (a 4xx for what is wrong, or a 200 where the value is one the
field happens to accept). The `/versions/{version}/` twins run the same handlers and are left out.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tessera.serving.http.app import create_app

from ..fake_engine import FakeEngine

# A valid body per operation; every path without one here gets a plain object.
EXAMPLES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "fake", "prompt": "hi", "max_tokens": 2, "logprobs": 1,
                        "echo": True, "stop": ["x"], "logit_bias": {"5": 1.0},
                        "stream_options": {"include_usage": True}},
    "/v1/chat/completions": {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2, "logprobs": True, "top_logprobs": 1,
                             "stream_options": {"include_usage": True}},
    "/v2/models/{model}/infer": {
        "id": "1", "parameters": {"priority": 0},
        "inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]},
                   {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [2]}],
        "outputs": [{"name": "text_output", "parameters": {"binary_data": False}}]},
    "/v2/models/{model}/generate": {"text_input": "hi", "max_tokens": 2,
                                    "parameters": {"temperature": 0}},
    "/v2/models/{model}/generate_stream": {"text_input": "hi", "max_tokens": 2,
                                           "parameters": {"temperature": 0}},
    "/v2/repository/index": {"ready": True},
    "/api": {"prompts": ["hi"], "tokens_to_generate": 2, "logprobs": True},
    "/tokenize": {"prompt": "hi", "add_special_tokens": True},
    "/detokenize": {"tokens": [5, 6]},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/nonexistent"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}
EXTRA = {"/tokenize": [{"messages": [{"role": "user", "content": "hi"}],
                        "add_generation_prompt": True}]}
WRONG: list[Any] = [None, True, -1, 2**70, 1.5, "x", "", [], [{}], {}, {"a": [1]}]
NOT_OBJECTS: list[Any] = [None, True, 0, 1.5, "x", [], [{}], [1, 2]]


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(FakeEngine(context=64), model_name="fake"),
                    raise_server_exceptions=False) as c:
        yield c


def _operations(client: TestClient) -> list[tuple[str, str, dict]]:
    """(method, path template, top-level body properties) of every operation with a body."""
    doc = client.get("/openapi.json").json()
    schemas = doc.get("components", {}).get("schemas", {})
    out = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody")
            if not body or "/versions/" in path:
                continue
            schema = body["content"]["application/json"]["schema"]
            if "$ref" in schema:
                schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
            out.append((method, path, schema.get("properties", {})))
    return out


def _leaf_paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key / index path into `value` (objects and arrays, at every depth)."""
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield prefix + (key,)
        yield from _leaf_paths(inner, prefix + (key,))


def _replaced(body: Any, path: tuple, new: Any) -> Any:
    out = copy.deepcopy(body)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return out


def _bodies(template: str, properties: dict) -> Iterator[Any]:
    examples = [EXAMPLES.get(template, {})] + EXTRA.get(template, [])
    for example in examples:
        for path in _leaf_paths(example):
            for wrong in WRONG:
                yield _replaced(example, path, wrong)
        for name in properties:
            for wrong in WRONG:
                yield {**example, name: wrong}
    yield from NOT_OBJECTS


def test_every_route_answers_a_wrongly_typed_body_with_a_4xx(client):
    operations = _operations(client)
    assert len(operations) >= 9, [p for _, p, _ in operations]
    failures, sent = [], 0
    for method, template, properties in operations:
        url = template.replace("{model}", "fake")
        for body in _bodies(template, properties):
            r = client.request(method.upper(), url, content=json.dumps(body),
                               headers={"Content-Type": "application/json"})
            sent += 1
            if r.status_code >= 500:
                failures.append((method, url, body, r.status_code, r.text[:200]))
        for raw in (b"", b"{", b"\xff\xfe", b"[1,"):
            r = client.request(method.upper(), url, content=raw)
            sent += 1
            if r.status_code >= 500:
                failures.append((method, url, raw, r.status_code, r.text[:200]))
    assert not failures, f"{len(failures)} of {sent} bodies answered 5xx, e.g. {failures[:5]}"


@pytest.mark.parametrize("name", [{}, [], ["text_output"], 5, None])
def test_triton_infer_with_an_output_name_that_is_not_a_string_is_a_400(client, name):
    body = {**EXAMPLES["/v2/models/{model}/infer"], "outputs": [{"name": name}]}
    r = client.post("/v2/models/fake/infer", json=body)
    assert r.status_code == 400, r.text
    assert "outputs" in r.json()["error"]
