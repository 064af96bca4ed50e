"""The HTTP layer over the real `LLMEngine` (llama-tiny, a sentencepiece tokenizer with byte
fallback): logprob tokens that concatenate to the text in every dialect, prompt scoring as
lm-eval asks for it, and bad token ids refused with a 400 everywhere.

References: the model's own full forward pass (log-softmax of its logits), and the tokenizer's
decode of the whole sequence (what the tokens must concatenate to).
"""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from tessera.core import ModelConfig, build_model
from tessera.serving.engine import LLMEngine
from tessera.serving.http.app import create_app
from tests.serving_helper import train_tiny_tokenizer

from ..conftest import sse_json

# Leading spaces, a whitespace run, a newline, multi-byte characters (byte-fallback pieces).
PROMPT = "def  main(args):\n    return  café 🙂"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.from_name("llama-tiny", init_std=0.1), seed=3).eval()


@pytest.fixture(scope="module")
def client(model, tokenizer):
    with LLMEngine(model, tokenizer, max_batch=4, seed=0) as engine:
        with TestClient(create_app(engine, model_name="tiny")) as c:
            yield c


def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one full forward pass."""
    with torch.no_grad():
        logp = model(torch.tensor([ids]))[0].float().log_softmax(-1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def _check_offsets(lp: dict, start: int = 0) -> None:
    offset = start
    for token, at in zip(lp["tokens"], lp["text_offset"]):
        assert at == offset
        offset += len(token)


def test_completion_logprob_tokens_concatenate_to_the_text(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    assert any(tokenizer.decode([t]) != tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):]
               for i, t in enumerate(ids)), "the prompt must hold pieces that decode differently alone"
    for body in ({"prompt": PROMPT, "max_tokens": 12, "logprobs": 2, "temperature": 0},
                 {"prompt": PROMPT, "max_tokens": 12, "logprobs": 2, "temperature": 0, "echo": True},
                 {"prompt": ids, "max_tokens": 12, "logprobs": 0, "temperature": 0, "echo": True}):
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        lp = choice["logprobs"]
        assert "".join(lp["tokens"]) == choice["text"]
        _check_offsets(lp)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        if body.get("echo"):
            assert choice["text"].startswith(PROMPT)
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert all(t is not None for t in lp["top_logprobs"][1:])  # logprobs 0: no nulls
        else:
            assert all(len(t) >= 1 for t in lp["top_logprobs"])
    # Streamed: the chunks' tokens concatenate to the streamed text too.
    body = {"prompt": PROMPT, "max_tokens": 12, "logprobs": 1, "temperature": 0, "stream": True}
    chunks = sse_json(client.post("/v1/completions", json=body).text)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["tokens"]]
    assert "".join(tokens) == text


def test_chat_and_megatron_tokens_concatenate(client):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
            "logprobs": True, "top_logprobs": 2, "temperature": 0}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == choice["message"]["content"].encode()
    api = client.put("/api", json={"prompts": [PROMPT], "tokens_to_generate": 8, "logprobs": True,
                                   "temperature": 0}).json()
    assert "".join(api["segments"][0]) == api["text"][0]
    assert len(api["logprobs"][0]) == len(api["segments"][0]) - 1


def test_echo_scores_every_prompt_token_like_the_full_forward(client, model, tokenizer):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1."""
    ids = tokenizer.encode(PROMPT, bos=True)
    body = {"prompt": [ids, ids[:5]], "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    for choice, prompt in zip(sorted(choices, key=lambda c: c["index"]), (ids, ids[:5])):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        got = torch.tensor(lp["token_logprobs"][1:len(prompt)])
        torch.testing.assert_close(got, _reference_logprobs(model, prompt), atol=1e-4, rtol=0)
        for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert max(top.values()) >= value - 1e-6  # the argmax is among them


@pytest.mark.parametrize("bad", [512, -1, 2**63, 2**64 + 5, 10**30])
def test_out_of_vocabulary_ids_are_a_400_in_every_dialect(client, bad):
    for path, body in (
            ("/v1/completions", {"prompt": [5, bad], "max_tokens": 1}),
            ("/v1/completions", {"prompt": [[5], [bad]], "max_tokens": 1, "echo": True}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [bad]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "stop_token_ids": [bad]}),
            ("/detokenize", {"tokens": [bad]}),
            ("/v2/models/tiny/generate", {"text_input": "hi", "end_id": bad}),
            ("/v2/models/tiny/generate", {"text_input": "hi", "pad_id": bad})):
        r = client.post(path, content=json.dumps(body))
        assert r.status_code == 400, (path, body, r.text)
        assert "error" in r.json()


def test_tokenizer_routes_in_vllms_shapes(client, tokenizer):
    info = client.get("/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"]) == ("</s>", "<s>")  # as the model spells them
    assert info["eos_token_id"] == tokenizer.eos_id and "chat_template" in info
    tokens = client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert tokens["tokens"] == tokenizer.encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    with_bos = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert with_bos == tokenizer.encode(PROMPT, bos=True)
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][0] == tokenizer.bos_id
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}


def test_tokenize_takes_special_token_spellings_as_their_ids(client, tokenizer):
    info = client.get("/tokenizer_info").json()
    for name in ("eos", "bos"):
        tokens = client.post("/tokenize", json={"prompt": info[f"{name}_token"],
                                                "add_special_tokens": False}).json()["tokens"]
        assert tokens == [info[f"{name}_token_id"]] == [getattr(tokenizer, f"{name}_id")]
    text = f"ab{info['eos_token']}cd"
    tokens = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert tokens["tokens"] == tokenizer.encode("ab") + [tokenizer.eos_id] + tokenizer.encode("cd")
