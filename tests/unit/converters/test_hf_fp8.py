"""FP8 Hugging Face export and import against transformers' own loaders (nothing downloaded).

A random Llama (grouped-query, untied) is saved by transformers, imported, exported with
`--to hf --fp8 block|tensor`, and loaded by `AutoModelForCausalLM.from_pretrained` on CPU, where
transformers dequantizes (FineGrainedFP8 on its own without a GPU, compressed-tensors with
`dequantize=True`). Its logits and weights must equal those of the Tessera checkpoint imported
back from the same directory, bit for bit; the weights must sit within FP8's rounding of the
originals (which a scale stored as a divisor instead of a multiplier would miss by far).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from tessera.converters.cli import main  # noqa: E402
from tessera.converters.hf_fp8 import dequantize_hf  # noqa: E402
from tessera.converters.hf_mapping import export_tensors  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402

VOCAB, BLOCK = 1000, 32
# q 64x64, k/v 32x64, o 64x64, gate/up 160x64, down 64x160: 32 divides all, 64 does not.
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=160, num_hidden_layers=2, max_position_embeddings=128,
             tie_word_embeddings=False)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _convert(*argv) -> None:
    assert main([*map(str, argv)]) == 0


def _text(n: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=gen))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """`root/hf` (transformers' random Llama with a tokenizer) and `root/ckpt` (imported)."""
    from tessera.core.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("hf-fp8")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.float().save_pretrained(root / "hf")
    train_tokenizer([], 300, root / "hf" / "tokenizer.model",
                    texts=[_text(12, seed) for seed in range(200)])
    _convert("--from", "hf", "--input", root / "hf", "--output", root / "ckpt")
    return root


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def _hf_load(path: Path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             **kwargs).eval()


def _check_against_transformers(root: Path, out: Path, **load_kwargs) -> None:
    """transformers' dequantized model == Tessera's import of `out`, logits and weights; the
    weights are within FP8 rounding of the originals."""
    hf = _hf_load(out, **load_kwargs)
    _convert("--from", "hf", "--input", out, "--output", out.with_name(out.name + "-back"))
    back = load_checkpoint(out.with_name(out.name + "-back"))
    with torch.no_grad():
        assert torch.equal(hf(_ids()).logits, back(_ids()))
    original = _hf_load(root / "hf").state_dict()
    hf_state = hf.state_dict()
    for i in range(LLAMA["num_hidden_layers"]):
        for leaf in LINEARS:
            name = f"model.layers.{i}.{leaf}.weight"
            w, ref = hf_state[name], original[name]
            assert w.dtype == torch.float32 and not torch.equal(w, ref), name  # quantized
            # e4m3 keeps 3 mantissa bits: relative rounding error at most 2^-4 of the block
            # amax; a reciprocal scale would be off by orders of magnitude.
            assert (w - ref).abs().max() <= ref.abs().max() / 16, name
    # Export -> import gives the dequantized weights exactly (Tessera fuses q/k/v, gate/up).
    layer = back.layers["0"]
    qkv = torch.cat([hf_state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.attention.wqkv.weight, qkv)
    assert torch.equal(layer.feed_forward.w2.weight, hf_state["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(back.tok_embeddings.weight, original["model.embed_tokens.weight"])


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


SKIPPED = ["model.embed_tokens", "model.layers.0.input_layernorm",
           "model.layers.0.post_attention_layernorm", "model.layers.1.input_layernorm",
           "model.layers.1.post_attention_layernorm", "model.norm", "lm_head"]


def test_block_export_loads_in_transformers(root):
    out = root / "block"
    _convert("--to", "hf", "--fp8", "block", "--fp8-block", BLOCK, "--input", root / "ckpt",
             "--output", out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "activation_scheme": "dynamic",
                  "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": SKIPPED}
    t = _tensors(out)
    k = t["model.layers.0.self_attn.k_proj.weight"]
    assert k.dtype == torch.float8_e4m3fn and k.shape == (32, 64)
    s = t["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    assert s.dtype == torch.float32 and s.shape == (1, 2)
    assert t["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (2, 5)
    assert t["model.embed_tokens.weight"].dtype == t["lm_head.weight"].dtype == torch.float32
    assert not any(n.endswith(("input_scale", "weight_scale")) for n in t)
    # transformers' FineGrainedFP8 dequantizes on CPU by itself (no GPU: dequantize=True).
    _check_against_transformers(root, out)
    # Its own dequantization function agrees with ours on the stored tensors.
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q, s = t["model.layers.1.mlp.down_proj.weight"], t["model.layers.1.mlp.down_proj.weight_scale_inv"]
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    assert torch.equal(theirs, dequantize_hf(q, s, (BLOCK, BLOCK)))


def test_tensor_export_dynamic_loads_in_transformers(root):
    pytest.importorskip("compressed_tensors")
    out = root / "tensor"
    _convert("--to", "hf", "--fp8", "tensor", "--input", root / "ckpt", "--output", out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == SKIPPED
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "tensor" and group["input_activations"]["dynamic"]
    t = _tensors(out)
    assert not any(n.endswith("input_scale") for n in t)
    # One scale for q, k and v (vLLM fuses them and would requantize to the largest).
    scales = [t[f"model.layers.0.self_attn.{p}_proj.weight_scale"] for p in "qkv"]
    assert scales[0].shape == (1,) and torch.equal(scales[0], scales[1])
    assert torch.equal(scales[1], scales[2])
    _check_against_transformers(
        root, out, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))


def test_tensor_export_static_calibration(root):
    pytest.importorskip("compressed_tensors")
    text = root / "calib.txt"
    text.write_text(_text(35, seed=1000))
    out = root / "static"
    _convert("--to", "hf", "--fp8", "tensor", "--calibration-data", text, "--input",
             root / "ckpt", "--output", out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] is False
    # The reference: each HF linear's input amax in transformers' own fp32 model (one window).
    from tessera.core.tokenizer import load_tokenizer

    ids = load_tokenizer(root / "ckpt" / "tokenizer.model").encode(text.read_text())
    assert 0 < len(ids) <= LLAMA["max_position_embeddings"]
    original = _hf_load(root / "hf")
    amax: dict[str, float] = {}
    hooks = [module.register_forward_pre_hook(
        lambda m, args, name=name: amax.__setitem__(name, args[0].abs().max().item()))
        for name, module in original.named_modules() if name.endswith(LINEARS)]
    with torch.no_grad():
        original(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    t = _tensors(out)
    assert len(amax) == 14 and sum(n.endswith("input_scale") for n in t) == 14
    for name, value in amax.items():
        scale = t[f"{name}.input_scale"]
        assert scale.dtype == torch.float32 and scale.shape == (1,)
        assert scale.item() == pytest.approx(value / 448, rel=1e-4), name
    _check_against_transformers(
        root, out, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))


def test_import_reads_vllm_per_tensor_fp8(root, tmp_path):
    """quant_method "fp8" per tensor as vLLM reads it (`weight_scale`, `input_scale`)."""
    import shutil

    pytest.importorskip("compressed_tensors")
    src = root / "static"
    if not src.is_dir():
        pytest.skip("needs the static export of the test above")
    shutil.copytree(src, tmp_path / "vllm")
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(config))
    _convert("--from", "hf", "--input", tmp_path / "vllm", "--output", tmp_path / "ckpt")
    a, b = load_checkpoint(tmp_path / "ckpt"), load_checkpoint(root / "static-back")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_dequantize_hf_ragged_blocks_and_errors():
    q = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0], [0.5, 0.25, 1.0]]).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0, 3.0], [5.0, 7.0]])  # 2x2 blocks over a 3x3 weight: ragged edges
    want = torch.tensor([[2.0, 4.0, 12.0], [16.0, 32.0, 96.0], [2.5, 1.25, 7.0]])
    assert torch.equal(dequantize_hf(q, s, (2, 2)), want)
    assert torch.equal(dequantize_hf(q, torch.tensor([0.5]), None), q.float() * 0.5)
    with pytest.raises(ValueError, match="needs a"):
        dequantize_hf(q, s, (3, 3))


def _linear_shapes(ckpt: Path) -> list[tuple[int, ...]]:
    """The shapes of the HF linear weights an FP8 export quantizes."""
    model = load_checkpoint(ckpt)
    state = model.state_dict()
    return [tuple(t.shape) for name, t in export_tensors(model.config, state.__getitem__)
            if name.endswith(tuple(f"{leaf}.weight" for leaf in LINEARS))]


def _fails(capsys, *argv, code: int = 1) -> str:
    assert main([*map(str, argv)]) == code
    return capsys.readouterr().err


def test_bad_input_is_refused_and_nothing_is_written(root, tmp_path, capsys):
    ckpt, out = root / "ckpt", tmp_path / "out"
    err = _fails(capsys, "--to", "hf", "--fp8", "block", "--fp8-block", 64, "--input", ckpt,
                 "--output", out)
    assert "model.layers.0.self_attn.k_proj.weight of shape (32, 64) does not divide into 64x64" in err
    # The sizes suggested divide every layer, and the refused one is not among them.
    assert "--fp8-block 64" not in err
    suggested = [int(b) for b in re.search(r"--fp8-block ([\d, or]+)\)", err).group(1)
                 .replace(" or ", ", ").split(", ")]
    assert suggested and all(b < 64 for b in suggested)
    assert all(d % b == 0 for b in suggested for shape in _linear_shapes(ckpt) for d in shape)
    err = _fails(capsys, "--to", "hf", "--fp8", "block", "--input", ckpt, "--output", out)
    assert "(64, 64) does not divide into 128x128" in err  # the default block
    (tmp_path / "empty.txt").write_text(" \n")
    err = _fails(capsys, "--to", "hf", "--fp8", "tensor", "--calibration-data",
                 tmp_path / "empty.txt", "--input", ckpt, "--output", out)
    assert "empty.txt is empty" in err
    err = _fails(capsys, "--to", "hf", "--fp8", "block", "--fp8-block", BLOCK,
                 "--calibration-data", tmp_path / "empty.txt", "--input", ckpt, "--output", out,
                 code=2)
    assert "only --fp8 tensor" in err
    assert "one scale per tensor" in _fails(capsys, "--to", "hf", "--fp8", "tensor",
                                            "--fp8-block", 16, "--input", ckpt, "--output", out,
                                            code=2)
    assert "Hugging Face format" in _fails(capsys, "--fp8", "block", "--input", ckpt,
                                           "--output", out, code=2)
    assert "go with --to hf --fp8" in _fails(capsys, "--to", "hf", "--fp8-block", 16,
                                             "--input", ckpt, "--output", out, code=2)
    assert not out.exists() and not list(tmp_path.glob(".*out*"))
    # A family whose HF linears are Conv1D (GPT-2) has no FP8 export.
    from tessera.core import ModelConfig, build_model
    from tessera.core.checkpoint import save_checkpoint

    gpt2 = save_checkpoint(tmp_path / "gpt2", build_model(ModelConfig.from_name(
        "gpt2-tiny", vocab_size=128, num_layers=1, max_position_embeddings=32), seed=0))
    err = _fails(capsys, "--to", "hf", "--fp8", "block", "--fp8-block", 16, "--input", gpt2,
                 "--output", out)
    assert "GPT-2 stores its linear layers as Conv1D" in err and not out.exists()
    # Nor a Mixture-of-Experts family (Qwen3-MoE): its experts are not quantized linears.
    moe = save_checkpoint(tmp_path / "moe", build_model(ModelConfig.from_name(
        "qwen3-moe-tiny", num_layers=1, moe={"num_experts": 2}, max_position_embeddings=32), seed=0))
    err = _fails(capsys, "--to", "hf", "--fp8", "block", "--fp8-block", 16, "--input", moe,
                 "--output", out)
    assert "not the Mixture-of-Experts family 'qwen3_moe'" in err and not out.exists()


def test_nemotron_block_export_loads_in_transformers(tmp_path):
    """The other family with an FP8 export (squared-ReLU MLP, LayerNorm1P, partial rotary)."""
    from tessera.core import ModelConfig, build_model
    from tessera.core.checkpoint import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "ckpt", build_model(
        ModelConfig.from_name("nemotron-tiny", num_layers=1), seed=3))
    out = tmp_path / "fp8"
    _convert("--to", "hf", "--fp8", "block", "--fp8-block", 32, "--input", ckpt, "--output", out)
    assert _tensors(out)["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (8, 2)
    hf = _hf_load(out)
    _convert("--from", "hf", "--input", out, "--output", tmp_path / "back")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, load_checkpoint(tmp_path / "back")(ids))


@pytest.mark.parametrize("scheme", ["block", "tensor"])
def test_qwen3_export_loads_in_transformers(tmp_path, scheme):
    """Qwen3 (per-head q/k RMSNorm, head_dim 32 != hidden / heads): the q/k norms stay in the
    export dtype and are listed as not converted; transformers' dequantized model equals
    Tessera's import of the export, its linears within FP8 rounding of the originals."""
    from tessera.core import ModelConfig, build_model
    from tessera.core.checkpoint import save_checkpoint

    if scheme == "tensor":
        pytest.importorskip("compressed_tensors")
    config = ModelConfig(name="fp8-qwen3", family="qwen3", vocab_size=512, hidden_size=64,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
                         ffn_hidden_size=96, max_position_embeddings=64, qk_norm=True)
    model = build_model(config, seed=4)
    torch.manual_seed(4)
    with torch.no_grad():  # norms away from their ones init, so a quantized norm would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ckpt = save_checkpoint(tmp_path / "ckpt", model)
    out = tmp_path / "fp8"
    _convert("--to", "hf", "--fp8", scheme, *(["--fp8-block", 32] if scheme == "block" else []),
             "--input", ckpt, "--output", out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    skipped = qc["modules_to_not_convert" if scheme == "block" else "ignore"]
    norms = ["model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"]
    assert set(norms) <= set(skipped)
    t = _tensors(out)
    state = model.state_dict()
    for hf_name, name in zip(norms, ("q_norm", "k_norm"), strict=True):
        assert torch.equal(t[f"{hf_name}.weight"], state[f"layers.0.attention.{name}.weight"])
    q = t["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (128, 64)
    kwargs = ({} if scheme == "block" else
              dict(quantization_config=transformers.CompressedTensorsConfig(dequantize=True)))
    hf = _hf_load(out, **kwargs)
    _convert("--from", "hf", "--input", out, "--output", tmp_path / "back")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fp8_logits, ref_logits = hf(ids).logits, model(ids)
        assert torch.equal(fp8_logits, load_checkpoint(tmp_path / "back")(ids))
    # Near the fp32 model's: each weight is off by at most 2^-4 of its block's amax, and the
    # errors of the linears in series stay well inside 1/8 of the logits' range (about 1/16).
    assert (fp8_logits - ref_logits).abs().max() <= ref_logits.abs().max() / 8
    hf_state = dict(hf.state_dict())
    original = dict(export_tensors(config, state.__getitem__))
    for name, ref in original.items():
        w = hf_state[name]
        if name.endswith(tuple(f"{leaf}.weight" for leaf in LINEARS)):
            assert not torch.equal(w, ref) and (w - ref).abs().max() <= ref.abs().max() / 16, name
        else:  # embeddings, norms (the q/k norms too), lm_head: not quantized
            assert torch.equal(w, ref), name
