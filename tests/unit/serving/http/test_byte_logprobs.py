"""`top_logprobs` at byte-fallback tokens (a sentencepiece tokenizer with byte fallback, half
of whose vocabulary is byte pieces): every position lists k distinct alternatives plus the
chosen token, byte pieces that are not text alone under distinct `bytes:\\xNN` keys (with that
byte in chat's `bytes`), never several under one U+FFFD key.

Reference: the tokenizer's own spelling of each token (`<0xNN>` for byte pieces) and the
logprobs the server reports for the chosen tokens.
"""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from tessera.core import ModelConfig, build_model
from tessera.serving.engine import LLMEngine
from tessera.serving.http.app import create_app
from tests.serving_helper import train_tiny_tokenizer

PROMPT = "naïve café 🙂 über 日本 ✓ déjà"
K = 5


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def client(tokenizer):
    model = build_model(ModelConfig.from_name("llama-tiny", init_std=0.1), seed=3).eval()
    with LLMEngine(model, tokenizer, max_batch=4, seed=0) as engine:
        with TestClient(create_app(engine, model_name="tiny")) as c:
            yield c


def _byte(tokenizer, token_id: int) -> int | None:
    match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", tokenizer.token_text(token_id))
    return int(match.group(1), 16) if match else None


def test_completion_top_logprobs_keep_every_byte_alternative_and_the_chosen_token(client,
                                                                                  tokenizer):
    ids = tokenizer.encode(PROMPT, bos=True)
    assert sum(_byte(tokenizer, t) is not None for t in ids) >= 8  # the prompt has byte pieces
    body = {"prompt": ids, "max_tokens": 24, "echo": True, "logprobs": K, "temperature": 1.0,
            "seed": 7, "ignore_eos": True}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    byte_keys = 0
    for i, (token, value, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"],
                                                lp["top_logprobs"])):
        if value is None:
            continue
        assert len(top) >= K, (i, token, top)  # no alternatives lost to a shared key
        assert any(abs(v - value) < 1e-6 for v in top.values()), (i, token, value, top)
        assert "\ufffd" not in "".join(top), (i, top)
        byte_keys += sum(k.startswith("bytes:\\x") for k in top)
    assert byte_keys > 0
    # A chosen byte piece whose text is held back ("") is listed under its bytes key.
    held = [(i, t) for i, t in enumerate(ids) if _byte(tokenizer, t) is not None
            and lp["tokens"][i] == "" and i > 0]
    assert held
    for i, t in held:
        assert f"bytes:\\x{_byte(tokenizer, t):02x}" in lp["top_logprobs"][i], (i, t)


def test_chat_top_logprobs_carry_the_bytes_of_byte_keys(client):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
            "logprobs": True, "top_logprobs": K, "temperature": 1.0, "seed": 3,
            "ignore_eos": True}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"][
        "content"]
    seen = 0
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) >= K and len({t["token"] for t in tops}) == len(tops)
        assert any(abs(t["logprob"] - entry["logprob"]) < 1e-6 for t in tops)
        for t in tops:
            if t["token"].startswith("bytes:\\x"):
                assert t["bytes"] == [int(t["token"][8:10], 16)]
                seen += 1
            elif not t["token"].startswith("token_id:"):
                assert bytes(t["bytes"]).decode() == t["token"]
    assert seen > 0
