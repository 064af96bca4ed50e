"""The safetensors header, read and checked once for every reader in the project.

A safetensors file is an 8-byte little-endian header length, that many bytes of JSON (name ->
dtype code, shape, byte range in the data section, plus an optional `__metadata__` map of
strings), then the data section. `read_header` parses it without touching the data; the
checkpoint verifier (`core.checkpoint_verify`) and the converters' streaming reader
(`converters.safetensors_stream`) both start from it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

# safetensors dtype codes -> bytes per element
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
              "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MAX_HEADER = 100 * 2**20  # the reference implementation's limit on the JSON header


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: dtype code, shape, byte range in the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header and where its data section lies in the file."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


class HeaderError(ValueError):
    """A safetensors header that cannot be parsed; the message says how it is damaged."""


def read_header(file: str | os.PathLike) -> Header:
    """The header of safetensors `file`; raises `HeaderError` when it is cut or malformed.
    Entries are parsed, not checked against their dtype or the file size (the callers say what
    they need of them)."""
    size = os.path.getsize(file)
    with open(file, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise HeaderError(f"{size} bytes, too short for the 8-byte header length: truncated")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(size - 8, MAX_HEADER):
            raise HeaderError(f"the header claims {length} bytes but the file holds {size - 8} "
                              "after the length field: truncated or not safetensors")
        raw = fh.read(length)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"the header is not valid JSON ({exc}): corrupted") from exc
    if not isinstance(body, dict):
        raise HeaderError("the header is not a JSON object: corrupted")
    metadata = body.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in body.items():
        try:
            begin, end = entry["data_offsets"]
            tensors[name] = TensorEntry(str(entry["dtype"]), tuple(int(d) for d in entry["shape"]),
                                        int(begin), int(end))
        except (TypeError, KeyError, ValueError) as exc:
            raise HeaderError(f"the header entry of {name!r} is malformed ({entry!r}): "
                              "corrupted") from exc
    return Header(tensors, metadata, 8 + length, size)
