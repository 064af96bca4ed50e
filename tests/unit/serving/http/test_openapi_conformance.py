"""The OpenAPI document is true: schemathesis generates requests from it (valid and invalid)
and checks every answer against it (status codes, media types, bodies) and that no request is
a 5xx, on the app over the fake engine (two prompt-tuned tasks and a LoRA adapter), with an API
key. The document given to schemathesis names the served models (`fake`, `fake:qa`, ...) and
the adapter as the values of every `model` field, so generated requests reach the engine
instead of stopping at a 404; invalid ones still get any string.

Requests that are valid by the schema but refused for what they mean (an empty prompt, a
setting this server documents as unsupported, e.g. `logit_bias`, `best_of`, non-empty
`bad_words`) are 4xx by design, so the check that every schema-valid request succeeds is left
out; the reverse (the server accepts nothing the schema calls invalid) is kept.

Default run: every operation, a few examples each, without the coverage phase. `-m slow`: all
phases (examples, coverage, fuzzing; stateful where the document has links) with 100 examples
per operation.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402

from tessera.core.lora_format import AdapterError  # noqa: E402
from tessera.serving.engine.adapters import AdapterBusy, UnknownAdapter  # noqa: E402
from tessera.serving.http.app import create_app  # noqa: E402

from ..fake_engine import FakeEngine  # noqa: E402

KEY = "k"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ADAPTER = "ad1"


class AdapterFakeEngine(FakeEngine):
    """The fake engine with one LoRA adapter that stays loaded (unloading it is refused as
    busy); loading any other succeeds only for the path "/adapters/ok"."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._adapters = [ADAPTER]

    def adapter_names(self) -> list[str]:
        return list(self._adapters)

    def load_adapter(self, name: str, path: str) -> str:
        if path != "/adapters/ok":
            raise AdapterError(f"{path!r} is not a LoRA adapter")
        if name not in self._adapters:
            self._adapters.append(name)
        return name

    def unload_adapter(self, name: str) -> None:
        if name == ADAPTER:
            raise AdapterBusy(f"adapter {name!r} is in use")
        if name not in self._adapters:
            raise UnknownAdapter(f"no adapter named {name!r}")
        self._adapters.remove(name)


app = create_app(AdapterFakeEngine(context=64), model_name="fake", api_key=KEY,
                 allow_runtime_lora=True)
MODELS = ["fake", "fake:qa", "fake:sentiment", f"fake:{ADAPTER}", ADAPTER]


def _with_model_names(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with the served names as the values of the `model` path parameter and of every
    request body's `model` field (the server's own document says "any string")."""
    doc = copy.deepcopy(doc)
    for item in doc["paths"].values():
        for op in item.values():
            for param in op.get("parameters", []):
                if param["name"] == "model" and param["in"] == "path":
                    param["schema"] = {"type": "string", "enum": MODELS}
    names = {"model": MODELS, "adapter": [ADAPTER], "task": ["qa", "sentiment"]}
    for schema in doc["components"]["schemas"].values():
        properties = schema.get("properties", {})
        for field, values in names.items():
            if field in properties and schema.get("title", "").endswith(("Request", "Inputs")):
                properties[field] = {"anyOf": [{"type": "string", "enum": values},
                                               {"type": "null"}]}
    return doc


DOC = _with_model_names(app.openapi())


def _schema(coverage: bool):
    # The coverage phase adds hundreds of boundary cases per operation (minutes here).
    config = schemathesis.config.SchemathesisConfig.from_dict(
        {"phases": {"coverage": {"enabled": coverage}}})
    schema = schemathesis.openapi.from_dict(DOC, config=config)
    schema.app, schema.location = app, "/openapi.json"
    return schema


SENT: Counter[str] = Counter()  # answers by status class, for the run's summary line


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    if SENT:
        print(f"\nschemathesis: {sum(SENT.values())} requests, by status: {dict(SENT)}")


def _check(case) -> None:
    response = case.call_and_validate(
        headers=HEADERS, excluded_checks=[schemathesis.checks.positive_data_acceptance])
    SENT[f"{response.status_code // 100}xx"] += 1


@_schema(coverage=False).parametrize()
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_the_server_answers_as_its_openapi_document_says(case):
    _check(case)


@pytest.mark.slow
@_schema(coverage=True).parametrize()
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_openapi_document_holds_under_a_long_run(case):
    _check(case)


# The document and the server agree on each of these bodies: both refuse it (the schema says
# why, and the server answers 400), where once one of them took it.
DISAGREED = [
    ("post", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": ""}),
    ("put", "/api", {"prompts": ["hi"], "tokens_to_generate": 1, "cache_salt": ""}),
    ("post", "/v2/models/{model}/generate", {"text_input": "hi", "max_tokens": 1,
                                             "cache_salt": ""}),
    ("post", "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                           "add_generation_prompt": False}),
    ("post", "/detokenize", {"tokens": [1, -1]}),
    ("post", "/v2/models/{model}/generate_stream",
     {"text_input": "hi", "max_tokens": 1, "embedding_bias_words": [""] * 17}),
    ("post", "/v2/models/{model}/generate", {"text_input": "hi", "max_tokens": 1,
                                             "stop_words": [""] * 17}),
]


@pytest.mark.parametrize(("method", "path", "body"), DISAGREED)
def test_the_document_and_the_server_refuse_the_same_bodies(method, path, body):
    import jsonschema
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        doc = client.get("/openapi.json", headers=HEADERS).json()
        schema = doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        validator = jsonschema.Draft202012Validator({**schema, "components": doc["components"]})
        assert not validator.is_valid(body), "the document accepts it"
        r = client.request(method.upper(), path.replace("{model}", "fake"), json=body,
                           headers=HEADERS)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert list(body)[-1] in (error["message"] if isinstance(error, dict) else error)
