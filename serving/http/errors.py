"""Errors in each dialect's own shape, and strict decoding of JSON request bodies.

Every failure the HTTP layer reports goes through `error_response`, which picks the body from
the path: `/v1/...` gets the OpenAI object `{"error": {"message", "type", "param", "code"}}`;
everything else (KServe v2 / Triton, Megatron `/api`, operations) gets `{"error": "message"}`,
which is what `tritonclient` reads (FastAPI's `{"detail": ...}` would reach its users as
"... decoding the response: 'error'").

A request the server refuses is a 4xx with a message that names the problem; 5xx is left for
faults of the server itself.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("tessera.serving")

M = TypeVar("M", bound=BaseModel)

# OpenAI error `type` by status, for errors that do not name their own.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                 408: "timeout_error", 415: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                 504: "timeout_error"}


class ApiError(Exception):
    """An HTTP error answered in the caller's dialect. `headers` (e.g. Retry-After) are sent."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.type, self.param, self.code, self.headers = type, param, code, headers


def openai_error_body(status: int, message: str, *, type: str | None = None,
                      param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = type or _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_body(path: str, status: int, message: str, **openai_fields: Any) -> dict[str, Any]:
    if path.startswith("/v1/") or path == "/v1":
        return openai_error_body(status, message, **openai_fields)
    return {"error": message}


def error_response(path: str, status: int, message: str, *, headers: dict[str, str] | None = None,
                   **openai_fields: Any) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, **openai_fields), status_code=status,
                        headers=headers)


def from_api_error(path: str, exc: ApiError) -> JSONResponse:
    return error_response(path, exc.status, exc.message, headers=exc.headers, type=exc.type,
                          param=exc.param, code=exc.code)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error FastAPI or a handler raises into `error_response`."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return from_api_error(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_errors(list(exc.errors()))
        return error_response(request.url.path, 400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(request.url.path, exc.status_code, message,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request.url.path, 500, f"internal server error: {type(exc).__name__}",
                              type="server_error")


# ------------------------------------------------------------------------------ decoding


def describe_errors(errors: list[Any]) -> tuple[str, str | None]:
    """One readable line for pydantic errors, and the offending parameter's name."""
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        # Union branches ('prompt', 'str') and validator wrappers add noise to the location.
        loc = [p for p in loc if not p.startswith(("function-", "list[", "str", "int", "dict["))]
        name = ".".join(loc)
        param = param or (name or None)
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        got = err.get("input")
        shown = "" if isinstance(got, dict | list) or got is None else f" (got {json.dumps(got)[:60]})"
        parts.append(f"{name}: {msg}{shown}" if name else msg)
    return "; ".join(parts), param


def decode_json(raw: bytes) -> Any:
    """The JSON value of a request body, or a 400 that says why it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                            f"column {exc.colno}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if _has_surrogate(value):
        raise ApiError(400, f"request body has a lone surrogate escape ({_surrogate_at(text)}): "
                            "a JSON string must be valid Unicode (pair \\uD800-\\uDBFF with "
                            "\\uDC00-\\uDFFF)")
    return value


_SURROGATE = re.compile(r"[\ud800-\udfff]")
_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|.)", re.DOTALL)  # one JSON escape, in order


def _has_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        return bool(_SURROGATE.search(value))
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    return False


def _surrogate_at(text: str) -> str:
    """'line L column C' of the first lone surrogate escape in the raw JSON `text`."""
    codes = [(m.start(), m.end(), int(m.group(1)[1:], 16) if len(m.group(1)) == 5 else None)
             for m in _ESCAPE.finditer(text)]
    for i, (start, end, code) in enumerate(codes):
        if code is None or not 0xD800 <= code <= 0xDFFF:
            continue
        nxt = codes[i + 1] if i + 1 < len(codes) else None
        prev = codes[i - 1] if i else None
        high_paired = code <= 0xDBFF and nxt is not None and nxt[0] == end and \
            nxt[2] is not None and 0xDC00 <= nxt[2] <= 0xDFFF
        low_paired = code >= 0xDC00 and prev is not None and prev[1] == start and \
            prev[2] is not None and 0xD800 <= prev[2] <= 0xDBFF
        if not (high_paired or low_paired):
            line = text.count("\n", 0, start) + 1
            return f"line {line} column {start - (text.rfind(chr(10), 0, start) + 1) + 1}"
    return "position unknown"


def parse_body(raw: bytes, model: type[M]) -> M:
    """`raw` validated as `model` (strictly), or a 400 naming the offending field."""
    value = decode_json(raw)
    if not isinstance(value, dict):
        raise ApiError(400, f"request body must be a JSON object, not {type(value).__name__}")
    return validate(value, model)


def whole_numbers_as_ints(value: Any) -> Any:
    """`value` with every whole-number float (`16.0`) that is exact as a float made an int.

    JSON Schema counts `16.0` as an integer and JSON clients (JavaScript above all) send it;
    the strict models would refuse it. A float field still accepts the int, so nothing that
    was valid changes meaning."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: whole_numbers_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [whole_numbers_as_ints(v) for v in value]
    return value


def validate(value: Any, model: type[M]) -> M:
    value = whole_numbers_as_ints(value)
    try:
        # JSON mode keeps strictness (no "16" -> 16) while accepting nested objects as dicts.
        return model.model_validate_json(json.dumps(value))
    except ValidationError as exc:
        message, param = describe_errors(exc.errors())
        raise ApiError(400, message, param=param) from None


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a JSON body that the route reads and validates itself.

    The routes parse raw bytes (for clear 4xx messages and clients that send no Content-Type),
    so FastAPI cannot see the model; `app.build_openapi` moves `x-schemas` into components.
    """
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "x-schemas": defs}
