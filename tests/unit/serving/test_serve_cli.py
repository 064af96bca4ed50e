"""`tessera serve`: builds the engine from a checkpoint and hands it to uvicorn (both stubbed
here: no port is opened, and the HTTP app is a stand-in)."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch
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


def test_serve_builds_the_engine_and_runs_uvicorn(checkpoint, monkeypatch):
    seen = {}
    app_module = types.ModuleType("tessera.serving.http.app")

    def create_app(engine, *, model_name, api_key=None, model_aliases=(), **limits):
        seen.update(engine=engine, model_name=model_name, api_key=api_key, aliases=model_aliases)
        return "the-app"

    def run(server):
        seen["config"] = server.config
        seen["alive"] = seen["engine"].alive
        seen["http_thread"] = threading.current_thread().name
        server.started = True

    app_module.create_app = create_app
    monkeypatch.setitem(sys.modules, "tessera.serving.http.app", app_module)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["--checkpoint", str(checkpoint), "--api-key", "k", "--max-batch", "2"]) == 0
    engine = seen["engine"]
    assert seen["config"].host == "127.0.0.1" and seen["config"].port == 8000
    # Served as "tessera" (the README's examples), and under the directory's name too.
    assert (seen["model_name"], seen["aliases"], seen["api_key"]) == ("tessera", ("tiny-ckpt",), "k")
    assert engine.tokenizer is not None and engine.max_batch == 2 and seen["alive"]
    assert not engine.alive  # shut down when the server returned
    # The step loop ran on the main thread (see serving.engine), uvicorn on a helper thread.
    assert seen["http_thread"] == "tessera-http" and not engine.background


def test_serve_exits_1_and_stops_the_engine_when_uvicorn_cannot_start(checkpoint, monkeypatch):
    seen = {}
    app_module = types.ModuleType("tessera.serving.http.app")
    app_module.create_app = lambda engine, **kwargs: seen.update(engine=engine) or "the-app"
    monkeypatch.setitem(sys.modules, "tessera.serving.http.app", app_module)

    def run(server):  # what uvicorn does when the port is taken
        raise SystemExit(1)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["--checkpoint", str(checkpoint)]) == 1
    assert not seen["engine"].alive


@pytest.mark.parametrize("extra, message", [
    (["--tp", "2"], "world has 1"),
    (["--nproc-per-node", "2", "--tp", "4"], "does not match"),
])
def test_serve_reports_bad_layouts(checkpoint, capsys, extra, message):
    assert main(["--checkpoint", str(checkpoint), *extra]) == 2
    assert message in capsys.readouterr().err


def test_serve_reports_a_missing_checkpoint(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "nope")]) == 2
    assert "not a Tessera checkpoint" in capsys.readouterr().err


def test_serve_quantize_int8_loads_int8_weights(checkpoint, monkeypatch):
    from tessera.core.quantize import Int8

    seen = {}
    app_module = types.ModuleType("tessera.serving.http.app")
    app_module.create_app = lambda engine, **kwargs: seen.update(engine=engine) or "the-app"
    monkeypatch.setitem(sys.modules, "tessera.serving.http.app", app_module)

    def run(server):
        model = seen["engine"].executor.runner.stages[0]
        seen["int8"] = sum(isinstance(getattr(m, "format", None), Int8) for m in model.modules())
        seen["dtype"] = seen["engine"].executor.runner.dtype
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["--checkpoint", str(checkpoint), "--quantize", "int8"]) == 0
    assert seen["int8"] > 0 and seen["dtype"] == torch.bfloat16


def test_serve_quantize_fp8_loads_fp8_weights_and_reports_the_logit_error(checkpoint,
                                                                          monkeypatch, capsys):
    from tessera.core.fp8 import Fp8

    seen = {}
    app_module = types.ModuleType("tessera.serving.http.app")
    app_module.create_app = lambda engine, **kwargs: seen.update(engine=engine) or "the-app"
    monkeypatch.setitem(sys.modules, "tessera.serving.http.app", app_module)

    def run(server):
        model = seen["engine"].executor.runner.stages[0]
        seen["fp8"] = sum(isinstance(getattr(m, "format", None), Fp8) for m in model.modules())
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["--checkpoint", str(checkpoint), "--quantize", "fp8", "--compile", "auto"]) == 0
    assert seen["fp8"] == 4 * 2  # wqkv, wo, w1, w2 of both blocks
    err = capsys.readouterr().err
    assert "tessera serve: fp8 weights (W8A16: " in err and "logit error vs the unquantized" in err, err
    assert "compiling" not in err


def test_serve_quantize_choices_are_core_quantizes():
    from tessera.core.quantize import QUANTIZE_CHOICES
    from tessera.serving.cli import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "quantize")
    assert tuple(action.choices) == QUANTIZE_CHOICES


def test_serve_refuses_fp8_with_compile(checkpoint, capsys):
    assert main(["--checkpoint", str(checkpoint), "--quantize", "fp8", "--compile"]) == 2
    assert "--quantize fp8 runs the eager decode step: drop --compile" in capsys.readouterr().err


def test_serve_refuses_int8_with_another_dtype(checkpoint, capsys):
    assert main(["--checkpoint", str(checkpoint), "--quantize", "int8", "--dtype", "fp32"]) == 2
    assert "computes in bf16" in capsys.readouterr().err


@pytest.mark.parametrize("extra, kind, blocks", [
    ([], "paged", 8 * (256 // 16) + 1),  # the memory 8 whole-context slots would take
    (["--kv-cache-memory", "1MiB", "--kv-block-size", "8"], "paged", (1 << 20) // (2 * 2 * 2 * 8 * 16 * 4)),
    (["--kv-cache", "slots"], "slots", None),
])
def test_serve_kv_cache_flags(checkpoint, monkeypatch, extra, kind, blocks):
    from tessera.core.kv_cache import KVCache

    seen = {}
    app_module = types.ModuleType("tessera.serving.http.app")
    app_module.create_app = lambda engine, **kwargs: seen.update(engine=engine) or "the-app"
    monkeypatch.setitem(sys.modules, "tessera.serving.http.app", app_module)

    def run(server):
        seen["cache"] = seen["engine"].executor.runner.cache
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["--checkpoint", str(checkpoint), *extra]) == 0
    cache = seen["cache"]
    if kind == "slots":
        assert isinstance(cache, KVCache) and cache.num_slots == 8
    else:
        assert cache.num_blocks == blocks and seen["engine"].blocks.num_blocks == blocks


def test_serve_refuses_a_bad_kv_cache_memory(checkpoint, capsys):
    assert main(["--checkpoint", str(checkpoint), "--kv-cache-memory", "3 parsecs"]) == 2
    assert "--kv-cache-memory" in capsys.readouterr().err


def test_serve_takes_eos_ids_and_sampling_from_the_generation_config(checkpoint, monkeypatch):
    import json

    (checkpoint / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [7, 9, 11], "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    seen = {}
    app_module = types.ModuleType("tessera.serving.http.app")

    def create_app(engine, *, sampling_defaults=None, **rest):
        seen.update(engine=engine, defaults=sampling_defaults)
        return "the-app"

    def run(server):
        server.started = True

    app_module.create_app = create_app
    monkeypatch.setitem(sys.modules, "tessera.serving.http.app", app_module)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["--checkpoint", str(checkpoint)]) == 0
    assert seen["defaults"] == {"temperature": 0.6, "top_p": 0.9}
    engine = seen["engine"]
    assert (engine.eos_id, engine.requests.eos_stop_ids) == (7, frozenset({9, 11}))
