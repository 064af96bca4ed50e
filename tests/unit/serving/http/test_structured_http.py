"""Structured outputs through every dialect over the real engine (llama-tiny, a tiny
sentencepiece tokenizer): OpenAI's `response_format`, vLLM's `guided_*` and
`structured_outputs`, Triton's and Megatron's `structured_outputs` field; bad constraints and a
server without xgrammar answer 400 with the reason.

References: `jsonschema` and Python's `re`."""

from __future__ import annotations

import json
import re
import sys

import pytest
from fastapi.testclient import TestClient

from tessera.core import ModelConfig, build_model
from tessera.serving.engine import LLMEngine
from tessera.serving.http.app import create_app
from tests.serving_helper import train_tiny_tokenizer

from ..conftest import sse_json

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0,
                                                        "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
CHAT = {"messages": [{"role": "user", "content": "Describe someone in JSON."}],
        "max_tokens": 120}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tokenizer = train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    model = build_model(ModelConfig.from_name("llama-tiny", init_std=0.3, vocab_size=512),
                        seed=0).eval()
    with LLMEngine(model, tokenizer, max_batch=4, seed=0) as engine:
        with TestClient(create_app(engine, model_name="tiny")) as c:
            yield c


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
    {"guided_json": SCHEMA},
    {"guided_json": json.dumps(SCHEMA)},
    {"structured_outputs": {"json": SCHEMA}},
])
def test_json_schema_in_every_openai_spelling(client, constraint):
    for temperature in (0, 1.0):
        body = _ok(client.post("/v1/chat/completions",
                               json={**CHAT, **constraint, "temperature": temperature, "seed": 1}))
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_streamed_constrained_chat_is_the_same_json(client):
    body = {**CHAT, "guided_json": SCHEMA, "temperature": 0}
    whole = _ok(client.post("/v1/chat/completions", json=body))["choices"][0]["message"]
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_json(r.text)
                   if c["choices"])
    assert text == whole["content"]


def test_completions_regex_and_choice(client):
    body = _ok(client.post("/v1/completions", json={
        "prompt": "Code:", "max_tokens": 20, "n": 3, "temperature": 1.0, "seed": 2,
        "guided_regex": "[A-Z]{3}-[0-9]{2}"}))
    for c in body["choices"]:
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", c["text"]) and c["finish_reason"] == "stop"
    body = _ok(client.post("/v1/completions", json={
        "prompt": "Pick:", "max_tokens": 20, "temperature": 0,
        "structured_outputs": {"choice": ["red", "green"]}}))
    assert body["choices"][0]["text"] in ("red", "green")


def test_triton_and_megatron_take_structured_outputs(client):
    so = {"regex": "[0-9]{4}"}
    r = _ok(client.post("/v2/models/tiny/generate", json={
        "text_input": "Year:", "max_tokens": 10, "temperature": 0, "structured_outputs": so}))
    assert re.fullmatch(r"[0-9]{4}", r["text_output"].removeprefix("Year:")), r
    infer = _ok(client.post("/v2/models/tiny/infer", json={"inputs": [
        {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["Year:"]},
        {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [10]},
        {"name": "temperature", "shape": [1, 1], "datatype": "FP32", "data": [0.0]},
        {"name": "structured_outputs", "shape": [1, 1], "datatype": "BYTES",
         "data": [json.dumps(so)]}]}))
    (out,) = [o for o in infer["outputs"] if o["name"] == "text_output"]
    assert re.fullmatch(r"[0-9]{4}", out["data"][0].removeprefix("Year:")), out
    api = client.put("/api", json={"prompts": ["Year:"], "tokens_to_generate": 10,
                                   "temperature": 0, "structured_outputs": so})
    assert api.status_code == 200, api.text
    assert re.fullmatch(r"[0-9]{4}", api.json()["text"][0].removeprefix("Year:")), api.json()


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/chat/completions", {**CHAT, "guided_json": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}, "invalid json schema constraint"),
    ("/v1/chat/completions", {**CHAT, "guided_regex": "[a-"}, "invalid regex"),
    ("/v1/chat/completions", {**CHAT, "guided_json": "{not json"}, "guided_json is not valid"),
    ("/v1/chat/completions", {**CHAT, "guided_regex": "a", "guided_choice": ["b"]},
     "constrains its output twice"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "sets regex and choice"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]}, "no tool-call format"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice needs tools"),
    ("/v2/models/tiny/generate", {"text_input": "x", "structured_outputs": "{bad"},
     "not a structured_outputs object"),
])
def test_bad_constraints_are_400_with_the_reason(client, path, body, needle):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.text


def test_without_xgrammar_the_server_runs_and_refuses_with_the_install_command(
        client, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now fails
    r = client.post("/v1/chat/completions", json={**CHAT, "guided_regex": "[0-9]+"})
    assert r.status_code == 400
    assert "pip install 'tessera[structured]'" in r.json()["error"]["message"]
    _ok(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}))
