"""Megatron-LM's `PUT /api` over the fake engine."""

from __future__ import annotations

import pytest


def test_text_segments_and_logprobs(client, engine):
    r = client.put("/api", json={"prompts": ["ab", "xyz"], "tokens_to_generate": 2, "logprobs": True,
                                 "random_seed": -1, "stop_on_eol": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == ["abba", "xyzzy"]
    assert body["segments"][0] == ["", "a", "b", "b", "a"]
    # every token after the first: prompt (fake: -0.5 each), then generated
    assert body["logprobs"][0] == [-0.5, -0.5, -0.1, -0.2]
    assert all(r.params.stop == ["\n"] and r.params.seed is None for r in engine.started)


def test_scoring_only_and_task(client, engine):
    body = client.put("/api", json={"prompts": ["abc"], "tokens_to_generate": 0, "logprobs": True}).json()
    assert body["text"] == ["abc"] and body["logprobs"] == [[-0.5, -0.5, -0.5]]
    body = client.put("/api", json={"prompts": ["ab"], "tokens_to_generate": 4, "task": "qa"}).json()
    assert body["text"] == ["ab[qa]"] and "logprobs" not in body


@pytest.mark.parametrize("body, fragment", [
    ({"prompts": "ab"}, "prompts"),
    ({"prompts": []}, "prompts"),
    ({"prompts": ["ab"], "tokens_to_generate": -1}, "tokens_to_generate"),
    ({"prompts": ["ab"], "tokens_to_generate": 0}, "set logprobs to true"),
    ({"prompts": ["ab"], "top_k": 2, "top_p": 0.5}, "cannot both be set"),
    ({"prompts": ["ab"], "temperature": "hot"}, "temperature"),
    ({"prompts": ["ab"], "task": "nope"}, "unknown task"),
])
def test_bad_requests_are_4xx_error_bodies(client, body, fragment):
    r = client.put("/api", json=body)
    assert 400 <= r.status_code < 500
    assert isinstance(r.json()["error"], str) and fragment in r.json()["error"], r.text


def test_engine_failure_is_a_500_error_body(client):
    r = client.put("/api", json={"prompts": ["FAIL"], "tokens_to_generate": 5})
    assert r.status_code == 500 and r.json() == {"error": "injected failure"}
