"""The OpenAPI document made true: what FastAPI infers, corrected to what the routes answer.

FastAPI documents a 200 JSON body and a 422 for every route; the routes here read their bodies
themselves and answer errors through `serving.http.errors`. `complete(schema)` rewrites, per
operation:

- errors: 400 instead of 422; the statuses each kind of route can answer (auth 401, unknown
  model or task 404, body problems 408 / 413 / 415, admission 429, engine 500 / 503 / 504),
  each with the dialect's error body (`ErrorResponse` under `/v1`, `{"error": str}` elsewhere);
- bodies: none for the health routes (status code only), Prometheus text for `/metrics`,
  server-sent events for `generate_stream` and the OpenAI routes' `stream: true`;
- `infer`'s request body (JSON, or JSON plus binary tensors), which FastAPI cannot see.

`tests/unit/serving/http/test_openapi_conformance.py` keeps it true with schemathesis.
"""

from __future__ import annotations

from typing import Any

from tessera.serving.http import schemas as S

_REF = "#/components/schemas/{model}"
_PLAIN_ERROR = {"title": "PlainError", "type": "object", "required": ["error"],
                "properties": {"error": {"type": "string"}}}
_DESCRIPTIONS = {
    400: "invalid request (the message names the problem)", 401: "missing or wrong API key",
    404: "unknown model, task, version or route", 408: "the request body did not arrive in time",
    413: "request body too large", 415: "unsupported Content-Encoding",
    429: "admission limit reached; retry after Retry-After", 500: "internal error",
    503: "engine overloaded or stopping; retry after Retry-After",
    504: "the request timed out"}
_BODY_ERRORS = (400, 408, 413, 415)
_ENGINE_ERRORS = (429, 500, 503, 504)
_GENERATION = ("/v1/completions", "/v1/chat/completions", "/api", "/infer", "/generate",
               "/generate_stream")
_NO_BODY = ("/health", "/v2/health/live", "/v2/health/ready")
# Each event's data is a JSON chunk (a stream ends with `data: [DONE]` on the OpenAI routes).
_SSE = {"text/event-stream": {"schema": {"description": "data: <JSON chunk> events"}}}


def _statuses(path: str, method: str, op: dict[str, Any], open_paths: tuple[str, ...]) -> list[int]:
    """The error statuses `path` can answer."""
    out: set[int] = {500}
    if path not in open_paths:
        out.add(401)
    if "requestBody" in op or path.endswith("/infer") or method in ("post", "put"):
        out.update(_BODY_ERRORS)
    if "{model}" in path or path.startswith(("/v1/", "/api", "/tokeni", "/detokenize")):
        out.update((400, 404))
    if path.endswith(_GENERATION):
        out.update(_ENGINE_ERRORS)
    if path.endswith("/ready"):
        out.add(503)
    return sorted(out)


def _infer_body() -> dict[str, Any]:
    tensor = {"type": "object", "required": ["name", "shape", "datatype"], "properties": {
        "name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer"}},
        "datatype": {"type": "string"}, "data": {}, "parameters": {"type": "object"}}}
    request = {"type": "object", "required": ["inputs"], "properties": {
        "id": {"type": "string"}, "parameters": {"type": "object"},
        "inputs": {"type": "array", "items": tensor},
        "outputs": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "parameters": {"type": "object"}}}}}}
    return {"required": True, "description": "a KServe v2 inference request; with the header "
            "Inference-Header-Content-Length: N, the first N bytes are this JSON and binary "
            "tensors follow", "content": {
                "application/json": {"schema": request},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}


def complete(schema: dict[str, Any], open_paths: tuple[str, ...]) -> dict[str, Any]:
    """`schema` (FastAPI's) corrected in place as the module docstring says; returned."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["PlainError"] = _PLAIN_ERROR
    components.setdefault("ErrorResponse", S.ErrorResponse.model_json_schema(ref_template=_REF))
    for name, sub in components["ErrorResponse"].pop("$defs", {}).items():
        components.setdefault(name, sub)
    for path, item in schema.get("paths", {}).items():
        error_ref = _REF.format(model="ErrorResponse" if path.startswith("/v1/") else "PlainError")
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in _statuses(path, method, op, open_paths):
                responses.setdefault(str(status), {
                    "description": _DESCRIPTIONS[status],
                    "content": {"application/json": {"schema": {"$ref": error_ref}}}})
            ok = responses.setdefault("200", {"description": "OK"})
            if path in _NO_BODY:
                ok.pop("content", None)
                responses["503"] = {"description": "the engine is not running"}
                responses.pop("500", None)
            elif path.endswith("/ready"):
                ok.pop("content", None)
                responses["400"] = {"description": "unknown model or version"}
                responses["503"] = {"description": "the engine is not running"}
            elif path == "/metrics":
                ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
            elif path.endswith("/generate_stream"):
                ok["content"] = _SSE
            elif path in ("/v1/completions", "/v1/chat/completions"):
                ok.setdefault("content", {}).update(_SSE)  # with "stream": true
            if path.endswith("/infer"):
                op["requestBody"] = _infer_body()
                ok["content"] = {"application/json": {"schema": {"type": "object"}},
                                 "application/octet-stream": {"schema": {"type": "string",
                                                                         "format": "binary"}}}
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    return schema
