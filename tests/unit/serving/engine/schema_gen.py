"""Seeded random JSON schemas for structured-output tests and the bench: nested objects, arrays,
enums, bounded numbers and strings, required fields. Strings and arrays are bounded so every
instance fits in a few dozen tokens (a constrained output can always close in time)."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "x", "on", "off"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["integer", "number", "string", "enum", "boolean", "null"])
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 20)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    return {"type": kind}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth > 0 and roll < 0.35:
        return random_object(rng, depth - 1)
    if depth > 0 and roll < 0.55:
        low = rng.randint(0, 2)
        return {"type": "array", "items": _node(rng, depth - 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    return _leaf(rng)


def random_object(rng: random.Random, depth: int = 2) -> dict[str, Any]:
    """An object schema with 1-3 properties, some required, no others allowed."""
    names = rng.sample(["id", "name", "size", "tags", "kind", "meta", "score", "ok", "v"],
                       rng.randint(1, 3))
    properties = {n: _node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def random_schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_object(rng) for _ in range(n)]
