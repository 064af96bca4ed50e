"""Hugging Face import/export against the real transformers models, built locally.

Random-weight GPT-2, Llama (grouped-query, untied), Nemotron (partial rotary) and Qwen3 (per-head
q/k norm, head_dim != hidden / heads) models are saved with `save_pretrained`, imported with
`tessera convert --from hf`, and must give HF's logits and loss; exporting back must give HF's
own tensors bit for bit, an equal config, and a directory transformers loads (sharded or not).
Nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.converters.cli import main  # noqa: E402
from tessera.converters.hf_io import open_hf_dir  # noqa: E402
from tessera.converters.hf_mapping import (  # noqa: E402
    ConversionError,
    config_from_hf,
    import_tensors,
)
from tessera.core.checkpoint import load_checkpoint, read_manifest  # noqa: E402

VOCAB, MAX_POS = 1000, 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
               max_position_embeddings=MAX_POS)


_FAMILIES = {
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_positions=MAX_POS, n_embd=64, n_layer=2,
                                n_head=4, bos_token_id=999, eos_token_id=999)),
    "llama": ("LlamaConfig", dict(**_COMMON, intermediate_size=160, num_hidden_layers=3,
                                  num_key_value_heads=2, tie_word_embeddings=False,
                                  rope_theta=500000.0)),
    "mistral": ("MistralConfig", dict(**_COMMON, intermediate_size=128, num_hidden_layers=2,
                                      num_key_value_heads=2)),
    "nemotron": ("NemotronConfig", dict(**_COMMON, intermediate_size=256, num_hidden_layers=2,
                                        num_key_value_heads=2, partial_rotary_factor=0.5)),
    # Qwen3: per-head q/k RMSNorm (ModelConfig.qk_norm), head_dim != hidden / heads.
    "qwen3": ("Qwen3Config", dict(**_COMMON, intermediate_size=96, num_hidden_layers=2,
                                  num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5)),
}


def _hf_config(family: str, **overrides):
    cls, fields = _FAMILIES[family]
    return getattr(transformers, cls)(**{**fields, **overrides})


@torch.no_grad()
def _hf_model(family: str, **overrides):
    """A random fp32 model in eval mode; every weight, norm and bias perturbed, so a swapped or
    dropped tensor shows in the logits."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(family, **overrides))
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
    return model.float().eval()


def _ids(batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _max_logit_diff(hf_model, tessera_model, ids: torch.Tensor) -> float:
    return (hf_model(ids).logits - tessera_model(ids)).abs().max().item()


def _train_tokenizer(path: Path):
    from tessera.core.tokenizer import train_tokenizer

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    gen = torch.Generator().manual_seed(0)
    texts = [" ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=gen))
             for _ in range(300)]
    return train_tokenizer([], 300, path, texts=texts)


def _convert(*argv: str) -> None:
    assert main([*map(str, argv)]) == 0


@pytest.fixture(scope="module", params=["gpt2", "llama", "nemotron", "qwen3"])
def imported(request, tmp_path_factory):
    """(family, HF model, root) with `root/hf` saved by transformers, `root/ckpt` imported."""
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    model = _hf_model(family)
    model.save_pretrained(root / "hf")
    _convert("--from", "hf", "--input", root / "hf", "--output", root / "ckpt")
    return family, model, root


def test_logits_and_loss_match_hf(imported):
    family, hf_model, root = imported
    model = load_checkpoint(root / "ckpt")
    ids = _ids()
    assert _max_logit_diff(hf_model, model, ids) <= 1e-4, family
    # HF shifts `labels` inside; Tessera takes the already-shifted targets.
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    with torch.no_grad():
        hf_loss = hf_model(ids, labels=ids).loss
        loss = model(ids, labels=targets)
    assert abs(hf_loss.item() - loss.item()) <= 1e-5
    manifest = read_manifest(root / "ckpt")
    assert (manifest.layout.tp, manifest.layout.pp, manifest.dtype) == (1, 1, "float32")


def test_export_round_trip_is_bit_exact(imported):
    family, hf_model, root = imported
    _convert("--to", "hf", "--input", root / "ckpt", "--output", root / "out")
    original, exported = open_hf_dir(root / "hf"), open_hf_dir(root / "out")
    assert exported.names == original.names  # incl. no lm_head.weight when tied (GPT-2)
    for name in original.names:
        assert torch.equal(exported.read(name), original.read(name)), name
    a = transformers.AutoConfig.from_pretrained(root / "hf").to_dict()
    b = transformers.AutoConfig.from_pretrained(root / "out").to_dict()
    a.pop("_name_or_path"), b.pop("_name_or_path")
    assert a == b
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(root / "out").eval()
    with torch.no_grad():
        ids = _ids()
        diff = (reloaded(ids).logits - hf_model(ids).logits).abs().max().item()
    assert diff <= 1e-4, family


@pytest.mark.parametrize("imported", ["llama"], indirect=True)
def test_sharded_export_loads_and_output_is_not_overwritten(imported, capsys):
    family, hf_model, root = imported
    out = root / "sharded"
    _convert("--to", "hf", "--input", root / "ckpt", "--output", out, "--shard-size", "100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(_ids()).logits, hf_model(_ids()).logits)
    # An existing output is refused unless --overwrite, and left as it was.
    before = sorted(p.name for p in out.iterdir())
    assert main(["--to", "hf", "--input", str(root / "ckpt"), "--output", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before
    _convert("--to", "hf", "--input", root / "ckpt", "--output", out, "--overwrite")
    assert (out / "model.safetensors").is_file() and not (out / files[0]).exists()


@pytest.mark.parametrize("imported", ["nemotron"], indirect=True)
def test_bf16_import_casts_every_tensor(imported):
    family, hf_model, root = imported
    _convert("--from", "hf", "--input", root / "hf", "--output", root / "bf16", "--dtype", "bf16")
    assert read_manifest(root / "bf16").dtype == "bfloat16"
    model = load_checkpoint(root / "bf16")
    emb = hf_model.get_input_embeddings().weight
    assert torch.equal(model.tok_embeddings.weight, emb.to(torch.bfloat16))


@pytest.mark.parametrize("window", [None, 4096])
def test_mistral_without_a_real_sliding_window_imports(tmp_path, window):
    hf_model = _hf_model("mistral", sliding_window=window)
    hf_model.save_pretrained(tmp_path / "hf")
    _convert("--from", "hf", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt")
    model = load_checkpoint(tmp_path / "ckpt")
    assert model.config.family == "llama"
    assert model.config.sliding_window is None  # covering every position: no window to mask
    assert _max_logit_diff(hf_model, model, _ids()) <= 1e-4


def test_pytorch_model_bin_imports(tmp_path):
    hf_model = _hf_model("llama")
    hf_model.config.save_pretrained(tmp_path / "hf")
    torch.save(hf_model.state_dict(), tmp_path / "hf" / "pytorch_model.bin")  # the pre-v5 format
    _convert("--from", "hf", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt")
    assert _max_logit_diff(hf_model, load_checkpoint(tmp_path / "ckpt"), _ids()) <= 1e-4


def test_tokenizer_is_carried_and_loads_with_autotokenizer(tmp_path):
    from tessera.core.tokenizer import load_tokenizer

    hf_dir = tmp_path / "hf"
    _hf_model("llama").save_pretrained(hf_dir)
    tok = _train_tokenizer(hf_dir / "tokenizer.model")
    _convert("--from", "hf", "--input", hf_dir, "--output", tmp_path / "ckpt")
    assert read_manifest(tmp_path / "ckpt").tokenizer == "tokenizer.model"
    _convert("--to", "hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "out")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (tok.bos_id, tok.eos_id)
    for text in ["alpha beta gamma.", "  two  spaces, Ünïcode ✓ 123\nand a new line", "x"]:
        ids = tok.encode(text)
        assert hf_tok.encode(text, add_special_tokens=False) == ids, text
        assert hf_tok.decode(ids) == text
    assert load_tokenizer(tmp_path / "out" / "tokenizer.model").encode("alpha") == tok.encode(
        "alpha")


@pytest.mark.parametrize("with_config", [True, False])
def test_tokenizer_json_round_trip(tmp_path, with_config):
    """An HF dir with only a tokenizer.json: carried through, with or without its config."""
    from tessera.converters.hf_io import sentencepiece_to_tokenizer_json
    from tessera.core.tokenizer import load_tokenizer

    sp = _train_tokenizer(tmp_path / "sp.model")
    hf_dir = tmp_path / "hf"
    _hf_model("gpt2", n_layer=1).save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_text(sentencepiece_to_tokenizer_json(tmp_path / "sp.model"))
    if with_config:
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                      "eos_token": "</s>", "chat_template": "{{ messages }}"}
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(tok_config))
    _convert("--from", "hf", "--input", hf_dir, "--output", tmp_path / "ckpt")
    assert read_manifest(tmp_path / "ckpt").tokenizer == "tokenizer.json"
    assert load_tokenizer(tmp_path / "ckpt" / "tokenizer.json").eos_id == sp.eos_id
    _convert("--to", "hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "out")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf_tok.encode("gamma delta", add_special_tokens=False) == sp.encode("gamma delta")
    assert hf_tok.eos_token == "</s>"
    assert (hf_tok.chat_template is not None) == with_config  # the HF config is kept verbatim


def test_unsupported_architecture_is_named(tmp_path, capsys):
    # (OPT is not supported.)
    transformers.OPTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                           ffn_dim=64).save_pretrained(tmp_path / "opt")
    assert main(["--from", "hf", "--input", str(tmp_path / "opt"), "--output",
                 str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err
    assert "'opt'" in err and "gpt2, llama, mistral, nemotron" in err
    assert not (tmp_path / "ckpt").exists()


def test_missing_config_or_weights_are_named(tmp_path, capsys):
    _hf_config("llama").save_pretrained(tmp_path / "hf")
    assert main(["--from", "hf", "--input", str(tmp_path / "hf"), "--output",
                 str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err
    assert "has no weights" in err and "model.safetensors" in err
    with pytest.raises(ConversionError, match="config.json is missing"):
        open_hf_dir(tmp_path)
    assert not (tmp_path / "ckpt").exists()


def test_unknown_or_missing_hf_tensors_are_refused():
    hf_model = _hf_model("llama")
    state = hf_model.state_dict()
    config = config_from_hf(hf_model.config.to_dict())
    extra = {*state, "model.layers.0.self_attn.q_norm.weight"}
    with pytest.raises(ConversionError, match="q_norm"):
        next(import_tensors(config, state.__getitem__, extra))
    with pytest.raises(ConversionError, match="lack model.layers.1.mlp.up_proj.weight"):
        next(import_tensors(config, state.__getitem__,
                            set(state) - {"model.layers.1.mlp.up_proj.weight"}))


def test_config_fields_and_their_errors():
    base = _hf_config("llama").to_dict()
    legacy = {k: v for k, v in base.items() if k != "rope_parameters"}
    legacy["rope_theta"] = 1234.0  # transformers v4 configs: top-level fields
    assert config_from_hf(legacy).rope_theta == 1234.0
    nemotron = {k: v for k, v in _hf_config("nemotron").to_dict().items()
                if k != "rope_parameters"}
    assert config_from_hf({**nemotron, "partial_rotary_factor": 0.25}).rotary_fraction == 0.25
    assert config_from_hf(nemotron).rotary_fraction == 0.5  # transformers' Nemotron default
    cases = {
        # (llama3, linear, dynamic, yarn, longrope are read: test_hf_rope.py)
        "rope type 'proportional'": {"rope_parameters": {"rope_type": "proportional",
                                                         "rope_theta": 1.0, "factor": 8.0}},
        "'linear' needs rope_scaling.factor": {"rope_parameters": None,
                                               "rope_scaling": {"type": "linear"}},
        "mlp_bias=False": {"attention_bias": True},
        "hidden_act='gelu'": {"hidden_act": "gelu"},
    }
    for message, change in cases.items():
        with pytest.raises(ConversionError, match=message.replace("(", r"\(")):
            config_from_hf({**base, **change})
    mistral = _hf_config("mistral", sliding_window=16).to_dict()
    assert config_from_hf(mistral).sliding_window == 16  # (test_hf_sliding_window)


def test_cli_help_has_examples_and_requires_a_direction(tmp_path, capsys):
    assert main(["--input", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "tessera convert --from hf" in out and "--virtual-stages" in out


def test_export_refuses_a_model_hf_cannot_express(tmp_path, capsys):
    from tessera.core.checkpoint import save_checkpoint
    from tessera.core.config import ModelConfig
    from tessera.core.init import build_model

    config = ModelConfig.from_name("llama-tiny", norm="layernorm")  # Llama has RMSNorm only
    save_checkpoint(tmp_path / "ckpt", build_model(config))
    assert main(["--to", "hf", "--input", str(tmp_path / "ckpt"), "--output",
                 str(tmp_path / "out")]) == 1
    assert "'norm': 'layernorm'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    shutil.rmtree(tmp_path / "ckpt")


def test_native_checkpoint_exports_with_tokenizer_ids(tmp_path):
    """A checkpoint Tessera trained itself (no HF provenance) exports and loads in HF."""
    from tessera.core.checkpoint import save_checkpoint
    from tessera.core.config import ModelConfig
    from tessera.core.init import build_model
    tok = _train_tokenizer(tmp_path / "tok.model")
    model = build_model(ModelConfig.from_name("gpt2-tiny"), seed=3)
    save_checkpoint(tmp_path / "ckpt", model, tokenizer=tmp_path / "tok.model")
    _convert("--to", "hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 512, (2, 16))
    assert _max_logit_diff(hf_model, model.eval(), ids) <= 1e-4
    assert Path(tmp_path / "out" / "generation_config.json").is_file()
