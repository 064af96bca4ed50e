"""`tessera inspect`: plain words and JSON from the manifest alone, clear errors otherwise."""

from __future__ import annotations

import json

import pytest

from tessera.__main__ import main as tessera_main
from tessera.converters.inspect import main
from tessera.converters.reshard import reshard_checkpoint
from tessera.core.parallel.sharding import num_parameters

from .ckpt_factory import CONFIGS, make_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    tok = root / "tok.model"
    tok.write_bytes(b"tokenizer bytes")
    plain = make_checkpoint(root / "plain", CONFIGS["gqa"], step=17, tokenizer=tok)
    fp8 = root / "fp8"
    reshard_checkpoint(plain, fp8, tp=2, pp=2, virtual_stages=2, fp8=True, fp8_per_channel=True,
                       progress=False)
    return plain, fp8


def test_plain_words(checkpoints, capsys):
    plain, fp8 = checkpoints
    assert main([str(plain)]) == 0
    out = capsys.readouterr().out
    params = num_parameters(CONFIGS["gqa"])
    for words in ["llama family", 'preset "gqa-test"', f"{params / 1000:.2f}K parameters",
                  "4 layers", "hidden size 64", "8 attention heads sharing 4 key/value heads",
                  "vocabulary 1003", "tensor parallel 1 x pipeline parallel 1: 1 weight file",
                  "dtype      float32", "FP8        no", "on disk", "step       17",
                  "tokenizer  tokenizer.model"]:
        assert words in out, words
    assert tessera_main(["inspect", str(fp8)]) == 0  # through the verb table
    out = capsys.readouterr().out
    for words in ["tensor parallel 2 x pipeline parallel 2, 2 virtual stages per pipeline rank",
                  "4 weight files", "e4m3 linear-layer weights, one scale per output channel"]:
        assert words in out, words


def test_json(checkpoints, capsys):
    plain, fp8 = checkpoints
    assert main([str(fp8), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == num_parameters(CONFIGS["gqa"])
    assert info["layout"] == {"tp": 2, "pp": 2, "virtual_stages": 2}
    assert info["files"] == [f"model-tp{t:02d}-pp{p:02d}.safetensors" for t in (0, 1) for p in (0, 1)]
    assert info["fp8"] == {"format": "e4m3", "granularity": "channel"}
    assert (info["dtype"], info["step"], info["num_kv_heads"], info["missing_files"]) == (
        "float32", 17, 4, [])
    assert info["size_bytes"] == sum(p.stat().st_size for p in fp8.iterdir())


def test_errors_are_one_clear_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tessera inspect: error:") and "manifest.json is missing" in err
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "tessera-checkpoint",
                                                        "format_version": 99}))
    assert main([str(tmp_path)]) == 1
    assert "format version 99 is not supported" in capsys.readouterr().err
