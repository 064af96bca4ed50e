"""The planner counts MoE models layer by layer: dense layers (`moe_layer_freq`), the shared
expert (Qwen2-MoE) and the routed experts, in parameters, FLOPs and activation memory.

References: Tessera's own built models (`sum(p.numel())` of a `GPTModel` on the meta device)
and its sharding rules (`core.parallel.sharding.local_shape`), the published totals of the
real models, and figures worked by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from tessera.core.config import ModelConfig
from tessera.core.models.decoder.model import GPTModel
from tessera.core.parallel.sharding import global_param_shapes, is_expert_param, local_shape
from tessera.plan import TrainingJob, evaluate, load_hardware
from tessera.plan import estimate as E
from tessera.plan import formulas as F

TINY = [
    ("mixtral-tiny", {}),  # every layer MoE, no shared expert
    ("qwen-moe-tiny", {}),  # shared expert with its sigmoid gate
    ("qwen-moe-tiny", dict(num_layers=4, moe_layer_freq=2, moe_expert_bias=True)),  # dense + MoE
    ("qwen3-moe-tiny", {}),  # q/k norms, no shared expert
    # DeepSeek: layer 0 dense, ungated shared expert, routing groups
    ("qwen-moe-tiny", dict(num_layers=3, moe_first_dense_layers=1, moe_shared_expert_gated=False,
                           moe_num_groups=2, moe_expert_bias=True)),
]


def _built(config: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPTModel(config).parameters())


@pytest.mark.parametrize("name,fields", TINY, ids=[
    n + ("-freq2" if f.get("moe_layer_freq") else "-deepseek" if f else "") for n, f in TINY])
def test_parameter_counts_equal_the_built_model(name, fields):
    """`parameter_counts(...).total` is every parameter Tessera builds; at tp 2 the planner's
    per-rank count differs from the shards Tessera holds (`local_shape`) by exactly what it
    documents: the weights replicated over tp (layer norms, routers, routing biases, shared
    expert gates) counted as split, i.e. half of them at tp 2."""
    config = ModelConfig.from_name(name, **fields)
    counts = F.parameter_counts(config)
    assert counts.total == _built(config)
    shapes = global_param_shapes(config)
    held = sum(math.prod(local_shape(n, config, 2)) for n in shapes)
    replicated = sum(math.prod(s) for n, s in shapes.items()
                     if n.startswith("layers.") and not is_expert_param(n)
                     and local_shape(n, config, 2) == s)
    assert F.params_per_rank(counts, tp=2, pp=1) == held - replicated // 2
    if fields:  # layers 1 and 3 are MoE, 0 and 2 dense; or layer 0 dense, 1 and 2 MoE
        assert counts.num_moe_layers == 2
        assert counts.num_dense_layers == config.num_layers - 2


def test_qwen_freq2_counts_by_hand():
    """qwen-moe-tiny with 4 layers, moe_layer_freq 2 (h 64, 4 heads of 16, FFN 128, 8 experts
    of FFN 32, top-2, shared expert FFN 128, SwiGLU, RMSNorm, vocabulary 512 untied):
    attention 64 x 192 + 64 x 64 = 16,384, norms 128; dense MLP 3 x 64 x 128 = 24,576;
    expert 3 x 64 x 32 = 6,144; shared expert 24,576 + gate 64; router 512 (+ bias 8).
    Dense layer 41,088; MoE layer outside the experts 16,384 + 128 + 520 + 24,640 = 41,672,
    experts 49,152; active 41,672 + 2 x 6,144 = 53,960. Embedding and output 2 x 32,768,
    final norm 64: total 2 x 41,088 + 2 x (41,672 + 49,152) + 65,600 = 329,424."""
    c = F.parameter_counts(ModelConfig.from_name("qwen-moe-tiny", num_layers=4,
                                                 moe={"layer_freq": 2, "expert_bias": True}))
    assert (c.layer_dense, c.moe_layer_dense, c.moe_layer_experts, c.moe_layer_active) == (
        41_088, 41_672, 49_152, 53_960)
    assert c.total == 329_424
    assert c.active == 2 * 41_088 + 2 * 53_960 + 65_600
    # Under pp 2 each stage holds the model's mix (here exactly: one dense, one MoE layer).
    assert F.expert_params_per_rank(c, pp=2) == 49_152


@pytest.mark.parametrize("name,total,active", [
    ("mixtral-8x7b", 46.7, 12.9),  # Mistral AI, "Mixtral of experts" (arXiv 2401.04088)
    ("qwen3-30b-a3b", 30.5, 3.3),  # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated
    ("qwen1.5-moe-a2.7b", 14.3, 2.7),  # Qwen1.5-MoE-A2.7B model card: 14.3B, 2.7B activated
])
def test_real_presets_match_published_totals(name, total, active):
    """Billions, to the published figures' one decimal, rounded or cut (Qwen3-30B-A3B's
    active 3.353B is published as 3.3B): within 0.06B."""
    c = E.counts_of(ModelConfig.from_name(name))
    assert abs(c.total / 1e9 - total) < 0.06 and abs(c.active / 1e9 - active) < 0.06
    if name == "mixtral-8x7b":  # the exact figures of test_formulas, now from the preset
        assert (c.total, c.active) == (46_702_792_704, 12_879_925_248)


H100 = load_hardware("h100-80gb")
QWEN_FREQ2 = ModelConfig.from_name("qwen-moe-tiny", num_layers=4, moe={"layer_freq": 2})


def test_step_flops_golden_dense_and_moe_layers():
    """qwen-moe-tiny, 4 layers, freq 2, batch 2 x 64 = 128 tokens, by hand (2 FLOPs a MAC):
    attention weights 16,384; dense MLP 24,576; MoE MLP: 2 routed experts of 6,144 and the
    shared expert 24,576: 36,864. Attention 4 x 128 x 64 x 64 = 2,097,152.
    Dense layer forward 2 x 128 x 40,960 + 2,097,152 = 12,582,912; MoE layer forward
    2 x 128 x 53,248 + 2,097,152 = 15,728,640; logits 2 x 128 x 64 x 512 = 8,388,608.
    No recompute: 3 x (2 x 12,582,912 + 2 x 15,728,640 + 8,388,608) = 195,035,136;
    full recompute adds one forward of the layers, 56,623,104."""
    job = TrainingJob(QWEN_FREQ2, 1, H100, 2, 64)._estimate
    assert F.moe_active_mlp_weights(QWEN_FREQ2) == 36_864
    assert E.hardware_flops(job, "none") == 195_035_136
    assert E.hardware_flops(job, "full") == 195_035_136 + 56_623_104


def test_moe_activation_bytes_golden():
    """One qwen-moe-tiny MoE layer (h 64, 4 heads of 16, shared FFN 128, 8 experts of FFN 32,
    top-2, SwiGLU), s 64, b 2: s b h = 8,192.
    No parallelism, unfused attention: replicated 10, split 2 + 4 + 2 (q, k v, projection
    input) + 6 x 128/64 (shared expert) = 20, scores 5 a s/h = 20: 50 s b h = 409,600; the
    shared expert's output 2 s b h = 16,384; the router's fp32 scores 4 x 8 = 32 bytes a
    token, and per routed copy the permuted input 2 x 64, the expert intermediate 6 x 32 and
    the expert output 2 x 64 = 448: 128 tokens x (32 + 2 x 448) = 118,784. Total 544,768.
    tp 2 with sequence parallelism, etp 2: 25 s b h = 204,800; shared output 8,192; 64 routed
    tokens x (32 + 2 x (256 + 192 + 128)) = 75,776. Total 288,768."""
    m = ModelConfig.from_name("qwen-moe-tiny")
    assert F.moe_layer_activation_bytes(m, 64, 2) == 544_768
    assert F.moe_layer_activation_bytes(m, 64, 2, t=2, sequence_parallel=True, etp=2) == 288_768
    # Full recomputation keeps the layer input only, as a dense layer does.
    assert F.moe_layer_activation_bytes(m, 64, 2, recompute="full") == 2 * 8_192
    # A dense layer of this model (FFN 128, the shared expert's size) stores the 50 s b h
    # alone: what the planner counted for an MoE layer before the routed copies.
    assert F.layer_activation_bytes(m, 64, 2) == 409_600


def test_memory_sums_dense_and_moe_layers():
    """The estimate's activations for the freq-2 model on one GPU (no pipeline): two dense
    and two MoE layers, the embedding and the logits [formulas], in 16-bit bytes."""
    job = TrainingJob(QWEN_FREQ2, 1, H100, 2, 64, flash_attention=False)
    c = evaluate(job, dict(micro_batch=2))
    layers = (2 * F.layer_activation_bytes(QWEN_FREQ2, 64, 2)
              + 2 * F.moe_layer_activation_bytes(QWEN_FREQ2, 64, 2))
    ends = F.embedding_activation_bytes(64, 2, 64) + F.logits_activation_bytes(64, 2, 64, 512)
    assert c.memory.activations * F.GIB == pytest.approx(layers + ends, rel=1e-12)


@pytest.mark.parametrize("name,ops", [("mixtral-tiny", 2), ("qwen-moe-tiny", 4)])
def test_shared_expert_adds_its_tensor_parallel_collectives(name, ops):
    """tp 2 with sequence parallelism, s 128, b 1, h 64: an MoE layer gathers and scatters the
    s b h x 2 = 16,384 bytes around attention (1/2 of them each, 2 calls); the shared expert,
    split over tp like the dense MLP (`core.moe.layer.SharedExpert`), adds the same pair
    around itself (4 calls, 32,768 bytes). Ring over NVLink at 450 GB/s x 0.8, 20 us a call."""
    job = TrainingJob(ModelConfig.from_name(name), 2, H100, 2, 128)
    c = evaluate(job, dict(tp=2, sequence_parallel=True))
    bw, lat = 360e9, 20e-6
    assert E._layer_times(job._estimate, c.config).tp == pytest.approx(
        ops / 2 * 16_384 / bw + ops * lat, rel=1e-12)


def _saved_bytes(config: ModelConfig, s: int, b: int) -> int:
    """Bytes of the activations torch's autograd keeps for one bf16 forward of Tessera's MoE
    block (`core.moe.layer.MoEFeedForward`, one rank), parameters excluded."""
    from tessera.core.moe.layer import MoEFeedForward
    from tessera.core.parallel.groups import ParallelGroups

    torch.manual_seed(0)
    layer = MoEFeedForward(config, 0, ParallelGroups(), False).to(torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    params = {p.data_ptr() for p in layer.parameters()}
    saved: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved[(t.data_ptr(), tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
        return t

    x = torch.randn(s, b, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(saved.values())


@pytest.mark.parametrize("name,counted", [("mixtral-tiny", 280_576), ("qwen-moe-tiny", 249_856)])
def test_moe_block_activations_against_autograd(name, counted):
    """What the formula counts for the MoE block (the MLP input and, per token and copy, what
    `moe_layer_activation_bytes` adds: 128 tokens; mixtral-tiny: 16,384 + 128 x (4 x 4 +
    2 x (128 + 6 x 128 + 128)) = 280,576; qwen-moe-tiny: 16,384 + 12 s b h (shared expert) +
    16,384 (its output) + 118,784 (routed) = 249,856) is a lower bound of what torch's
    autograd really keeps for Tessera's layer, and within 60% of it: the rest is the
    implementation's extra copies (`moe_layer_activation_bytes` names them: +22% / +33% with
    the fused SwiGLU) and, as the tests run eager (TESSERA_FUSED_KERNELS=off), SwiGLU's
    `silu(gate)` (2 f bytes a copy: +46% / +52% in all). A formula without the top-k copies
    (mixtral: 18,432) or the shared expert (qwen: 135,168) is far outside."""
    config = ModelConfig.from_name(name)
    sbh = 64 * 2 * config.hidden_size
    attention_side = F.moe_layer_activation_bytes(config, 64, 2) - counted
    u = F.layer_activation_units(config, ffn=0)
    assert attention_side == sbh * (u.replicated - 2 + u.split + u.scores * 4 * 64 / 64)
    saved = _saved_bytes(config, 64, 2)
    assert counted <= saved <= 1.6 * counted


def test_serving_holds_every_expert():
    """Serving Mixtral 8x7B holds all 46,702,792,704 parameters (every expert; before, the
    serving planner counted the MoE model as dense): 10.87 GiB a GPU in bf16 at tp 8, and on
    one 80 GB H100 it does not fit (87 GiB of weights)."""
    from tessera.plan import plan_serving

    model = ModelConfig.from_name("mixtral-8x7b")
    tp8 = next(o for o in plan_serving(model, 8, H100).options if (o.tp, o.pp) == (8, 1))
    assert tp8.weights_gib * F.GIB == pytest.approx(2 * 46_702_792_704 / 8, rel=1e-12)
    assert not plan_serving(model, 1, H100).fits


def test_pipeline_stage_with_most_moe_layers():
    """qwen-moe-tiny with 6 layers, freq 2 (MoE layers 1, 3, 5), pp 2: stage 0 holds layers
    0-2 (one MoE layer) and the embedding, stage 1 layers 3-5 (two) with the final norm and
    the output. The planner's most loaded rank is stage 1, exactly as Tessera builds it
    (`GPTModel` of stage 1 on the meta device); its experts are two layers' worth."""
    from tessera.core.config import Layout
    from tessera.core.parallel.groups import ParallelGroups

    config = ModelConfig.from_name("qwen-moe-tiny", num_layers=6, moe={"layer_freq": 2})
    counts = F.parameter_counts(config)
    assert F.max_stage_moe_layers(counts, 2) == 2 and F.max_stage_moe_layers(counts, 3) == 1
    with torch.device("meta"):
        stages = [GPTModel(config, Layout(pp=2), ParallelGroups(pp_rank=j, pp_size=2), j, 2)
                  for j in range(2)]
    held = [sum(p.numel() for p in stage.parameters()) for stage in stages]
    assert held[1] > held[0] and F.params_per_rank(counts, tp=1, pp=2) == held[1]
    experts = sum(p.numel() for n, p in stages[1].named_parameters() if ".experts." in n)
    assert F.expert_params_per_rank(counts, pp=2) == experts == 2 * counts.moe_layer_experts
