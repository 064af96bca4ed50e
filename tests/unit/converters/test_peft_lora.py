"""LoRA adapters to and from Hugging Face `peft`, checked against peft itself.

Tiny random Tessera bases (Llama with grouped-query attention, GPT-2 with its fused Conv1D
`c_attn`, Qwen3 with q/k norms, Qwen3-MoE with its attention only) are exported with `tessera
convert --to hf`. A random adapter with nonzero B (so a wrong mapping shows) exported with `--to
peft` must give, in `peft.PeftModel` on that export, the logits of Tessera's merged checkpoint;
peft's own `merge_and_unload` must give our merged weights. A LoRA trained a few steps with peft
imports with `--from peft` and must give peft's logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tessera.converters.cli import main  # noqa: E402
from tessera.converters.hf_io import export_hf  # noqa: E402
from tessera.converters.hf_mapping import export_tensors  # noqa: E402
from tessera.core import ModelConfig, build_model  # noqa: E402
from tessera.core.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from tessera.core.fingerprint import base_fingerprint  # noqa: E402
from tessera.core.lora import adaptable_modules  # noqa: E402
from tessera.core.lora_format import (  # noqa: E402
    AdapterConfig,
    load_adapter,
    lora_names,
    merge_into,
    save_adapter,
)
from tessera.core.parallel.sharding import global_param_shapes  # noqa: E402

VOCAB = 128
CONFIGS = {
    # 8 query heads, 4 kv heads: q, k and v parts of different sizes in the fused wqkv.
    "llama": ModelConfig(name="lora-llama", vocab_size=VOCAB, hidden_size=64, num_layers=2,
                         num_heads=8, num_kv_heads=4, ffn_hidden_size=96,
                         max_position_embeddings=64),
    "gpt2": ModelConfig.from_name("gpt2-tiny", vocab_size=VOCAB, num_layers=2,
                                  max_position_embeddings=64),
    # Nemotron: partial rotary, squared-ReLU MLP with one up_proj (no gate).
    "nemotron": ModelConfig(name="lora-nemotron", family="nemotron", vocab_size=VOCAB,
                            hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                            ffn_hidden_size=96, max_position_embeddings=64, norm="layernorm1p",
                            activation="squared_relu", rotary_fraction=0.5),
    # Qwen3: per-head q/k RMSNorm (not a LoRA module), head_dim 16 != hidden / heads.
    "qwen3": ModelConfig(name="lora-qwen3", family="qwen3", vocab_size=VOCAB, hidden_size=64,
                         num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16,
                         ffn_hidden_size=96, max_position_embeddings=64, qk_norm=True),
    # Qwen3-MoE: only the attention is adapted (its experts are not LoRA modules in Tessera).
    "qwen3_moe": ModelConfig.from_name("qwen3-moe-tiny", vocab_size=VOCAB, moe={"num_experts": 4},
                                       max_position_embeddings=64),
}
PEFT_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "nemotron": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2")


@pytest.fixture(scope="module", params=["gpt2", "llama",
                                        pytest.param("nemotron", marks=pytest.mark.slow),
                                        "qwen3", "qwen3_moe"])
def base(request, tmp_path_factory):
    """(family, Tessera checkpoint, its HF export)."""
    family, root = request.param, tmp_path_factory.mktemp(f"peft-{request.param}")
    model = build_model(CONFIGS[family], seed=0)
    with torch.no_grad():  # norms and biases away from their 1/0 init, so nothing is trivial
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ckpt = save_checkpoint(root / "ckpt", model)
    export_hf(ckpt, root / "hf")
    return family, ckpt, root / "hf"


def _convert(*argv) -> None:
    assert main([str(a) for a in argv]) == 0


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def _random_adapter(family: str, ckpt: Path, out: Path, rank: int = 4, alpha: float = 8.0
                    ) -> Path:
    """Every linear layer of every layer adapted, B nonzero; layer 1's wqkv with its own rank
    (the contract allows a module rank other than `rank`; the scale stays alpha / rank)."""
    config = CONFIGS[family]
    shapes, g = global_param_shapes(config), torch.Generator().manual_seed(2)
    modules, tensors = [], {}
    for module in adaptable_modules(config):  # MoE layers: the attention only
        out_f, in_f = shapes[f"{module}.weight"]
        r_m = 2 * rank if module == "layers.1.attention.wqkv" else rank
        a_name, b_name = lora_names(module)
        tensors[a_name] = torch.randn(r_m, in_f, generator=g) / in_f ** 0.5
        tensors[b_name] = torch.randn(out_f, r_m, generator=g) * 0.05
        modules.append(module)
    targets = tuple(leaf for leaf in LINEARS if any(m.endswith(leaf) for m in modules))
    adapter = AdapterConfig(rank=rank, alpha=alpha, modules=tuple(modules), targets=targets,
                            base_checkpoint=str(ckpt), base_fingerprint=base_fingerprint(ckpt))
    return save_adapter(out, adapter, tensors)


def _merged_weights(ckpt: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    config, tensors = load_adapter(adapter_dir)
    model = load_checkpoint(ckpt)
    return merge_into(dict(model.state_dict()), config, tensors)


@torch.no_grad()
def _tessera_logits(ckpt: Path, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    model = load_checkpoint(ckpt)
    model.load_state_dict(weights)
    return model(_ids())


def _peft_model(hf_dir: Path, peft_dir: Path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    return peft.PeftModel.from_pretrained(hf, peft_dir).eval()


def test_export_loads_in_peft_and_matches_tessera(base, tmp_path):
    family, ckpt, hf_dir = base
    adapter = _random_adapter(family, ckpt, tmp_path / "adapter")
    _convert("--to", "peft", "--input", adapter, "--checkpoint", ckpt, "--output",
             tmp_path / "peft", "--hf-model", hf_dir)
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert peft_config["base_model_name_or_path"] == str(hf_dir)
    merged = _merged_weights(ckpt, adapter)
    want = _tessera_logits(ckpt, merged)
    model = _peft_model(hf_dir, tmp_path / "peft")
    with torch.no_grad():
        got = model(_ids()).logits
        with model.disable_adapter():  # the adapter must matter, or this test proves nothing
            plain = model(_ids()).logits
    diff, effect = (got - want).abs().max().item(), (plain - want).abs().max().item()
    assert diff <= 1e-4 and effect > 1e-2, (family, diff, effect)
    # peft's own merge, a second reference: the HF tensors of our merged Tessera weights.
    hf_merged = model.merge_and_unload().state_dict()
    ours = dict(export_tensors(CONFIGS[family], merged.__getitem__))
    for name, tensor in ours.items():
        if name not in hf_merged:  # transformers holds MoE experts fused; LoRA leaves them be
            assert ".experts." in name, name
            continue
        torch.testing.assert_close(hf_merged[name], tensor, rtol=0, atol=1e-6, msg=name)


def _peft_trained(hf_dir: Path, out: Path, targets: list[str], steps: int = 3,
                  **lora_kwargs) -> Path:
    """A LoRA trained `steps` Adam steps with peft on the HF export (so B is nonzero)."""
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets,
                                                    task_type="CAUSAL_LM", **lora_kwargs))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(4))
    for _ in range(steps):
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    return out


def test_peft_trained_adapter_imports_and_matches(base, tmp_path):
    family, ckpt, hf_dir = base
    extra = {}
    if family == "llama":  # per-module ranks and scales, folded into B on import
        extra = dict(rank_pattern={"model.layers.0.self_attn.k_proj": 2, "down_proj": 6},
                     alpha_pattern={"model.layers.1.mlp.up_proj": 3})
    else:  # rank-stabilized: alpha / sqrt(r)
        extra = dict(use_rslora=True)
    trained = _peft_trained(hf_dir, tmp_path / "trained", PEFT_TARGETS[family], **extra)
    _convert("--from", "peft", "--input", trained, "--checkpoint", ckpt, "--output",
             tmp_path / "imported")
    config, tensors = load_adapter(tmp_path / "imported")
    assert config.base_fingerprint == base_fingerprint(ckpt)
    assert config.modules == tuple(adaptable_modules(CONFIGS[family]))
    want = _peft_model(hf_dir, trained)
    with torch.no_grad():
        reference = want(_ids()).logits
    got = _tessera_logits(ckpt, _merged_weights(ckpt, tmp_path / "imported"))
    diff = (got - reference).abs().max().item()
    assert diff <= 1e-4, (family, diff)

    # And back: the imported adapter exports to PEFT with the original modules and ranks,
    # and gives the same logits again.
    _convert("--to", "peft", "--input", tmp_path / "imported", "--checkpoint", ckpt, "--output",
             tmp_path / "again")
    original = load_file(trained / "adapter_model.safetensors")
    again = load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in again.items()} == {k: v.shape for k, v in original.items()}
    with torch.no_grad():
        diff = (_peft_model(hf_dir, tmp_path / "again")(_ids()).logits - reference).abs().max()
    assert diff.item() <= 1e-4, (family, diff.item())


@pytest.mark.parametrize("base", ["llama"], indirect=True)
def test_round_trips(base, tmp_path):
    """Tessera -> PEFT -> Tessera merges to the same weights; a q/v-only PEFT LoRA (peft's
    usual Llama default) -> Tessera -> PEFT gives back its own tensors bit for bit."""
    family, ckpt, hf_dir = base
    adapter = _random_adapter(family, ckpt, tmp_path / "adapter")
    _convert("--to", "peft", "--input", adapter, "--checkpoint", ckpt, "--output", tmp_path / "p")
    _convert("--from", "peft", "--input", tmp_path / "p", "--checkpoint", ckpt, "--output",
             tmp_path / "back")
    first, second = _merged_weights(ckpt, adapter), _merged_weights(ckpt, tmp_path / "back")
    for name in first:
        torch.testing.assert_close(second[name], first[name], rtol=0, atol=1e-6, msg=name)

    trained = _peft_trained(hf_dir, tmp_path / "qv", ["q_proj", "v_proj"])
    _convert("--from", "peft", "--input", trained, "--checkpoint", ckpt, "--output",
             tmp_path / "qv-tessera")
    config, tensors = load_adapter(tmp_path / "qv-tessera")
    # Older peft versions saved adapter_model.bin: it imports the same.
    (tmp_path / "qv-bin").mkdir()
    shutil.copy(trained / "adapter_config.json", tmp_path / "qv-bin")
    torch.save(load_file(trained / "adapter_model.safetensors"),
               tmp_path / "qv-bin" / "adapter_model.bin")
    _convert("--from", "peft", "--input", tmp_path / "qv-bin", "--checkpoint", ckpt, "--output",
             tmp_path / "qv-bin-tessera")
    from_bin = load_adapter(tmp_path / "qv-bin-tessera")[1]
    assert all(torch.equal(from_bin[k], v) for k, v in tensors.items())
    b = tensors["layers.0.attention.wqkv.lora_B.weight"]
    assert config.modules == ("layers.0.attention.wqkv", "layers.1.attention.wqkv")
    assert b.shape == (128, 8) and not b[64:96].any()  # k's rows are zero: k is not adapted
    _convert("--to", "peft", "--input", tmp_path / "qv-tessera", "--checkpoint", ckpt,
             "--output", tmp_path / "qv-again")
    original = load_file(trained / "adapter_model.safetensors")
    again = load_file(tmp_path / "qv-again" / "adapter_model.safetensors")
    assert set(again) == set(original)
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name


@pytest.mark.parametrize("base", ["llama"], indirect=True)
def test_refuses_what_it_cannot_represent(base, tmp_path, capsys):
    family, ckpt, hf_dir = base
    trained = _peft_trained(hf_dir, tmp_path / "ok", ["q_proj", "o_proj"], steps=0)

    def refused(config_edit: dict, match: str, weights: dict | None = None) -> None:
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(trained, bad)
        cfg = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, **config_edit}))
        if weights is not None:
            save_file(weights, bad / "adapter_model.safetensors")
        assert main(["--from", "peft", "--input", str(bad), "--checkpoint", str(ckpt),
                     "--output", str(tmp_path / "out")]) == 1
        assert match in capsys.readouterr().err
        assert not (tmp_path / "out").exists()  # nothing half-written

    refused({"use_dora": True}, "DoRA")
    refused({"bias": "all"}, "bias='all'")
    refused({"modules_to_save": ["lm_head"]}, "modules_to_save")
    refused({"init_lora_weights": "pissa"}, "rewrites the base weights")
    refused({"peft_type": "IA3"}, "only LoRA adapters")
    refused({}, "has no Tessera LoRA equivalent",
            {"base_model.model.model.embed_tokens.lora_A.weight": torch.ones(4, 64),
             "base_model.model.model.embed_tokens.lora_B.weight": torch.ones(VOCAB, 4)})
    refused({}, "trained on another model",  # a base with another hidden size
            {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 32),
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(64, 4)})

    # Export: an adapter tuned on another base is refused by its fingerprint.
    other = save_checkpoint(tmp_path / "other", build_model(CONFIGS["llama"], seed=1))
    adapter = _random_adapter(family, ckpt, tmp_path / "adapter")
    assert main(["--to", "peft", "--input", str(adapter), "--checkpoint", str(other),
                 "--output", str(tmp_path / "out")]) == 1
    assert "different weights" in capsys.readouterr().err and not (tmp_path / "out").exists()
    # Import: a PEFT adapter exported from this base, onto the same-shaped other base.
    _convert("--to", "peft", "--input", adapter, "--checkpoint", ckpt, "--output", tmp_path / "p")
    assert main(["--from", "peft", "--input", str(tmp_path / "p"), "--checkpoint", str(other),
                 "--output", str(tmp_path / "out")]) == 1
    assert "another base" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main(["--to", "peft", "--input", str(adapter), "--output", str(tmp_path / "o")]) == 2
    assert "needs --checkpoint" in capsys.readouterr().err
