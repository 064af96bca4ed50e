"""Mixture-of-Experts Hugging Face import/export against the real transformers models.

Random-weight fp32 `MixtralForCausalLM`, `Qwen2MoeForCausalLM` (with a shared expert and a
dense layer between MoE layers) and `Qwen3MoeForCausalLM` (per-head q/k norm, head_dim !=
hidden / heads, a dense layer between MoE layers), built locally and saved with
`save_pretrained`, are imported with `tessera convert --from hf`: logits, loss, the router's
load-balancing loss (pooled over the MoE layers as HF pools it) and the router gradients of the
total loss must equal HF's, and the export must give back HF's tensors bit for bit in a
directory transformers loads. Both on-disk expert layouts are read (per-expert keys, and the
fused `experts.gate_up_proj`).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

from tessera.converters.cli import main  # noqa: E402
from tessera.converters.hf_io import open_hf_dir  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.core.models.decoder.model import GPTModel  # noqa: E402
from tessera.core.moe.shapes import moe_layers  # noqa: E402
from tessera.core.moe.stats import router_step_end, track_router_stats  # noqa: E402

VOCAB = 200
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, num_experts_per_tok=2)
_FAMILIES = {
    "mixtral": ("MixtralConfig", dict(**_COMMON, intermediate_size=48, num_hidden_layers=2,
                                      num_local_experts=4, router_aux_loss_coef=0.02)),
    # Layers 0, 2 dense (intermediate_size), 1, 3 MoE: decoder_sparse_step 2.
    "qwen2_moe": ("Qwen2MoeConfig", dict(**_COMMON, intermediate_size=64, num_hidden_layers=4,
                                         num_experts=8, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=40,
                                         decoder_sparse_step=2, qkv_bias=False,
                                         router_aux_loss_coef=0.01)),
    # Qwen3-MoE: q/k norm, head_dim 12 != 32 / 4, no shared expert, normalized top-k; layers
    # 0, 2 dense, 1, 3 MoE.
    "qwen3_moe": ("Qwen3MoeConfig", dict(**_COMMON, intermediate_size=64, num_hidden_layers=4,
                                         head_dim=12, num_experts=4, moe_intermediate_size=16,
                                         decoder_sparse_step=2, norm_topk_prob=True,
                                         router_aux_loss_coef=0.01)),
}


@torch.no_grad()
def _hf_model(family: str):
    """A random fp32 model; every weight perturbed, so a swapped tensor shows in the logits."""
    cls, fields = _FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**fields))
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def _convert(*argv) -> None:
    assert main([*map(str, argv)]) == 0


@pytest.fixture(scope="module", params=list(_FAMILIES))
def imported(request, tmp_path_factory):
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    model = _hf_model(family)
    model.save_pretrained(root / "hf")
    _convert("--from", "hf", "--input", root / "hf", "--output", root / "ckpt")
    return family, model, root


def _train_forward(model, ids, targets):
    """Tessera's LM loss and router metrics of one training forward, and the router gradients
    of its backward (the LM loss plus the load-balancing loss the layers attach)."""
    model.train()  # dropout is 0: the same function, and the router records its losses
    model.zero_grad()
    track_router_stats([model])
    loss = model(ids, labels=targets)
    metrics = router_step_end([model], model.groups, sequence_parallel=False)
    loss.backward()
    grads = [model.layers[str(i)].feed_forward.router.weight.grad for i in moe_layers(model.config)]
    return loss.item(), metrics, grads


def _hf_router_grads(hf_model, loss):
    hf_model.zero_grad()
    loss.backward()
    return [p.grad for n, p in hf_model.named_parameters() if n.endswith("mlp.gate.weight")]


def test_logits_loss_and_aux_loss_match_hf(imported):
    """An import pools the load-balancing loss over all MoE layers as HF does: aux loss, total
    loss and the router gradients of the total loss equal HF's; with per-layer pooling the aux
    loss is the mean of HF's function applied layer by layer."""
    family, hf_model, root = imported
    model = load_checkpoint(root / "ckpt")
    config = model.config
    assert config.family == family and len(moe_layers(config)) == 2
    assert config.moe.aux_loss_pooling == "model"  # the import default (converters.hf_moe)
    ids = _ids()
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    with torch.no_grad():
        assert (hf_model(ids).logits - model(ids)).abs().max().item() <= 1e-4
    coef, k = config.moe.aux_loss_coef, config.moe.top_k
    hf = hf_model(ids, labels=ids, output_router_logits=True)  # loss = LM + coef * aux
    hf_lm = hf.loss - coef * hf.aux_loss
    hf_grads = _hf_router_grads(hf_model, hf.loss)

    loss, metrics, grads = _train_forward(model, ids, targets)
    assert abs(loss - hf_lm.item()) <= 1e-5
    assert abs(metrics["moe_aux_loss"] - hf.aux_loss.item()) <= 1e-6
    assert abs(loss + coef * metrics["moe_aux_loss"] - hf.loss.item()) <= 1e-6 * hf.loss.item()
    for g, ref in zip(grads, hf_grads, strict=True):
        assert (g - ref).abs().max().item() <= 1e-6 * max(1.0, ref.abs().max().item())
    assert metrics["moe_tokens_per_expert_max"] >= metrics["moe_tokens_per_expert_min"]
    assert metrics["moe_dropped_tokens"] == 0

    # "layer" (Megatron's, the preset default): the mean over MoE layers of E * sum f_i P_i,
    # i.e. HF's function applied to one layer's router logits at a time.
    per_layer_model = GPTModel(replace(config, moe=replace(config.moe, aux_loss_pooling="layer")))
    per_layer_model.load_state_dict(model.state_dict())
    hf = hf_model(ids, labels=ids, output_router_logits=True)
    per_layer = torch.stack([load_balancing_loss_func((rl,), config.moe.num_experts, k)
                             for rl in hf.router_logits])
    assert abs(per_layer.mean().item() - hf.aux_loss.item()) > 1e-4  # the two poolings differ
    hf_grads = _hf_router_grads(hf_model, hf.loss + coef * (per_layer.mean() - hf.aux_loss))
    loss, metrics, grads = _train_forward(per_layer_model, ids, targets)
    assert abs(metrics["moe_aux_loss"] - per_layer.mean().item()) <= 1e-6
    for g, ref in zip(grads, hf_grads, strict=True):
        assert (g - ref).abs().max().item() <= 1e-6 * max(1.0, ref.abs().max().item())


def test_export_round_trip_is_bit_exact(imported):
    family, hf_model, root = imported
    _convert("--to", "hf", "--input", root / "ckpt", "--output", root / "out")
    original, exported = open_hf_dir(root / "hf"), open_hf_dir(root / "out")
    assert exported.names == original.names
    for name in original.names:
        assert torch.equal(exported.read(name), original.read(name)), name
    a = transformers.AutoConfig.from_pretrained(root / "hf").to_dict()
    b = transformers.AutoConfig.from_pretrained(root / "out").to_dict()
    for key in ("_name_or_path", "transformers_version", "bos_token_id", "eos_token_id",
                "max_window_layers", "layer_types", "sliding_window", "head_dim"):
        a.pop(key, None), b.pop(key, None)
    assert a == b
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(root / "out").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(_ids()).logits, hf_model(_ids()).logits)


def test_fused_expert_layout_imports(tmp_path):
    """transformers 5.x keeps experts fused in memory (`mlp.experts.gate_up_proj`); a file in
    that layout imports to the same model."""
    hf_model = _hf_model("mixtral")
    state = hf_model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "hf").mkdir()
    hf_model.config.save_pretrained(tmp_path / "hf")
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "hf" / "model.safetensors")
    _convert("--from", "hf", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt")
    model = load_checkpoint(tmp_path / "ckpt")
    with torch.no_grad():
        assert (hf_model(_ids()).logits - model(_ids())).abs().max().item() <= 1e-4


def test_unconvertible_fields_are_named(tmp_path):
    from tessera.converters.hf_mapping import ConversionError, config_from_hf

    qwen = _hf_model("qwen2_moe").config.to_dict()
    assert config_from_hf({**qwen, "qkv_bias": True}).qkv_bias  # as shipped (test_hf_qwen2.py)
    with pytest.raises(ConversionError, match="mlp_only_layers"):
        config_from_hf({**qwen, "mlp_only_layers": [1]})
    qwen3 = _hf_model("qwen3_moe").config.to_dict()  # decoder_sparse_step 2: 0, 2 dense
    assert config_from_hf({**qwen3, "mlp_only_layers": [0, 2]}) == config_from_hf(qwen3)
    with pytest.raises(ConversionError, match=r"mlp_only_layers makes layers \[3\] dense"):
        config_from_hf({**qwen3, "mlp_only_layers": [2, 3]})
    with pytest.raises(ConversionError, match="attention_bias"):
        config_from_hf({**qwen3, "attention_bias": True})
    mixtral = json.loads(_hf_model("mixtral").config.to_json_string())
    with pytest.raises(ConversionError, match="router_jitter_noise"):
        config_from_hf({**mixtral, "router_jitter_noise": 0.1})
