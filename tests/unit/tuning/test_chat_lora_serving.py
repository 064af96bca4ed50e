"""A chat-tuned LoRA adapter, end to end through the command line and the OpenAI SDK.

A tiny random Llama is built in transformers with a Qwen2.5-style chat template and imported
(`tessera convert --from hf`); `tessera tune --method lora` learns word-reversal conversations;
`tessera convert --to peft` exports the adapter, which peft loads and merges
(`merge_and_unload`). `tessera serve --lora` (a real process) answers a held-out conversation
through `openai`'s `chat.completions` (greedy); transformers' `generate` on the merged model,
prompted by `apply_chat_template`, must give the same tokens with the same logprobs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tessera.serving.http.token_text import TokenTexts
from tests.unit.tuning.chat_fixtures import QWEN25, hf_tokenizer, raw_tokenizer
from tests.unit.tuning.tuning_helper import tune_argv

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[3]
N_NEW = 16
WORDS = "alpha beta gamma delta parse decode value error object string".split()
HELD_OUT = [{"role": "system", "content": "Reverse the words."},
            {"role": "user", "content": "string delta alpha value"}]


def _conversations(n: int) -> list[dict]:
    rng = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(n):
        pick = [WORDS[int(k)] for k in torch.randint(len(WORDS), (4,), generator=rng)]
        rows.append({"messages": [
            {"role": "system", "content": "Reverse the words."},
            {"role": "user", "content": " ".join(pick)},
            {"role": "assistant", "content": " ".join(reversed(pick))}]})
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """The HF model with its chat template, its Tessera import, a tuned adapter, its PEFT form."""
    from tessera.__main__ import main

    root = tmp_path_factory.mktemp("chat-lora")
    raw = raw_tokenizer(QWEN25)
    tokenizer = hf_tokenizer(QWEN25, raw)
    config = transformers.LlamaConfig(
        vocab_size=raw.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so nothing is trivially symmetric
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root / "hf")
    tokenizer.save_pretrained(root / "hf")
    assert main(["convert", "--from", "hf", "--input", str(root / "hf"),
                 "--output", str(root / "base"), "--dtype", "fp32"]) == 0
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _conversations(64)))
    assert main(["tune", *tune_argv(
        root / "base", root / "run", data, None, "--method", "lora", "--lora-rank", "8",
        "--lora-alpha", "16", "--lora-targets", "all", "--lr", "1e-2", "--global-batch", "8",
        "--steps", "40", "--seed", "1")]) == 0
    adapter = root / "run" / "adapter"
    assert main(["convert", "--to", "peft", "--input", str(adapter), "--checkpoint",
                 str(root / "base"), "--output", str(root / "peft")]) == 0
    return {"root": root, "base": root / "base", "adapter": adapter, "peft": root / "peft",
            "hf": root / "hf"}


@pytest.fixture(scope="module")
def merged(world):
    """transformers' model with peft's adapter merged into it, and the HF tokenizer."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(world["hf"], dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, world["peft"]).merge_and_unload().eval()
    return model, transformers.AutoTokenizer.from_pretrained(world["hf"])


@pytest.fixture(scope="module")
def server(world):
    """`tessera serve --lora chat=ADAPTER` in its own process; yields its base URL."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tessera", "serve", "--checkpoint", str(world["base"]),
         "--served-model-name", "tiny", "--lora", f"chat={world['adapter']}",
         "--port", str(port), "--device", "cpu", "--compile", "off", "--log-level", "error"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            assert process.poll() is None, f"tessera serve exited with {process.returncode}"
            assert time.monotonic() < deadline, "tessera serve did not come up in 180 s"
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def test_the_peft_export_of_the_chat_adapter_loads_in_peft_with_every_module(world):
    hf = transformers.AutoModelForCausalLM.from_pretrained(world["hf"], dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, world["peft"])
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
               if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"}
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert b and all(p.abs().max() > 0 for p in b)  # trained: B left zero


def test_the_served_chat_adapter_answers_as_the_merged_model_in_transformers(server, merged):
    model, tokenizer = merged
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny:chat", messages=HELD_OUT, max_tokens=N_NEW, temperature=0, logprobs=True,
        extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    served = [(t.token, t.logprob) for t in choice.logprobs.content]

    prompt = tokenizer.apply_chat_template(HELD_OUT, add_generation_prompt=True,
                                           return_dict=False)
    model.generation_config.eos_token_id = None  # as ignore_eos: the end of turn does not stop
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    ids = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(s[0].log_softmax(-1)[i]) for s, i in zip(out.scores, ids)]
    texts = TokenTexts(lambda t: tokenizer.decode(t), prompt).texts(ids, final=True)

    assert len(ids) == N_NEW and len(set(ids)) >= 4, ids  # not a constant answer
    assert [t for t, _ in served] == texts
    assert choice.message.content == tokenizer.decode(ids)
    assert [lp for _, lp in served] == pytest.approx(logprobs, abs=1e-4)
    assert reply.usage.prompt_tokens == len(prompt)
    base = client.chat.completions.create(model="tiny", messages=HELD_OUT, max_tokens=N_NEW,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert base.choices[0].message.content != choice.message.content  # the adapter mattered
