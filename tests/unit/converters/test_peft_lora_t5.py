"""A peft LoRA on transformers' `T5ForConditionalGeneration` round-trips through Tessera.

A tiny random T5 (built locally, nothing downloaded) is imported; a `peft.LoraConfig` adapter
trained a few steps with peft imports (`tessera convert --from peft`) as a Tessera adapter whose
unmerged T5 gives `PeftModel`'s logits, and exports back (`--to peft`) to a directory peft loads
with the same logits again. T5 v1.1 (gated GELU, more decoder than encoder layers) with every
linear adapted (self- and cross-attention q/k/v/o, wi_0/wi_1, wo), and the original T5 (ReLU,
tied and scaled output) with only q and v (parts of the fused wqkv, and the cross-attention's
q and the v half of its wkv) and wi.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.converters.peft_lora import PeftLoraError, hf_modules  # noqa: E402
from tessera.core.lora import attach_lora  # noqa: E402
from tessera.core.lora_format import load_adapter  # noqa: E402
from tessera.core.models.t5.init import load_t5_checkpoint  # noqa: E402
from tests.unit.converters.hf_family_checks import convert  # noqa: E402
from tests.unit.converters.test_hf_t5 import ORIGINAL, V11, batch, hf_t5  # noqa: E402

CASES = {"v1.1-all": (V11, ["q", "k", "v", "o", "wi_0", "wi_1", "wo"]),
         "original-q-v-wi": (ORIGINAL, ["q", "v", "wi"])}


@pytest.fixture(scope="module", params=list(CASES))
def trained(request, tmp_path_factory):
    """The HF T5, its Tessera import, and a peft LoRA trained 3 steps on it (saved)."""
    root = tmp_path_factory.mktemp(request.param)
    fields, targets = CASES[request.param]
    hf_t5(fields, root / "hf")
    import_hf(root / "hf", root / "ckpt")
    torch.manual_seed(3)
    model = peft.get_peft_model(
        transformers.T5ForConditionalGeneration.from_pretrained(root / "hf").float(),
        peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets, task_type="SEQ_2_SEQ_LM"))
    enc, mask, dec, labels = batch()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(input_ids=enc, attention_mask=mask, decoder_input_ids=dec,
              labels=labels).loss.backward()
        optimizer.step()
    model.save_pretrained(root / "trained")
    return request.param, root


def test_peft_lora_round_trips_with_peft_logits(trained):
    name, root = trained
    convert("--from", "peft", "--input", root / "trained", "--checkpoint", root / "ckpt",
            "--output", root / "adapter")
    convert("--to", "peft", "--input", root / "adapter", "--checkpoint", root / "ckpt",
            "--output", root / "again")
    assert json.loads((root / "again" / "adapter_config.json").read_text())["task_type"] == \
        "SEQ_2_SEQ_LM"
    adapter, tensors = load_adapter(root / "adapter")
    cross = [m for m in adapter.modules if ".cross_attention." in m]
    assert cross and all(m.startswith(("encoder.", "decoder.")) for m in adapter.modules)
    ours = load_t5_checkpoint(str(root / "ckpt"))
    attach_lora([ours], adapter, tensors=tensors)
    enc, mask, dec, _ = batch()
    with torch.no_grad():
        got = ours(enc, decoder_input_ids=dec, encoder_mask=mask)
    for directory in ("trained", "again"):
        base = transformers.T5ForConditionalGeneration.from_pretrained(root / "hf").float()
        reference = peft.PeftModel.from_pretrained(base, root / directory).eval()
        with torch.no_grad():
            want = reference(input_ids=enc, attention_mask=mask, decoder_input_ids=dec).logits
            with reference.disable_adapter():  # the adapter must matter
                plain = reference(input_ids=enc, attention_mask=mask,
                                  decoder_input_ids=dec).logits
        diff, effect = (got - want).abs().max().item(), (plain - want).abs().max().item()
        assert diff <= 1e-4 and effect > 1e-3, (name, directory, diff, effect)


def test_t5_modules_map_onto_hf_modules_and_norms_are_refused(trained):
    name, root = trained
    config = load_t5_checkpoint(str(root / "ckpt")).config
    assert hf_modules(config, "decoder.layers.1.cross_attention.wkv") == [
        ("decoder.block.1.layer.1.EncDecAttention.k", 32),
        ("decoder.block.1.layer.1.EncDecAttention.v", 32)]
    with pytest.raises(PeftLoraError, match="encoder.layers.0.ffn_norm is not a linear layer"):
        hf_modules(config, "encoder.layers.0.ffn_norm")


def test_lora_targets_name_t5_modules_inside_their_blocks():
    """`--lora-targets` short names and patterns match a T5 module by its name inside the
    block, in both stacks; the error for no match lists T5's own block modules."""
    from tessera.core.config import ModelConfig
    from tessera.core.lora import resolve_targets
    from tessera.core.lora_format import AdapterError

    config = ModelConfig.from_name("t5-tiny", num_layers=2, options={"num_decoder_layers": 1})
    assert resolve_targets("qkv", config) == ("encoder.layers.0.attention.wqkv",
                                              "encoder.layers.1.attention.wqkv",
                                              "decoder.layers.0.attention.wqkv")
    assert resolve_targets(r"cross_attention\.w.*", config) == (
        "decoder.layers.0.cross_attention.wq", "decoder.layers.0.cross_attention.wkv",
        "decoder.layers.0.cross_attention.wo")
    with pytest.raises(AdapterError, match=r"layers\.N\.\{.*cross_attention\.wkv"):
        resolve_targets("q_proj", config)


def test_each_tp2_rank_holds_its_shard_of_the_merged_t5_weight():
    """The tp rule of every T5 LoRA module (`sharding.shard_spec` on its factors): a rank's
    factors merged into its weight shard give that rank's shard of the merged global weight
    (q/k/v and cross k/v cut per head in each part, wo / w2 by input columns)."""
    from tessera.core.config import ModelConfig
    from tessera.core.lora import adaptable_modules
    from tessera.core.lora_format import lora_names, merge_weight
    from tessera.core.parallel.sharding import global_param_shapes, shard_tensor

    config = ModelConfig.from_name("t5-tiny", num_layers=1)
    shapes, gen = global_param_shapes(config), torch.Generator().manual_seed(0)
    for module in adaptable_modules(config):
        rows, cols = shapes[f"{module}.weight"]
        full = {f"{module}.weight": torch.randn(rows, cols, generator=gen)}
        a_name, b_name = lora_names(module)
        full[a_name], full[b_name] = (torch.randn(3, cols, generator=gen),
                                      torch.randn(rows, 3, generator=gen))
        merged = merge_weight(*(full[n] for n in (f"{module}.weight", a_name, b_name)), 0.5)
        for rank in range(2):
            w, a, b = (shard_tensor(n, full[n], config, rank, 2)
                       for n in (f"{module}.weight", a_name, b_name))
            torch.testing.assert_close(
                merge_weight(w, a, b, 0.5),
                shard_tensor(f"{module}.weight", merged, config, rank, 2))
