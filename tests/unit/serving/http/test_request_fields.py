"""`priority`, `cache_salt` and the LoRA `adapter` reach the engine's `GenerationRequest` from
every dialect (OpenAI completions and chat, Triton generate and infer, Megatron /api), the
schemas document them, and the runtime LoRA routes are off unless the app allows them."""

from __future__ import annotations

import json

import pytest


def _sent(engine):
    (request,) = engine.started
    engine.started.clear()
    return request.priority, request.cache_salt, request.adapter


FIELDS = {"priority": -3, "cache_salt": "tenant-a"}


def test_priority_and_cache_salt_reach_the_engine_from_every_dialect(client, engine):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **FIELDS})
    assert r.status_code == 200, r.text
    assert _sent(engine) == (-3, "tenant-a", None)
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **FIELDS})
    assert r.status_code == 200, r.text
    assert _sent(engine) == (-3, "tenant-a", None)
    r = client.post("/v2/models/fake/generate", json={"text_input": "hi", "max_tokens": 1,
                                                      "parameters": FIELDS})
    assert r.status_code == 200, r.text
    assert _sent(engine) == (-3, "tenant-a", None)
    infer = {"inputs": [
        {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]},
        {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [1]},
        {"name": "priority", "shape": [1, 1], "datatype": "INT32", "data": [-3]},
        {"name": "cache_salt", "shape": [1, 1], "datatype": "BYTES", "data": ["tenant-a"]}]}
    r = client.post("/v2/models/fake/infer", content=json.dumps(infer))
    assert r.status_code == 200, r.text
    assert _sent(engine) == (-3, "tenant-a", None)
    r = client.put("/api", json={"prompts": ["hi"], "tokens_to_generate": 1, **FIELDS})
    assert r.status_code == 200, r.text
    assert _sent(engine) == (-3, "tenant-a", None)
    # The defaults: priority 0, no salt.
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert _sent(engine) == (0, None, None)


@pytest.mark.parametrize("body", [{"priority": "high"}, {"priority": 2**40},
                                  {"cache_salt": 7}, {"cache_salt": "x" * 300}])
def test_bad_priority_or_salt_is_a_400(client, body):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] in body


def test_the_schemas_document_the_fields(client):
    paths = client.get("/openapi.json").json()["paths"]

    def fields(path: str, method: str = "post") -> set[str]:
        body = paths[path][method]["requestBody"]["content"]["application/json"]["schema"]
        return set(body["properties"])

    for path, method in (("/v1/completions", "post"), ("/v1/chat/completions", "post"),
                         ("/v2/models/{model}/generate", "post"), ("/api", "put")):
        assert {"priority", "cache_salt"} <= fields(path, method), path
    assert "adapter" in fields("/v2/models/{model}/generate") & fields("/api", "put")
    assert {"lora_name", "lora_path"} <= fields("/v1/load_lora_adapter")


def test_runtime_lora_routes_are_off_by_default_and_name_the_flag(client):
    for route, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp"}),
                        ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        r = client.post(route, json=body)
        assert r.status_code == 403 and "--allow-runtime-lora" in r.json()["error"]["message"]


def test_an_engine_without_adapters_answers_404_for_one(client):
    r = client.post("/v1/completions", json={"model": "fake:nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.put("/api", json={"prompts": ["hi"], "adapter": "nope"})
    assert r.status_code == 404
    r = client.post("/v2/models/fake/generate", json={"text_input": "hi", "adapter": "nope"})
    assert r.status_code == 404
