"""The OpenAPI document is true: schemathesis generates requests from it (valid and invalid)
and checks every answer against it (status codes, media types, bodies) and that no request is
a 5xx, on the app over the fake engine, with an API key. Bounded: a few examples per operation.

Requests that are valid by the schema but refused for what they mean (an empty prompt, an
unknown model) are 4xx by design, so the check that every schema-valid request succeeds is left
out; the reverse (the server accepts nothing the schema calls invalid) is kept.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402

from tessera.serving.http.app import create_app  # noqa: E402

from ..fake_engine import FakeEngine  # noqa: E402

KEY = "k"
HEADERS = {"Authorization": f"Bearer {KEY}"}
app = create_app(FakeEngine(context=64), model_name="fake", api_key=KEY)


def _schema(coverage: bool):
    # The coverage phase adds hundreds of boundary cases per operation (about 100 s here).
    config = schemathesis.config.SchemathesisConfig.from_dict(
        {"phases": {"coverage": {"enabled": coverage}}})
    return schemathesis.openapi.from_asgi("/openapi.json", app, config=config, headers=HEADERS)


def _check(case) -> None:
    case.call_and_validate(headers=HEADERS,
                           excluded_checks=[schemathesis.checks.positive_data_acceptance])


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
