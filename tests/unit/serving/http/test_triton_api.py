"""The KServe v2 / Triton dialect in process, with bodies encoded and decoded by tritonclient itself."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest
import tritonclient.http as tc

from ..conftest import sse_json


def tensor(name: str, value: np.ndarray, datatype: str, binary: bool = True) -> tc.InferInput:
    t = tc.InferInput(name, list(value.shape), datatype)
    t.set_data_from_numpy(value, binary_data=binary)
    return t


def text(*prompts: str) -> np.ndarray:
    return np.array([[p.encode()] for p in prompts], dtype=np.object_)


def infer(client, inputs, outputs=None, model="fake", headers=None, **kwargs):
    """POST an infer request built by tritonclient; return (status, InferResult or error body)."""
    body, json_size = tc.InferenceServerClient.generate_request_body(inputs, outputs, **kwargs)
    extra = {"Inference-Header-Content-Length": str(json_size)} if json_size is not None else {}
    r = client.post(f"/v2/models/{model}/infer", content=body, headers={**extra, **(headers or {})})
    if r.status_code != 200:
        return r.status_code, r.json()
    length = r.headers.get("inference-header-content-length")
    # httpx has already undone any Content-Encoding
    result = tc.InferenceServerClient.parse_response_body(
        r.content, header_length=int(length) if length else None)
    return 200, result


def test_metadata_health_config_and_index(client):
    assert client.get("/v2").json()["extensions"].count("generate") == 1
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/fake/ready",
                 "/v2/models/ensemble/versions/1/ready"):
        r = client.get(path)
        assert r.status_code == 200 and r.content == b"", path
    assert client.get("/v2/models/nope/ready").status_code == 400
    meta = client.get("/v2/models/ensemble").json()
    assert meta["name"] == "ensemble" and meta["versions"] == ["1"]
    assert {"name": "text_input", "datatype": "BYTES", "shape": [-1, 1]} in meta["inputs"]
    config = client.get("/v2/models/fake/versions/1/config").json()
    assert config["max_batch_size"] > 0
    assert {"name": "text_output", "data_type": "TYPE_STRING", "dims": [1]} in config["output"]
    index = client.post("/v2/repository/index").json()
    assert {"name": "fake", "version": "1", "state": "READY"} in index
    assert {e["name"] for e in index} == {"fake", "ensemble", "fake:qa", "fake:sentiment"}
    r = client.get("/v2/models/fake/versions/2")
    assert r.status_code == 404 and "no version '2'" in r.json()["error"]


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False, None])
def test_infer_json_and_binary_both_ways(client, binary_in, binary_out):
    inputs = [tensor("text_input", text("héllo ✓", "ab"), "BYTES", binary_in),
              tensor("max_tokens", np.array([[3], [5]], dtype=np.int32), "INT32", binary_in)]
    outputs = None if binary_out is None else [tc.InferRequestedOutput("text_output", binary_data=binary_out)]
    status, result = infer(client, inputs, outputs, request_id="req-7")
    assert status == 200, result
    got = result.as_numpy("text_output")
    assert got.shape == (2, 1)
    values = [v.decode() if isinstance(v, bytes) else v for v in got.ravel()]
    assert values == ["✓ o", "babab"]
    assert isinstance(got.ravel()[0], bytes) == (binary_out is not False)
    assert result.get_response()["id"] == "req-7"


def test_infer_gzip_both_ways_and_deflate(client):
    inputs = [tensor("text_input", text("abc"), "BYTES"),
              tensor("max_tokens", np.array([[2]], dtype=np.int32), "INT32")]
    body, json_size = tc.InferenceServerClient.generate_request_body(inputs)
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", __import__("zlib").compress(body))):
        r = client.post("/v2/models/fake/infer", content=packed, headers={
            "Inference-Header-Content-Length": str(json_size), "Content-Encoding": encoding,
            "Accept-Encoding": f"{encoding}, br"})
        assert r.status_code == 200 and r.headers["content-encoding"] == encoding
        # httpx already inflated the body; the header counts the uncompressed JSON
        result = tc.InferenceServerClient.parse_response_body(
            r.content, header_length=int(r.headers["inference-header-content-length"]))
        assert result.as_numpy("text_output").ravel()[0] == b"cb"


def test_infer_sampling_inputs_logprobs_and_tasks(client, engine):
    inputs = [tensor("text_input", text("ab"), "BYTES"),
              tensor("max_tokens", np.array([[2]], dtype=np.int32), "INT32"),
              tensor("temperature", np.array([[0.5]], dtype=np.float32), "FP32"),
              tensor("random_seed", np.array([[2**64 - 1]], dtype=np.uint64), "UINT64"),
              tensor("stop_words", np.array([[b"zz", b""]], dtype=np.object_), "BYTES"),
              tensor("return_log_probs", np.array([[True]]), "BOOL"),
              tensor("task", text("qa"), "BYTES")]
    status, result = infer(client, inputs)
    assert status == 200, result
    request = engine.started[-1]
    assert request.task == "qa" and request.params.stop == ["zz"] and request.params.temperature == 0.5
    assert request.params.seed == (2**64 - 1) % 2**63
    np.testing.assert_allclose(result.as_numpy("output_log_probs"), [[-0.1, -0.2]], rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("cum_log_probs"), [[-0.3]], rtol=1e-6)
    inputs = [tensor("text_input", text("ab"), "BYTES"),
              tensor("task_id", np.array([[1]], dtype=np.int32), "INT32")]
    assert infer(client, inputs)[0] == 200 and engine.started[-1].task == "sentiment"
    status, _ = infer(client, [tensor("text_input", text("ab"), "BYTES")], model="fake:qa")
    assert status == 200 and engine.started[-1].task == "qa"


def _raw(client, header: dict, blob: bytes = b"", model: str = "fake"):
    js = json.dumps(header).encode()
    headers = {"Inference-Header-Content-Length": str(len(js))} if blob else {}
    return client.post(f"/v2/models/{model}/infer", content=js + blob, headers=headers)


def _bytes_input(name, values, shape=None):
    blob = b"".join(struct.pack("<I", len(v)) + v for v in values)
    spec = {"name": name, "datatype": "BYTES", "shape": shape or [len(values), 1],
            "parameters": {"binary_data_size": len(blob)}}
    return spec, blob


TEXT = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["a"]}


def _int32(name: str, value: int) -> dict:
    return {"name": name, "datatype": "INT32", "shape": [1], "data": [value]}


@pytest.mark.parametrize("header, fragment", [
    ({"inputs": []}, "no 'text_input'"),
    ({"inputs": [{**TEXT, "datatype": "BF16", "data": [1]}]}, "datatype"),
    ({"inputs": [{**TEXT, "shape": [2, 1]}]}, "needs 2 elements"),
    ({"inputs": [{**TEXT, "data": [5]}]}, "must be strings"),
    ({"inputs": [{**TEXT, "shape": [-1]}]}, "non-negative"),
    ({"inputs": [TEXT, _int32("max_tokens", -3)]}, "max_tokens"),
    ({"inputs": [TEXT, _int32("max_tokns", 3)]}, "max_tokns"),
    ({"inputs": [TEXT, {**_int32("top_k", 1), "datatype": "FP32", "data": [1.5]}]}, "top_k"),
    ({"inputs": [TEXT], "outputs": [{"name": "logits"}]}, "unknown output"),
    ({"inputs": [TEXT, _int32("max_tokens", 10**6)]}, "context"),
    ({"inputs": "text"}, "'inputs' list"),
])
def test_infer_rejects_bad_requests_with_a_4xx_error_body(client, header, fragment):
    r = _raw(client, header)
    assert r.status_code == 400 and fragment in r.json()["error"], r.text


def test_infer_invalid_utf8_and_truncated_binary(client):
    spec, blob = _bytes_input("text_input", [b"\xff\xfe"])
    r = _raw(client, {"inputs": [spec]}, blob)
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]
    spec["parameters"]["binary_data_size"] = 99
    r = _raw(client, {"inputs": [spec]}, blob)
    assert r.status_code == 400 and "runs past" in r.json()["error"]
    r = client.post("/v2/models/fake/infer", content=b"{nope")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]


def test_unknown_model_is_a_404_error_body(client):
    r = _raw(client, {"inputs": []}, model="nope")
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]


def test_generate_parameters_at_top_level_or_nested(client, engine):
    r = client.post("/v2/models/ensemble/generate", json={"text_input": "abc", "max_tokens": 4})
    assert r.json() == {"model_name": "ensemble", "model_version": "1", "text_output": "cbac"}
    r = client.post("/v2/models/fake/generate", json={
        "text_input": "ab", "parameters": {"max_tokens": 2, "return_log_probs": True, "task": "qa"}})
    body = r.json()
    assert body["text_output"] == "[q" and body["output_log_probs"] == [-0.1, -0.2]
    assert body["cum_log_probs"] == pytest.approx(-0.3)
    r = client.post("/v2/models/fake/generate", json={"text_input": "ab", "stream": True})
    assert r.status_code == 400 and "generate_stream" in r.json()["error"]
    r = client.post("/v2/models/fake/generate", json={"text_input": "ab", "stop_words": "a"})
    assert r.json()["text_output"] == "b" and engine.started[-1].params.stop == ["a"]
    r = client.post("/v2/models/fake/generate", json={"text_input": "ab", "max_tokens": "4"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]


def test_generate_stream_events_and_errors(client):
    r = client.post("/v2/models/ensemble/generate_stream",
                    json={"text_input": "abc", "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and "[DONE]" not in r.text
    assert [e["text_output"] for e in sse_json(r.text)] == ["c", "b", "a"]
    r = client.post("/v2/models/ensemble/generate_stream",
                    json={"text_input": "abc", "max_tokens": 3, "accumulate_tokens": True})
    assert [e["text_output"] for e in sse_json(r.text)] == ["c", "cb", "cba"]
    r = client.post("/v2/models/ensemble/generate_stream", json={"text_input": "FAIL", "max_tokens": 5})
    events = sse_json(r.text)
    assert r.status_code == 200 and events[-1] == {"error": "injected failure"}
    r = client.post("/v2/models/ensemble/generate_stream", json={"text_input": 3})
    assert r.status_code == 400 and "text_input" in r.json()["error"]
