"""The OpenAI dialect over the fake engine: answers, streaming shape, n and seeds, tasks, errors."""

from __future__ import annotations

import pytest

from tessera.serving.http.schemas import ChatCompletionResponse, CompletionResponse, ErrorResponse
from tessera.serving.http.service import derive_seed

from ..conftest import sse_data, sse_json
from ..fake_engine import BOS


def complete(client, **body):
    return client.post("/v1/completions", json={"model": "fake", **body})


def test_models_lists_the_base_model_and_one_entry_per_task(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["fake", "fake:qa", "fake:sentiment"]
    assert data[1]["parent"] == "fake" and data[0]["parent"] is None
    assert data[0]["max_model_len"] == 256


def test_completion_text_finish_reason_and_usage(client):
    r = complete(client, prompt="abc", max_tokens=5)
    assert r.status_code == 200
    body = CompletionResponse.model_validate(r.json())
    assert body.object == "text_completion" and body.id.startswith("cmpl-")
    assert body.text == "cbacb" and body.choices[0].finish_reason == "length"
    assert body.usage.model_dump() == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}


@pytest.mark.parametrize("prompt, texts", [
    (["ab", "xyz"], ["bab", "zyx"]),
    ([BOS, ord("q") + 3, ord("r") + 3], ["rqr"]),
    ([[BOS, ord("q") + 3], [ord("z") + 3]], ["qqq", "zzz"]),
])
def test_prompt_forms(client, prompt, texts):
    body = complete(client, prompt=prompt, max_tokens=3).json()
    assert [c["text"] for c in body["choices"]] == texts
    assert [c["index"] for c in body["choices"]] == list(range(len(texts)))


def test_n_submits_n_requests_with_seeds_derived_from_the_request_seed(client, engine):
    body = complete(client, prompt="abcdef", max_tokens=6, n=3, temperature=1.0, seed=11).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    seeds = [r.params.seed for r in engine.started]
    assert seeds == [derive_seed(11, i) for i in range(3)] and seeds[0] == 11
    assert len(set(seeds)) == 3
    # the fake rotates its answer by the seed, so different seeds give different texts here
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] == engine.answer(engine.started[0])
    assert len(set(texts)) > 1
    assert body["usage"]["prompt_tokens"] == 7  # the prompt counts once, not n times
    assert body["usage"]["completion_tokens"] == 18


def test_echo_and_logprobs(client):
    body = complete(client, prompt="ab", max_tokens=2, echo=True, logprobs=2).json()
    choice = body["choices"][0]
    assert choice["text"] == "abba"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["", "a", "b", "b", "a"]  # BOS, prompt, completion
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1] == -0.5
    assert lp["token_logprobs"][3:] == [-0.1, -0.2]
    assert lp["top_logprobs"][3] == {"b": -0.1, "c": -1.1}
    assert lp["text_offset"] == [0, 0, 1, 2, 3]


def test_stop_string_cuts_the_text(client):
    choice = complete(client, prompt="abc", max_tokens=8, stop="a").json()["choices"][0]
    assert choice["text"] == "cb" and choice["finish_reason"] == "stop"


def test_task_is_selected_by_model_name(client, engine):
    body = complete(client, prompt="ab", max_tokens=6, model="fake:qa").json()
    assert body["choices"][0]["text"] == "[qa]ba"
    assert engine.started[-1].task == "qa"


@pytest.mark.parametrize("model, fragment", [("nope", "does not exist"), ("fake:nope", "unknown task"),
                                             ("other:qa", "does not exist")])
def test_unknown_model_or_task_is_a_404_in_openai_shape(client, model, fragment):
    r = client.post("/v1/completions", json={"model": model, "prompt": "x"})
    assert r.status_code == 404
    error = ErrorResponse.model_validate(r.json()).error
    assert fragment in error.message and error.code == "model_not_found" and error.param == "model"


def test_stream_chunks_usage_and_done(client):
    r = complete(client, prompt="abc", max_tokens=4, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = sse_json(r.text)
    assert all(c["object"] == "text_completion" for c in chunks)
    content, usage = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in content) == "cbac"
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_stream_with_n_and_echo(client):
    r = complete(client, prompt="ab", max_tokens=2, n=2, stream=True, echo=True)
    texts = {0: "", 1: ""}
    for chunk in sse_json(r.text):
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {0: "abba", 1: "abba"}


def test_chat_default_template_and_custom_template(make_client):
    client = make_client()
    body = client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        "max_tokens": 200}).json()
    chat = ChatCompletionResponse.model_validate(body)
    # the fake answers with the rendered prompt reversed
    assert chat.text.startswith("system: s\nuser: hi\nassistant:"[::-1])
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    custom = make_client(chat_template="{% for m in messages %}<{{ m.content }}>{% endfor %}")
    body = custom.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 4}).json()
    assert body["choices"][0]["message"]["content"] == ">ih<"


def test_chat_without_max_tokens_fills_the_context(client, engine):
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    request = engine.started[-1]
    assert len(request.prompt_ids) + request.params.max_tokens == engine.context


def test_chat_stream_and_logprobs(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "ab"}], "max_tokens": 3, "stream": True,
        "logprobs": True, "top_logprobs": 1})
    chunks = sse_json(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = chunks[1]["choices"][0]["logprobs"]["content"]
    assert content[0]["logprob"] == -0.1 and len(content[0]["top_logprobs"]) == 1
    assert sse_data(r.text)[-1] == "[DONE]"


def test_a_failing_request_fails_alone(client):
    r = complete(client, prompt="FAIL here", max_tokens=5)
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    r = complete(client, prompt="RAISE here", max_tokens=5)
    assert r.status_code == 500 and "injected exception" in r.json()["error"]["message"]
    assert complete(client, prompt="ok", max_tokens=2).status_code == 200


def test_a_failure_mid_stream_is_an_error_event_then_done(client):
    r = complete(client, prompt="FAIL", max_tokens=5, stream=True)
    assert r.status_code == 200
    events = sse_json(r.text)
    assert "injected failure" in events[-1]["error"]["message"]
    assert sse_data(r.text)[-1] == "[DONE]"


def test_timeout_is_a_504(make_client):
    r = complete(make_client(request_timeout_s=0.2), prompt="HANG", max_tokens=2)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
