"""`tessera generate`: `--stream`, `--stop` and `--chat`, locally and against a server.

References: the same command without the new flag (streaming prints what the one-shot run
prints; a stop string cuts that text before it), and the prompt rendered by the checkpoint's
own chat template run as plain text."""

from __future__ import annotations

import functools

import pytest

import tessera.clients.client as client_module
from tessera.__main__ import generate
from tessera.core import ModelConfig, build_model
from tessera.core.checkpoint import save_checkpoint
from tessera.serving.generate import chat_prompt, generate_text
from tests.serving_helper import train_tiny_tokenizer

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    train_tiny_tokenizer(root)
    model = build_model(ModelConfig.from_name("llama-tiny", init_std=0.1), seed=2)
    path = save_checkpoint(root / "ckpt", model, tokenizer=root / "tokenizer.model")
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def _run(capsys, *argv: str) -> str:
    assert generate([*argv]) == 0
    return capsys.readouterr().out


def test_local_stream_stop_and_chat(checkpoint, capsys):
    base = ["def main", "--checkpoint", str(checkpoint), "--max-tokens", "12"]
    plain = _run(capsys, *base)
    assert _run(capsys, *base, "--stream") == plain and plain.startswith("def main")
    continuation = plain[len("def main"):-1]
    stop = continuation[3:5]
    assert stop and stop in continuation
    expected = continuation[:continuation.index(stop)]
    assert _run(capsys, *base, "--stop", stop, "--stop", "never seen") == f"def main{expected}\n"
    reply = _run(capsys, "hi there", "--chat", "--system", "be brief", "--checkpoint",
                 str(checkpoint), "--max-tokens", "6")
    rendered = chat_prompt(str(checkpoint), "hi there", "be brief")
    assert rendered == "[system] be brief\n[user] hi there\n[assistant]"
    assert reply == generate_text(str(checkpoint), rendered, max_tokens=6) + "\n"


def test_remote_chat_and_stop(make_client, monkeypatch, capsys):
    http = make_client()
    monkeypatch.setattr(client_module, "Client", functools.partial(client_module.Client,
                                                                   http_client=http))
    url = ["--url", "http://testserver"]
    assert _run(capsys, "abc", *url, "--max-tokens", "6") == "abccbacba\n"
    assert _run(capsys, "abc", *url, "--max-tokens", "6", "--stop", "ac") == "abccb\n"
    assert _run(capsys, "x", *url, "--chat", "--max-tokens", "3") == ":tn\n"  # the reply alone
    with pytest.raises(SystemExit):
        generate(["x", *url, "--system", "s"])  # --system needs --chat
