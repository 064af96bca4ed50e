"""KServe v2 tensors on the wire: JSON `data`, the binary tensor extension, and compression.

Request (what `tritonclient.http` sends): a JSON header, optionally followed by binary tensors
when the `Inference-Header-Content-Length: N` header says the first N bytes are the JSON. A
binary input carries `parameters.binary_data_size`; the blobs follow in input order, raw
little-endian and row-major, BYTES elements each as `<uint32 LE length><bytes>`. The whole
body may be gzip- or deflate-compressed (`Content-Encoding`).

Response: an output is binary when its `parameters.binary_data` says so, else when the
request's `parameters.binary_data_output` does (tritonclient sets that whenever the caller
names no outputs, so binary is the common case). Binary outputs follow the JSON in order; the
header then gives the JSON's uncompressed length. gzip or deflate is applied when the client's
`Accept-Encoding` allows it; never brotli (the aio client advertises it but cannot decode it).
"""

from __future__ import annotations

import gzip
import json
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from fastapi.responses import Response

from tessera.serving.http.errors import ApiError, decode_json

HEADER_LENGTH = "inference-header-content-length"

NUMPY_TYPES: dict[str, Any] = {
    "BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """`body` without its `Content-Encoding` (gzip or deflate), refusing more than `limit` bytes."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise ApiError(415, f"unsupported Content-Encoding {encoding!r}; use gzip or deflate")
    # gzip: gzip framing; deflate: zlib framing (what tritonclient sends), raw deflate tolerated.
    for wbits in ((16 + zlib.MAX_WBITS,) if encoding == "gzip" else (zlib.MAX_WBITS, -zlib.MAX_WBITS)):
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit or inflater.unconsumed_tail:
            raise ApiError(413, f"the decompressed request body exceeds the limit of {limit} bytes")
        return out
    raise ApiError(400, f"request body is not valid {encoding} data")


def _shape(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in value):
        raise ApiError(400, f"input {name!r}: shape must be a list of non-negative integers")
    return value


def _bytes_elements(raw: bytes, name: str) -> list[bytes]:
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise ApiError(400, f"input {name!r}: truncated BYTES element length")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise ApiError(400, f"input {name!r}: BYTES element runs past its binary data")
        items.append(raw[offset:offset + size])
        offset += size
    return items


def _json_elements(data: Any, datatype: str, name: str) -> np.ndarray:
    flat: list[Any] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        else:
            flat.append(v)

    walk(data)
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise ApiError(400, f"input {name!r}: BYTES data must be strings")
        return np.array([v.encode("utf-8") for v in flat] or [], dtype=np.object_)
    wants_bool = datatype == "BOOL"
    wants_int = datatype.startswith(("INT", "UINT"))
    for v in flat:
        ok = isinstance(v, bool) if wants_bool else (
            isinstance(v, int) and not isinstance(v, bool) if wants_int
            else isinstance(v, int | float) and not isinstance(v, bool))
        if not ok:
            raise ApiError(400, f"input {name!r}: {json.dumps(v)[:40]} is not a {datatype} value")
    try:
        return np.array(flat, dtype=NUMPY_TYPES[datatype])
    except OverflowError:
        raise ApiError(400, f"input {name!r}: a value is out of range for {datatype}") from None


def _check_header(header: Any) -> None:
    """A 400 unless `header` has the v2 request's shape: an object with an `inputs` list of
    `{"name": str, ...}` objects, optional `outputs` of the same kind, and objects (or null) for
    every `parameters`."""
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise ApiError(400, "the inference request must be a JSON object with an 'inputs' list")
    if not isinstance(header.get("outputs") or [], list):
        raise ApiError(400, "'outputs' must be a list of {\"name\": ...} objects")
    if not isinstance(header.get("parameters") or {}, dict):
        raise ApiError(400, "'parameters' must be a JSON object")
    for kind in ("inputs", "outputs"):
        for i, spec in enumerate(header.get(kind) or []):
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ApiError(400, f"{kind}[{i}] must be an object with a string 'name'")
            if not isinstance(spec.get("parameters") or {}, dict):
                raise ApiError(400, f"{kind}[{i}].parameters must be a JSON object")


def decode_request(body: bytes, headers: Mapping[str, str], limit: int) -> tuple[dict, dict[str, np.ndarray]]:
    """(JSON header, {input name: array of its shape}); BYTES arrays hold `bytes` objects.
    `body` is already decompressed (`security.read_body` removes the Content-Encoding)."""
    declared = headers.get(HEADER_LENGTH)
    if declared is None:
        header, binary = decode_json(body), b""
    else:
        if not declared.isdigit() or int(declared) > len(body):
            raise ApiError(400, f"{HEADER_LENGTH} {declared!r} does not fit the body of {len(body)} bytes")
        header, binary = decode_json(body[:int(declared)]), body[int(declared):]
    _check_header(header)
    tensors, offset = {}, 0
    for spec in header["inputs"]:
        name, datatype = spec["name"], spec.get("datatype")
        if not isinstance(datatype, str) or datatype not in NUMPY_TYPES:
            raise ApiError(400, f"input {name!r}: unsupported datatype {datatype!r}; "
                                f"expected one of {sorted(NUMPY_TYPES)}")
        shape = _shape(spec.get("shape"), name)
        size = (spec.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise ApiError(400, f"input {name!r}: binary_data_size {size!r} runs past the body")
            raw, offset = binary[offset:offset + size], offset + size
            if datatype == "BYTES":
                array = np.array(_bytes_elements(raw, name) or [], dtype=np.object_)
            else:
                itemsize = np.dtype(NUMPY_TYPES[datatype]).itemsize
                if len(raw) % itemsize:
                    raise ApiError(400, f"input {name!r}: {len(raw)} bytes is not a whole number "
                                        f"of {datatype} values")
                array = np.frombuffer(raw, dtype=np.dtype(NUMPY_TYPES[datatype]).newbyteorder("<"))
        elif "data" in spec:
            array = _json_elements(spec["data"], datatype, name)
        else:
            raise ApiError(400, f"input {name!r} has neither 'data' nor binary_data_size")
        if array.size != int(np.prod(shape)):
            raise ApiError(400, f"input {name!r}: shape {shape} needs {int(np.prod(shape))} "
                                f"elements, got {array.size}")
        tensors[name] = array.reshape(shape)
    return header, tensors


def _datatype(array: np.ndarray) -> str:
    if array.dtype == np.object_:
        return "BYTES"
    return next(k for k, v in NUMPY_TYPES.items() if v is not np.object_ and np.dtype(v) == array.dtype)


def encode_response(header: dict, model: str, outputs: dict[str, np.ndarray], wanted: list[str],
                    accept_encoding: str | None) -> Response:
    """The v2 answer carrying `outputs[name]` for each name in `wanted`, JSON or binary per output."""
    params = header.get("parameters") or {}
    default_binary = bool(params.get("binary_data_output", False))
    requested = {o.get("name"): (o.get("parameters") or {}) for o in header.get("outputs") or []
                 if isinstance(o, dict)}
    entries, blobs = [], []
    for name in wanted:
        array = outputs[name]
        entry = {"name": name, "datatype": _datatype(array), "shape": list(array.shape)}
        if requested.get(name, {}).get("binary_data", default_binary):
            if array.dtype == np.object_:
                blob = b"".join(struct.pack("<I", len(b)) + b for b in array.ravel())
            else:
                blob = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            flat = array.ravel()
            entry["data"] = [b.decode("utf-8", "replace") for b in flat] if array.dtype == np.object_ \
                else flat.tolist()
        entries.append(entry)
    answer = {"model_name": model, "model_version": "1", "outputs": entries}
    if header.get("id") not in (None, ""):
        answer["id"] = header["id"]
    js = json.dumps(answer).encode()
    response_headers = {}
    if blobs:
        response_headers[HEADER_LENGTH] = str(len(js))
    body = js + b"".join(blobs)
    accepted = {p.split(";")[0].strip().lower() for p in (accept_encoding or "").split(",")}
    if "gzip" in accepted:
        body, response_headers["Content-Encoding"] = gzip.compress(body, compresslevel=1), "gzip"
    elif "deflate" in accepted:
        body, response_headers["Content-Encoding"] = zlib.compress(body, 1), "deflate"
    media = "application/octet-stream" if blobs else "application/json"
    return Response(body, media_type=media, headers=response_headers)
