"""The structured-output fields of every dialect, read into one `StructuredOutput`.

OpenAI routes: `response_format` (`json_object`, `json_schema` {name, schema, strict}) and vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` or its `structured_outputs`
object. Triton `generate`/`infer` and Megatron `/api` take vLLM's object as `structured_outputs`
(`structured_from_object`). A request gives at most one constraint; two are a 400 naming both.
The engine checks the constraint itself (an invalid schema is a 400 with the reason).
"""

from __future__ import annotations

import json
from typing import Any

from tessera.serving.http import schemas as S
from tessera.serving.http.errors import ApiError
from tessera.serving.types import StructuredOutput


def _schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, str):  # vLLM accepts the schema as JSON text too
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param)
    return value


def structured_from_object(obj: S.StructuredOutputs | None,
                           param: str = "structured_outputs") -> StructuredOutput | None:
    """vLLM's `structured_outputs` object as a constraint (None when it sets none)."""
    if obj is None:
        return None
    given = [(name, value) for name, value in (("json", obj.json_), ("regex", obj.regex),
                                               ("choice", obj.choice), ("grammar", obj.grammar))
             if value is not None]
    if obj.json_object:
        given.append(("json_object", True))
    if len(given) > 1:
        raise ApiError(400, f"{param} sets {' and '.join(n for n, _ in given)}: give one",
                       param=param)
    if not given:
        return None
    name, value = given[0]
    if name == "json":
        return StructuredOutput("json_schema", _schema(value, f"{param}.json"))
    if name == "json_object":
        return StructuredOutput("json")
    return StructuredOutput(name, value)  # regex, choice, grammar


def structured_from_field(value: S.StructuredOutputs | str | None,
                          param: str = "structured_outputs") -> StructuredOutput | None:
    """The Triton / Megatron `structured_outputs` field: the object, or the object as JSON
    text (a BYTES tensor of `infer`)."""
    if isinstance(value, str):
        try:
            value = S.StructuredOutputs.model_validate_json(value)
        except ValueError as exc:
            reason = str(exc).splitlines()[-1].strip() if str(exc).strip() else "not valid"
            raise ApiError(400, f"{param} is not a structured_outputs object: {reason}",
                           param=param) from None
    return structured_from_object(value, param)


def structured_output(body: S.SamplingFields) -> StructuredOutput | None:
    """The constraint an OpenAI-dialect body asks for, if any."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutput("json")))
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None  # the schema model requires it
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
        found.append(("response_format", StructuredOutput(
            "json_schema", schema, strict=bool(fmt.json_schema.strict))))
    if body.guided_json is not None:
        found.append(("guided_json", StructuredOutput(
            "json_schema", _schema(body.guided_json, "guided_json"))))
    for param, kind in (("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(body, param)
        if value is not None:
            found.append((param, StructuredOutput(kind, value)))
    from_object = structured_from_object(body.structured_outputs)
    if from_object is not None:
        found.append(("structured_outputs", from_object))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise ApiError(400, f"the request constrains its output twice ({names}): give one",
                       param=found[1][0])
    if found and body.ignore_eos:
        raise ApiError(400, "ignore_eos cannot be combined with a structured output: a "
                            "constrained output ends with EOS", param="ignore_eos")
    return found[0][1] if found else None
