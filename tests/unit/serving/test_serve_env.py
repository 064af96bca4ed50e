"""`tessera serve` takes its checkpoint and bind address from the environment too, as the
Docker image sets them: overriding the image's command keeps `--host 0.0.0.0`, and an image
run with nothing mounted says what to do."""

from __future__ import annotations

import sys
import types

import pytest
import uvicorn

from tessera.core import ModelConfig, build_model
from tessera.core.checkpoint import save_checkpoint
from tessera.serving.cli import main
from tests.serving_helper import train_tiny_tokenizer


@pytest.fixture
def checkpoint(tmp_path):
    train_tiny_tokenizer(tmp_path)
    model = build_model(ModelConfig.from_name("llama-tiny"), seed=0)
    return save_checkpoint(tmp_path / "tiny-ckpt", model, tokenizer=tmp_path / "tokenizer.model")


def test_host_and_checkpoint_come_from_the_environment(checkpoint, monkeypatch):
    seen = {}
    app_module = types.ModuleType("tessera.serving.http.app")
    app_module.create_app = lambda engine, *, model_name, **kw: seen.update(name=model_name)

    def run(server):
        seen["config"] = server.config
        server.started = True

    monkeypatch.setitem(sys.modules, "tessera.serving.http.app", app_module)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setenv("TESSERA_HOST", "0.0.0.0")
    monkeypatch.setenv("TESSERA_CHECKPOINT", str(checkpoint))
    assert main(["--port", "9000"]) == 0  # a command given in place of the image's default
    assert (seen["config"].host, seen["config"].port, seen["name"]) == ("0.0.0.0", 9000,
                                                                        "tessera")
    assert main(["--host", "127.0.0.1"]) == 0  # a flag still wins
    assert seen["config"].host == "127.0.0.1"


def test_nothing_mounted_at_the_env_checkpoint_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TESSERA_CHECKPOINT", str(tmp_path / "models" / "ckpt"))
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint at" in err and "$TESSERA_CHECKPOINT" in err and "-v" in err, err


def test_without_the_environment_the_checkpoint_is_required(monkeypatch, capsys):
    monkeypatch.delenv("TESSERA_CHECKPOINT", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2 and "--checkpoint" in capsys.readouterr().err
