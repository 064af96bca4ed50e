"""Defects a new user hit, each pinned by the request that showed it (fake engine)."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from ..conftest import sse_json


def _metric(client, needle: str) -> float:
    lines = [line for line in client.get("/metrics").text.splitlines()
             if needle in line and "_total" in line and not line.startswith("#")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_tensorrt_llm_generate_bodies_are_accepted(client, engine):
    # The body from TensorRT-LLM's docs, and the other forms its clients send.
    for body in ({"text_input": "What is ML?", "max_tokens": 20, "bad_words": "", "stop_words": ""},
                 {"text_input": "abc", "max_tokens": 4, "bad_words": [""], "stop_words": ["", "b"],
                  "end_id": 2, "pad_id": 2, "length_penalty": 1.0, "num_return_sequences": 1,
                  "return_context_logits": False, "embedding_bias_words": []}):
        r = client.post("/v2/models/ensemble/generate", json=body)
        assert r.status_code == 200, r.text
    assert engine.started[-1].params.stop == ["b"]
    assert engine.started[-1].params.stop_token_ids == [2]  # end_id stops generation
    r = client.post("/v2/models/ensemble/generate", json={"text_input": "a", "bad_words": ["x"]})
    assert r.status_code == 400 and "bad_words is not supported" in r.json()["error"]


def test_response_format_json_is_refused_not_ignored(client):
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
        for path, body in (("/v1/completions", {"prompt": "abc"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = client.post(path, json={**body, "response_format": fmt})
            assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "abc", "response_format": {"type": "text"}})
    assert r.status_code == 200


def test_whole_number_floats_are_integers(client, engine):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 16.0, "n": 1.0,
                                             "seed": 3.0, "temperature": 1})
    assert r.status_code == 200, r.text
    assert engine.started[-1].params.max_tokens == 16 and engine.started[-1].params.seed == 3
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 16.5})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = client.put("/api", json={"prompts": ["ab"], "tokens_to_generate": 2.0})
    assert r.status_code == 200


@pytest.mark.parametrize("encoding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_json_bodies_are_decoded_on_every_route(client, encoding, compress):
    headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
    for method, path, body in (("post", "/v1/completions", {"prompt": "abc", "max_tokens": 2}),
                               ("put", "/api", {"prompts": ["ab"], "tokens_to_generate": 2}),
                               ("post", "/v2/models/fake/generate", {"text_input": "ab", "max_tokens": 2})):
        r = client.request(method.upper(), path, content=compress(json.dumps(body).encode()),
                           headers=headers)
        assert r.status_code == 200, (path, r.text)
    r = client.post("/v1/completions", content=b"{}", headers={"Content-Encoding": "br"})
    assert r.status_code == 415


def test_lone_surrogates_are_reported_where_they_are(client):
    raw = '{"prompt": "ab\\ud800cd", "max_tokens": 2}'
    r = client.post("/v1/completions", content=raw)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "surrogate" in message and "column 15" in message, message
    # An escaped backslash is not an escape; a proper pair is fine; the lone one is later.
    raw = '{"prompt": "x\\\\ud800 \\ud83d\\ude00 \\udc00"}'
    assert "column 35" in client.post("/v1/completions", content=raw).json()["error"]["message"]
    r = client.put("/api", content='{"prompts": ["a\\udc00"]}')
    assert r.status_code == 400 and "column 16" in r.json()["error"]


def test_a_refused_request_counts_once(client):
    before = _metric(client, 'status="invalid"')
    r = client.post("/v1/completions", json={"prompt": ["abc"] * 1000, "n": 16, "max_tokens": 2})
    assert r.status_code == 400
    r = client.post("/v1/completions", json={"prompt": ["abc"] * 3, "n": 2, "max_tokens": 10**6})
    assert r.status_code == 400
    assert _metric(client, 'status="invalid"') - before == 2


def test_logprobs_zero_gives_the_chosen_token_never_null(client):
    choice = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3,
                                                  "logprobs": 0}).json()["choices"][0]
    tops = choice["logprobs"]["top_logprobs"]
    assert tops == [{t: lp} for t, lp in zip(choice["logprobs"]["tokens"],
                                             choice["logprobs"]["token_logprobs"])]


def test_requests_are_counted_per_served_model(client):
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "model": "fake:qa"})
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "n": 2})
    assert _metric(client, 'served_model="fake:qa"') == 1
    assert _metric(client, 'served_model="fake"}') == 2


def test_stream_logprobs_tokens_match_the_streamed_text(client):
    body = {"prompt": "abc", "max_tokens": 5, "logprobs": 1, "stream": True, "echo": True}
    chunks = [c["choices"][0] for c in sse_json(client.post("/v1/completions", json=body).text)]
    text = "".join(c["text"] for c in chunks)
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert "".join(tokens) == text == "abc" + "cbacb"


def test_served_model_names_default_to_the_readmes_and_take_aliases(make_client):
    from tessera.serving.cli import build_parser, served_names

    parse = build_parser().parse_args
    assert served_names(parse(["--checkpoint", "runs/x/step-00000300"])) == ["tessera", "step-00000300"]
    assert served_names(parse(["--checkpoint", "c", "--served-model-name", "a", "b"])) == ["a", "b"]
    assert served_names(parse(["--checkpoint", "c", "--model-name", "old"])) == ["old"]
    client = make_client(model_aliases=("step-00000300",))
    for model in ("fake", "step-00000300", "step-00000300:qa"):
        r = client.post("/v1/completions", json={"model": model, "prompt": "ab", "max_tokens": 1})
        assert r.status_code == 200, (model, r.text)
    assert client.post("/v2/models/step-00000300/generate", json={"text_input": "a"}).status_code == 200
    assert client.post("/v1/completions", json={"model": "other", "prompt": "ab"}).status_code == 404
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fake", "fake:qa",
                                                                         "fake:sentiment"]
