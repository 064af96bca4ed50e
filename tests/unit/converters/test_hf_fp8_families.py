"""FP8 export of the families with fused or extra-normed HF layouts (Phi-3's fused `qkv_proj` and
`gate_up_proj`, OLMo-2's post-sublayer and q/k norms, Gemma 2's four norms and soft-capping, Gemma 3's q/k
norms and local layers, DeepSeek-V2/V3's latent attention and per-expert MoE linears with the
router kept high precision), block and per tensor, against transformers' own FP8 loaders (nothing downloaded).

Each tiny random HF model is imported, exported with `--fp8`, and loaded by transformers, which
dequantizes on CPU: its logits equal those of Tessera's import of the export bit for bit
(DeepSeek-V2: within its fp32 import bound; the dequantized weights are equal), and sit
near the original fp32 model's (each weight is off by at most 2^-4 of its block's amax; the
errors of the linears in series stay well inside 1/8 of the logits' RMS). A fused tensor
carries one scale per tensor (per tensor) or per block of the fused tensor, as vLLM loads it.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from tessera.core.checkpoint import load_checkpoint  # noqa: E402

from . import hf_family_checks as check  # noqa: E402

VOCAB, BLOCK = 256, 16
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               initializer_range=0.1, pad_token_id=0, eos_token_id=2)
CONFIGS = {
    "phi3": lambda: transformers.Phi3Config(**_COMMON, original_max_position_embeddings=64,
                                            sliding_window=None),
    "olmo2": lambda: transformers.Olmo2Config(**_COMMON),
    # Gemma 2's published soft caps (50, 30): a cap near the logits' size would squeeze their
    # range below the 1/8 bound's premise (the bound is on uncapped logits).
    "gemma2": lambda: transformers.Gemma2Config(
        **_COMMON, head_dim=16, sliding_window=64, query_pre_attn_scalar=12,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    # Gemma 3: its q/k norms too, local layers with their own RoPE base and a window.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=100.0),
}
# DeepSeek: layer 0 dense, layer 1 MoE (4 routed experts in 2 groups, one shared). kv_lora_rank
# 16 + qk_rope_head_dim 16 keeps kv_a_proj_with_mqa's 32 rows whole blocks of 16.
_MLA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8, max_position_embeddings=64,
            initializer_range=0.1, pad_token_id=0, eos_token_id=2)
CONFIGS["deepseek_v3"] = lambda: transformers.DeepseekV3Config(**_MLA, q_lora_rank=16)
CONFIGS["deepseek_v2"] = lambda: transformers.DeepseekV2Config(
    **_MLA, q_lora_rank=None, topk_method="group_limited_greedy")
# Tessera's fp32 import of DeepSeek-V2 (complex-form RoPE) matches transformers within 1e-4,
# not bit for bit (test_hf_deepseek.py): its FP8 logits inherit that bound.
ROUNDS_APART = {"deepseek_v2"}
# The HF linears each family stores (Phi-3 fuses q/k/v and gate/up in the file).
LINEARS = {
    "phi3": ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"),
    "olmo2": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
}
LINEARS["gemma2"] = LINEARS["gemma3"] = LINEARS["olmo2"]
_EXPERTS = tuple(f"mlp.{m}.{p}" for m in ("experts.0", "experts.3", "shared_experts")
                 for p in ("gate_proj", "up_proj", "down_proj"))
_MLA_LINEARS = ("self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj")
# Per layer: DeepSeek's layer 0 has a dense MLP, layer 1 experts; the router `mlp.gate` (and
# V3's e_score_correction_bias) is never quantized.
LAYER_LINEARS = {f: (LINEARS[f], LINEARS[f]) for f in LINEARS}
LAYER_LINEARS["deepseek_v3"] = tuple(
    ("self_attn.q_a_proj", "self_attn.q_b_proj", *_MLA_LINEARS, *mlp)
    for mlp in (LINEARS["olmo2"][-3:], _EXPERTS))
LAYER_LINEARS["deepseek_v2"] = tuple(("self_attn.q_proj", *_MLA_LINEARS, *mlp)
                                     for mlp in (LINEARS["olmo2"][-3:], _EXPERTS))


@pytest.fixture(scope="module", params=list(CONFIGS))
def imported(request, tmp_path_factory):
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = check.perturbed(transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()))
    hf.float().save_pretrained(root / "hf")
    check.convert("--from", "hf", "--input", root / "hf", "--output", root / "ckpt")
    return family, hf.eval(), root


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


@pytest.mark.parametrize("scheme", ["block", "tensor"])
def test_fp8_export_loads_in_transformers(imported, scheme):
    family, original, root = imported
    if scheme == "tensor":
        pytest.importorskip("compressed_tensors")
    out = root / f"fp8-{scheme}"
    block = ["--fp8-block", BLOCK] if scheme == "block" else []
    check.convert("--to", "hf", "--fp8", scheme, *block, "--input", root / "ckpt", "--output", out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    skipped = qc["modules_to_not_convert" if scheme == "block" else "ignore"]
    t = _tensors(out)
    quantized = {k.removesuffix(".weight") for k, v in t.items()
                 if v.dtype == torch.float8_e4m3fn}
    linears = {f"model.layers.{i}.{leaf}" for i in range(2) for leaf in LAYER_LINEARS[family][i]}
    assert linears <= quantized and not quantized & set(skipped)
    if family.startswith("deepseek"):  # every linear of the file: all 4 experts, never a router
        assert quantized == linears | {f"model.layers.1.mlp.experts.{e}.{p}" for e in (1, 2)
                                       for p in ("gate_proj", "up_proj", "down_proj")}
        assert "model.layers.1.mlp.gate" in skipped
        if scheme == "tensor":  # one scale per expert, shared by its gate and up (vLLM's w13)
            scale = {e: [t[f"model.layers.1.mlp.experts.{e}.{p}.weight_scale"]
                         for p in ("gate_proj", "up_proj")] for e in range(4)}
            assert all(torch.equal(*pair) for pair in scale.values())
            assert len({pair[0].item() for pair in scale.values()}) == 4
    for i in range(2):
        for leaf in LAYER_LINEARS[family][i]:
            module = f"model.layers.{i}.{leaf}"
            assert t[f"{module}.weight"].dtype == torch.float8_e4m3fn and module not in skipped
            rows, cols = t[f"{module}.weight"].shape
            if scheme == "block":  # one scale per block of the whole (fused) tensor
                assert t[f"{module}.weight_scale_inv"].shape == (rows // BLOCK, cols // BLOCK)
            else:  # one scale for the whole (fused) tensor, as vLLM loads qkv_proj
                assert t[f"{module}.weight_scale"].shape == (1,)
    kwargs = ({} if scheme == "block" else
              dict(quantization_config=transformers.CompressedTensorsConfig(dequantize=True)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                           **kwargs).eval()
    check.convert("--from", "hf", "--input", out, "--output", root / f"back-{scheme}")
    back = load_checkpoint(root / f"back-{scheme}")
    ids = check.ids(VOCAB, 16, batch=2, seed=2)
    with torch.no_grad():
        fp8_logits, ref_logits = hf(ids).logits, original(ids).logits
        if family in ROUNDS_APART:  # the fp32 import's own bound: the same weights, other sums
            assert (fp8_logits - back(ids)).abs().max() <= 1e-4
        else:
            assert torch.equal(fp8_logits, back(ids))
    # Bit for bit the weights transformers dequantized are the ones Tessera imported.
    check.convert("--to", "hf", "--input", root / f"back-{scheme}", "--output", root / f"re-{scheme}")
    again = transformers.AutoModelForCausalLM.from_pretrained(root / f"re-{scheme}",
                                                              dtype=torch.float32)
    assert all(torch.equal(w, again.state_dict()[n]) for n, w in hf.state_dict().items())
    # The rounding errors are independent across weights, so their effect is bounded in RMS
    # (the extreme element of 8k logits wanders further under Gemma 2's and OLMo-2's post-norms).
    rms = lambda x: x.pow(2).mean().sqrt()  # noqa: E731
    assert rms(fp8_logits - ref_logits) <= rms(ref_logits) / 8
    ref_state, state = original.state_dict(), hf.state_dict()
    for name, ref in ref_state.items():
        if _dequantized(name, family):
            w = state[name]
            assert not torch.equal(w, ref) and (w - ref).abs().max() <= ref.abs().max() / 16, name
        elif name in state:  # embeddings, every norm, router, lm_head: not quantized
            assert torch.equal(state[name], ref), name


def _dequantized(name: str, family: str) -> bool:
    """Whether the HF model's parameter `name` was quantized in the export (transformers keeps
    the routed experts of a layer fused as `mlp.experts.gate_up_proj` / `down_proj`)."""
    leaves = {leaf for layer in LAYER_LINEARS[family] for leaf in layer}
    return name.endswith(tuple(f"{leaf}.weight" for leaf in leaves)) or name.endswith(
        ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_calibration_is_refused(family):
    """Calibration records the four block linears' inputs only: a static per-tensor export of
    DeepSeek's latent-attention and expert linears would lack their input scales."""
    from tessera.converters.hf.deepseek import deepseek_config
    from tessera.converters.hf_fp8 import Fp8Export, check_fp8_exportable
    from tessera.converters.hf_mapping import ConversionError

    config = deepseek_config(CONFIGS[family]().to_dict())
    amax = {f"layers.{i}.attention.wo.weight": 1.0 for i in range(2)}
    with pytest.raises(ConversionError, match=r"records the inputs of the wqkv/wo/w1/w2 linears "
                       r"only, not layers\.0\.attention\.w.*--fp8 tensor without"):
        check_fp8_exportable(config, Fp8Export("tensor", input_amax=amax))


def test_deepseek_calibration_is_refused_before_calibrating(tmp_path, monkeypatch, capsys):
    """`tessera convert` refuses it before reading any calibration text (which can take
    minutes): the calibration pass never starts."""
    from tessera.converters import calibrate
    from tessera.converters.cli import main

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS["deepseek_v3"]()).save_pretrained(
        tmp_path / "hf")
    check.convert("--from", "hf", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt")
    (tmp_path / "sample.txt").write_text("some text to calibrate on\n")
    started = []
    monkeypatch.setattr(calibrate, "calibrate_input_amax", lambda *a, **k: started.append(a))
    assert main(["--to", "hf", "--fp8", "tensor", "--calibration-data",
                 str(tmp_path / "sample.txt"), "--input", str(tmp_path / "ckpt"),
                 "--output", str(tmp_path / "fp8")]) != 0
    assert not started
    assert "records the inputs of the wqkv/wo/w1/w2 linears only" in capsys.readouterr().err
