"""LoRA factors: the sharding rule (against the merged global weight), target patterns, and the
adapter on one process (the product, PEFT's start, gradients only on A/B, merge)."""

import math

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.lora import (
    attach_lora,
    gather_global,
    init_factors,
    lora_parameters,
    mark_only_lora_as_trainable,
    merge_lora_,
    resolve_targets,
)
from tessera.core.lora_format import AdapterConfig, AdapterError, merge_weight
from tessera.core.parallel.sharding import (
    global_param_shapes,
    lora_global_shapes,
    lora_local_shape,
    replica_rows,
    shard_adapter,
    shard_spec,
    shard_tensor,
    unshard_adapter,
)

LLAMA = ModelConfig.from_name("llama-tiny")  # 4 heads, 2 kv heads: tp 4 replicates them
MODULES = ("layers.0.attention.wqkv", "layers.0.attention.wo", "layers.1.feed_forward.w1",
           "layers.1.feed_forward.w2")


def _random_adapter(config, rank=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = lora_global_shapes(config, dict.fromkeys(MODULES, rank))
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_factor_shards_give_the_shards_of_the_merged_weight(tp):
    """Rank r's `W_r + s B_r A` (column) / `W_r + s B A_r` (row) is its shard of the merged
    global weight, fused [q; k; v] / [gate; up] parts and replicated kv heads included."""
    config, adapter = LLAMA, _random_adapter(LLAMA)
    g = torch.Generator().manual_seed(1)
    shapes = global_param_shapes(config)
    for module in MODULES:
        name, a_name, b_name = (f"{module}.weight", f"{module}.lora_A.weight",
                                f"{module}.lora_B.weight")
        w = torch.randn(shapes[name], generator=g)
        merged = merge_weight(w, adapter[a_name], adapter[b_name], 0.5)
        column = shard_spec(name, config).dim == 0
        assert shard_spec(a_name, config).dim == (None if column else 1)
        assert shard_spec(b_name, config).dim == (0 if column else None)
        pieces = [shard_adapter(adapter, config, r, tp) for r in range(tp)]
        for r, piece in enumerate(pieces):
            a, b = piece[a_name], piece[b_name]
            assert a.shape == lora_local_shape(a_name, adapter[a_name].shape, config, tp)
            assert b.shape == lora_local_shape(b_name, adapter[b_name].shape, config, tp)
            want = shard_tensor(name, merged, config, r, tp)
            got = merge_weight(shard_tensor(name, w, config, r, tp), a, b, 0.5)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        back = unshard_adapter(pieces, config)
        assert all(torch.equal(back[n], adapter[n]) for n in (a_name, b_name))
    # Replicated kv rows of B (tp 4 > 2 kv heads) are summed over replicas, as the base's are.
    b_qkv = "layers.0.attention.wqkv.lora_B.weight"
    assert replica_rows(b_qkv, config, tp) == replica_rows("layers.0.attention.wqkv.weight",
                                                           config, tp)


def test_target_patterns():
    c = LLAMA
    assert resolve_targets("qkv,wo", c) == ("layers.0.attention.wqkv", "layers.0.attention.wo",
                                             "layers.1.attention.wqkv", "layers.1.attention.wo")
    assert resolve_targets("mlp", c) == resolve_targets(["w1", "w2"], c)
    assert len(resolve_targets("all", c)) == 8
    assert resolve_targets(r"layers\.1\.feed_forward\.w[12]", c) == (
        "layers.1.feed_forward.w1", "layers.1.feed_forward.w2")
    assert resolve_targets(r"attention\.wo", c) == ("layers.0.attention.wo",
                                                    "layers.1.attention.wo")
    for bad, words in (("qkv,q_proj", "'q_proj' matches no module"), ("", "no LoRA targets"),
                       ("tok_embeddings", "matches no module"), ("layers.(", "not a valid")):
        with pytest.raises(AdapterError, match=words):
            resolve_targets(bad, c)


def test_adapter_product_start_and_gradients():
    config = ModelConfig.from_name("gpt2-tiny")  # biases, learned positions
    model = build_model(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    base_logits = model(ids).detach()
    modules = resolve_targets("all", config)
    adapter = AdapterConfig(rank=4, alpha=8.0, modules=modules)
    params = attach_lora([model], adapter, seed=3)
    # PEFT's start: B zeros (the model is unchanged), A kaiming-uniform(a=sqrt 5): |A| <= 1/sqrt(in)
    torch.testing.assert_close(model(ids), base_logits, rtol=0, atol=0)
    a = params["layers.0.attention.wqkv.lora_A.weight"]
    bound = 1 / math.sqrt(config.hidden_size)
    assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound
    assert torch.equal(a, init_factors("layers.0.attention.wqkv", 4, config, 3)[0])
    mark_only_lora_as_trainable(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in params.items():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model(ids).square().mean().backward()  # (labels would compile the fused loss: slow)
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (name in params), name
    # The product: the unmerged forward equals the forward of the merged weights.
    with torch.no_grad():
        unmerged = model(ids)
        tensors = gather_global(dict(lora_parameters([model])), model.groups, config)
        merged = merge_lora_([model])
    assert sorted(merged) == sorted(modules) and not lora_parameters([model])
    torch.testing.assert_close(model(ids), unmerged, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if module in modules and name.endswith(".weight"):
            want = merge_weight(before[name], tensors[f"{module}.lora_A.weight"],
                                tensors[f"{module}.lora_B.weight"], adapter.scaling)
            assert torch.equal(p, want), name
        else:
            assert torch.equal(p, before[name]), name


def test_unmerged_adapter_forward_equals_peft_on_the_hf_export(tmp_path):
    """The adapter hook against a reference nobody here wrote: `peft` LoRA on the Hugging Face
    export of the same base (grouped-query Llama: q, k, v of different sizes in the fused
    wqkv), with the adapter exported by `tessera convert --to peft`."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tessera.converters.cli import main as convert
    from tessera.converters.hf_io import export_hf
    from tessera.core.checkpoint import save_checkpoint
    from tessera.core.fingerprint import base_fingerprint
    from tessera.core.lora_format import save_adapter

    config = ModelConfig(name="lora-gqa", vocab_size=128, hidden_size=64, num_layers=2,
                         num_heads=8, num_kv_heads=4, ffn_hidden_size=96,
                         max_position_embeddings=32)
    model = build_model(config, seed=0)
    ckpt = save_checkpoint(tmp_path / "ckpt", model)
    export_hf(ckpt, tmp_path / "hf")
    modules = resolve_targets("all", config)
    adapter = AdapterConfig(rank=3, alpha=6.0, modules=modules, targets=("all",),
                            base_checkpoint=str(ckpt), base_fingerprint=base_fingerprint(ckpt))
    g = torch.Generator().manual_seed(4)
    tensors = {n: torch.randn(s, generator=g) * 0.1
               for n, s in lora_global_shapes(config, dict.fromkeys(modules, 3)).items()}
    save_adapter(tmp_path / "adapter", adapter, tensors)
    assert convert(["--to", "peft", "--input", str(tmp_path / "adapter"), "--checkpoint",
                    str(ckpt), "--output", str(tmp_path / "peft"), "--hf-model",
                    str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    reference = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    attach_lora([model], adapter, tensors=tensors)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    with torch.no_grad():
        got, want = model(ids), reference(ids).logits
        with reference.disable_adapter():
            plain = reference(ids).logits
    assert (got - want).abs().max() <= 1e-4 and (plain - want).abs().max() > 1e-2
