"""A generated token that ends the request (EOS, or one of `stop_token_ids` / Triton's
`end_id`) still has its logprob in every dialect, and `finish_reason` says why it stopped.

lm-eval's loglikelihood request (token ids, `echo`, `logprobs: 1`, `max_tokens: 1`, greedy)
reads `token_logprobs[ctxlen:-1]`: the answer must hold one entry per prompt token plus one for
the generated token, whatever that token is.

Reference: the model's own full forward pass (log-softmax of its logits).
"""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from tessera.core import ModelConfig, build_model
from tessera.serving.engine import LLMEngine
from tessera.serving.http.app import create_app
from tests.serving_helper import train_tiny_tokenizer

PROMPT = "the cat sat on the"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.from_name("llama-tiny", init_std=0.1), seed=3).eval()


def _next_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1].float().log_softmax(-1)


@pytest.fixture(scope="module")
def greedy(model, tokenizer) -> tuple[int, float]:
    """(the greedy token after PROMPT with BOS, its logprob)."""
    logp = _next_logprobs(model, tokenizer.encode(PROMPT, bos=True))
    token = int(logp.argmax())
    return token, float(logp[token])


@pytest.fixture(scope="module")
def client(model, tokenizer, greedy):
    """A server whose EOS is the greedy token after PROMPT: that request ends on EOS."""
    with LLMEngine(model, tokenizer, max_batch=4, seed=0, eos_id=greedy[0]) as engine:
        with TestClient(create_app(engine, model_name="tiny")) as c:
            yield c


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids", "none"])
def test_lm_evals_request_gets_every_prompt_token_and_the_generated_one(client, tokenizer,
                                                                         greedy, stop):
    ids = tokenizer.encode(PROMPT, bos=True)
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    if stop == "stop_token_ids":
        body["stop_token_ids"] = [greedy[0]]
    elif stop == "none":
        body["ignore_eos"] = True
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][-1] == pytest.approx(greedy[1], abs=1e-4)
    assert max(lp["top_logprobs"][-1].values()) == pytest.approx(greedy[1], abs=1e-4)
    assert choice["finish_reason"] == ("length" if stop == "none" else "stop")
    assert "".join(lp["tokens"]) == choice["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_completions_and_chat_keep_the_stop_tokens_logprob(client, model, tokenizer,
                                                                  greedy, stream):
    from ..conftest import sse_json

    def post(path: str, body: dict) -> tuple[list[float], str, str]:
        body = {**body, "temperature": 0, "stream": stream}
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        chunks = sse_json(r.text) if stream else [r.json()]
        lps, text, reason = [], "", None
        for c in chunks:
            for choice in c["choices"]:
                text += choice.get("text") or (choice.get("delta") or choice.get("message") or {}
                                               ).get("content") or ""
                reason = choice.get("finish_reason") or reason
                if choice.get("logprobs"):
                    lp = choice["logprobs"]
                    lps += (lp["token_logprobs"] if "token_logprobs" in lp
                            else [e["logprob"] for e in lp["content"]])
        return lps, text, reason

    lps, text, reason = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 0})
    assert reason == "stop" and text == "" and lps == [pytest.approx(greedy[1], abs=1e-4)]
    # Chat: stop on whatever token greedy decoding picks first after the templated prompt.
    messages = [{"role": "user", "content": PROMPT}]
    ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    logp = _next_logprobs(model, ids)
    stop_id = int(logp.argmax())
    lps, text, reason = post("/v1/chat/completions", {"messages": messages, "max_tokens": 4,
                                                      "logprobs": True,
                                                      "stop_token_ids": [stop_id]})
    assert reason == "stop" and text == ""
    assert lps == [pytest.approx(float(logp[stop_id]), abs=1e-4)]


def test_triton_and_megatron_keep_the_stop_tokens_logprob(client, tokenizer, greedy):
    for path in ("/v2/models/tiny/generate", "/v2/models/tiny/generate_stream"):
        body = {"text_input": PROMPT, "max_tokens": 4, "return_log_probs": True,
                "temperature": 0}
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        text = r.text if path.endswith("stream") else ""
        assert "output_log_probs" in (text or r.json()), r.text
        if not path.endswith("stream"):
            answer = r.json()
            assert answer["output_log_probs"] == [pytest.approx(greedy[1], abs=1e-4)]
            assert answer["text_output"] == ""
    ids = tokenizer.encode(PROMPT, bos=True)
    api = client.put("/api", json={"prompts": [PROMPT], "tokens_to_generate": 4,
                                   "logprobs": True, "temperature": 0}).json()
    assert len(api["logprobs"][0]) == len(ids)  # every token after the first, EOS included
    assert api["logprobs"][0][-1] == pytest.approx(greedy[1], abs=1e-4)
    assert len(api["segments"][0]) == len(ids) + 1 and api["text"] == [PROMPT]
