"""Golden tests of the planner's formulas against numbers worked by hand from the papers
(Narayanan et al. 2021 "PTD-P", Korthikanti et al. 2022) and published model sizes."""

from __future__ import annotations

import pytest

from tessera.core.config import PRESETS, ModelConfig
from tessera.plan import estimate as E
from tessera.plan import formulas as F
from tessera.plan.hardware import load_hardware

# PTD-P Table 1: (params in B, heads, hidden, layers); s = 2048, V = 51200.
PTDP_SHAPES = [(1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36),
               (18.4, 48, 6144, 40), (39.1, 64, 8192, 48), (76.1, 80, 10240, 60),
               (145.6, 96, 12288, 80), (310.1, 128, 16384, 96), (529.6, 128, 20480, 105),
               (1008.0, 160, 25600, 128)]


def gpt(h: int, a: int, L: int) -> ModelConfig:
    """A PTD-P GPT: learned positions, tied embeddings, biases, GeLU, ffn = 4h."""
    return ModelConfig(name=f"gpt-h{h}", family="gpt2", norm="layernorm",
                       activation="gelu_tanh", position="learned", bias=True,
                       tied_embeddings=True, vocab_size=51200, hidden_size=h, num_layers=L,
                       num_heads=a, ffn_hidden_size=4 * h, max_position_embeddings=2048)


@pytest.mark.parametrize("billions,heads,hidden,layers", PTDP_SHAPES)
def test_ptdp_table1_parameter_counts(billions, heads, hidden, layers):
    # PTD-P eq. 2 gives every Table 1 row to 0.1B, and our shape-based count (fused QKV, norm
    # biases, the final norm's 2h more) agrees with eq. 2 to within 2h + 0.
    eq2 = F.ptdp_parameters(layers, hidden, 51200, 2048)
    assert round(eq2 / 1e9, 1) == billions
    counted = F.parameter_counts(gpt(hidden, heads, layers)).total
    assert counted - eq2 == pytest.approx(2 * hidden, abs=1)


def test_parameter_count_by_hand_1_7b():
    # 12 L h^2 = 12 * 24 * 2304^2 = 1,528,823,808; 13 L h = 718,848; (V + s) h =
    # 53,248 * 2304 = 122,683,392; final norm 2h = 4,608: 1,652,230,656.
    assert F.parameter_counts(ModelConfig.from_name("gpt-1.7b")).total == 1_652_230_656


def test_moe_parameters_mixtral_8x7b():
    # Mixtral 8x7B (published: 46.7B total, 12.9B active). By hand, per layer: attention
    # 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 = 41,943,040; two RMSNorms 8,192; router
    # 4096 * 8 = 32,768; one SwiGLU expert 3 * 4096 * 14336 = 176,160,768.
    # total = 32 * (41,984,000 + 8 * 176,160,768) + 2 * 32000 * 4096 + 4096 = 46,702,792,704
    # active = 32 * (41,984,000 + 2 * 176,160,768) + 262,148,096 = 12,879,925,248
    mixtral = ModelConfig(name="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32,
                          num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                          max_position_embeddings=32768)
    c = F.parameter_counts(mixtral, num_experts=8, experts_per_token=2)
    assert c.total == 46_702_792_704
    assert c.active == 12_879_925_248


def test_params_per_rank():
    # gpt-1.7b on tp 2 pp 2: 12 layers of (12h^2 + 13h) / 2 = 63,730,944 / 2 each =
    # 382,385,664, plus the larger end: the embedding (51200 + 2048) * 2304 / 2 = 61,341,696
    # (the last rank's copy of the tied output, 51200 * 2304 / 2 = 58,982,400, plus the final
    # norm 4,608, is smaller): 443,727,360.
    c = F.parameter_counts(ModelConfig.from_name("gpt-1.7b"))
    assert F.params_per_rank(c, tp=2, pp=2) == 443_727_360
    # tp 1 pp 1: everything, once.
    assert F.params_per_rank(c, tp=1, pp=1) == c.total == 1_652_230_656


def test_model_state_bytes():
    # 18 bytes per parameter [ZeRO]: 2 + 4 + 12; sharded over 8 ranks: 2 + 4 + 12 / 8.
    assert F.model_state_bytes(1e9) == (2e9, 4e9, 12e9)
    assert F.model_state_bytes(1e9, dp=8, sharded_optimizer=True) == (2e9, 4e9, 1.5e9)


# Korthikanti Table 2 for GPT-3 175B: s = 2048, b = 1, h = 12288, a = 96, t = 8.
# s b h = 25,165,824 and 5 a s / h = 5 * 96 * 2048 / 12288 = 80.
SBH = 25_165_824
KORTHIKANTI_175B = [
    # (t, sp, recompute, bytes by hand)
    (1, False, "none", 114 * SBH),  # 34 + 80 = 114 sbh = 2,868,903,936
    (8, False, "none", 23 * SBH),  # 10 + 24/8 + 80/8 = 23 sbh = 578,813,952
    (8, True, "none", 114 * SBH / 8),  # (34 + 80) / 8 = 14.25 sbh = 358,612,992
    (8, False, "selective", 13 * SBH),  # 10 + 24/8 = 13 sbh = 327,155,712
    (8, True, "selective", 34 * SBH / 8),  # 34/8 = 4.25 sbh = 106,954,752
    (8, False, "full", 2 * SBH),  # 2 sbh = 50,331,648
]


@pytest.mark.parametrize("t,sp,recompute,expected", KORTHIKANTI_175B)
def test_korthikanti_table2_rows(t, sp, recompute, expected):
    assert F.korthikanti_activation_bytes(2048, 1, 12288, 96, t, sp, recompute) == expected
    # The generalised per-layer count gives the same for the GPT-3 shape.
    model = ModelConfig.from_name("gpt3-175b")
    assert F.layer_activation_bytes(model, 2048, 1, t, sp, recompute) == pytest.approx(expected)


def test_korthikanti_five_fold_saving():
    # "sequence parallelism with selective recomputation reduces activation memory 5x"
    # against tensor parallelism alone: 23 / 4.25 = 5.4 for GPT-3 at t = 8.
    tp_only = F.korthikanti_activation_bytes(2048, 1, 12288, 96, 8)
    both = F.korthikanti_activation_bytes(2048, 1, 12288, 96, 8, True, "selective")
    assert tp_only / both == pytest.approx(23 / 4.25)


def test_gqa_and_swiglu_activation_units():
    # llama3-8b: h 4096, 32 heads, 8 kv heads (kv/a = 1/4), ffn 14336 (3.5h), SwiGLU.
    # split = Q 2 + K,V 4 * 1/4 + projection input 2 + MLP 6 * 3.5 = 2 + 1 + 2 + 21 = 26.
    u = F.layer_activation_units(ModelConfig.from_name("llama3-8b"))
    assert (u.replicated, u.split, u.scores) == (10.0, 26.0, 5.0)
    assert F.layer_activation_units(ModelConfig.from_name("llama3-8b"), True).scores == 0.0


def test_inflight_microbatches():
    # 1F1B holds p micro-batches on the first rank; interleaved p (1 + (p-1)/(p v)):
    # p = 8, v = 2: 8 * (1 + 7/16) = 11.5; fewer micro-batches than stages: only m.
    assert F.inflight_microbatches(8, 96) == 8
    assert F.inflight_microbatches(8, 96, 2) == 11.5
    assert F.inflight_microbatches(8, 4) == 4
    assert F.inflight_microbatches(1, 96) == 1


def test_ptdp_flops_per_iteration_1_7b():
    # B = 512, s = 2048, L = 24, h = 2304, V = 51200:
    # 96 B s L h^2 = 96 * 512 * 2048 * 24 * 2304^2 = 12,824,703,626,379,264
    # s/(6h) = 2048/13824 = 0.148148..., V/(16 L h) = 51200/884736 = 0.0578704...
    # full recompute: 12.8247e15 * 1.2060185 = 1.54668e16
    full = F.ptdp_flops_per_iteration(512, 2048, 24, 2304, 51200, "full")
    assert full == pytest.approx(1.54668e16, rel=1e-5)
    # without: 72 ... (1 + 0.148148 + 51200/663552 = 0.0771605) = 1.17857e16
    assert F.ptdp_flops_per_iteration(512, 2048, 24, 2304, 51200, "none") == pytest.approx(
        1.17857e16, rel=1e-5)
    # selective: 72 ... (1 + 2 * 2048 / 20736 = 0.197531 + 0.0771605) = 1.22607e16
    assert F.ptdp_flops_per_iteration(512, 2048, 24, 2304, 51200, "selective") == \
        pytest.approx(1.22607e16, rel=1e-5)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_step_flops_equal_ptdp_formula_for_gpt(recompute):
    # The planner counts FLOPs from the model's shapes; for a GPT it is eq. 3 exactly.
    job = E.Job(model=ModelConfig.from_name("gpt-1.7b"), hardware=load_hardware("a100-80gb"),
                global_batch=512, seq_len=2048, gpus_per_node=8, precision="bf16",
                flash_attention=False, overlap_grad_reduce=False)
    assert E.hardware_flops(job, recompute) == pytest.approx(
        F.ptdp_flops_per_iteration(512, 2048, 24, 2304, 51200, recompute), rel=1e-12)


def test_bubble_fractions():
    # (p - 1)/m and (p - 1)/(v m): p = 8, m = 96 -> 7/96 = 0.0729; v = 2 -> 7/192.
    assert F.bubble_fraction(8, 96) == pytest.approx(0.072917, rel=1e-4)
    assert F.bubble_fraction(8, 96, 2) == pytest.approx(7 / 192)
    assert F.bubble_fraction(1, 4) == 0


def test_pipeline_costs_beyond_the_bubble():
    # Scatter/gather (PTD-P 4.1): the receivers all-gather the t slices over NVLink,
    # 7/8 * 2048 * 12288 * 2 = 44,040,192 bytes at t = 8; nothing at t = 1 or with SP.
    assert F.pp_gather_bytes(2048, 1, 12288, 8) == pytest.approx(44_040_192)
    assert F.pp_gather_bytes(2048, 1, 12288, 1) == 0
    assert F.pp_gather_bytes(2048, 1, 12288, 8, sequence_parallel=True) == 0
    # Transfers on the critical path: 2 v m steady state + 2 (p - 1) fill and drain;
    # p = 8, m = 96, v = 2: 384 + 14 = 398; none without a pipeline.
    assert F.pipeline_critical_transfers(8, 96, 2) == 398
    assert F.pipeline_critical_transfers(8, 96) == 206
    assert F.pipeline_critical_transfers(1, 96, 1) == 0
    # Tied embeddings across stages: all-reduce of V/t x h 16-bit gradients between 2 ranks,
    # 51200/8 * 12288 * 2 = 157,286,400 bytes.
    assert F.embedding_grad_sync_bytes(51200, 12288, 8, 2) == pytest.approx(157_286_400)
    # The first stage's dense embedding gradient: V/t x h written in 16 bits, read back and
    # added into fp32 main grads, 6400 * 12288 * 2 * (2 + 4) = 943,718,400 bytes.
    assert F.embedding_backward_bytes(51200, 12288, 8) == pytest.approx(943_718_400)


def test_communication_volumes():
    # Ring all-reduce of 100 MB over 8 ranks sends 2 * 7/8 * 100 = 175 MB per rank; an
    # all-gather 87.5 MB.
    assert F.allreduce_bytes(100e6, 8) == pytest.approx(175e6)
    assert F.allgather_bytes(100e6, 8) == pytest.approx(87.5e6)
    # GPT-3 layer at t = 8: activations s b h * 2 bytes = 50,331,648; two all-reduces send
    # 2 * 1.75 * 50,331,648 = 176,160,768 bytes, and SP's 2 all-gathers + 2 reduce-scatters
    # 4 * 0.875 * 50,331,648 the same.
    assert F.tp_layer_comm_bytes(2048, 1, 12288, 8, False) == pytest.approx(176_160_768)
    assert F.tp_layer_comm_bytes(2048, 1, 12288, 8, True) == pytest.approx(176_160_768)
    assert F.tp_layer_comm_bytes(2048, 1, 12288, 1, False) == 0
    # PP with the scatter/gather optimisation: s b h * 2 / t = 6,291,456 bytes per boundary.
    assert F.pp_p2p_bytes(2048, 1, 12288, 8) == 6_291_456
    # DP: 1e9 fp32 grads over 32 ranks: 2 * 31/32 * 4e9 = 7.75e9 bytes.
    assert F.dp_grad_bytes(1e9, 32, 4) == pytest.approx(7.75e9)
    # CP (Llama3-8B, 8 kv heads of 128, s 8192, b 1, cp 4): K and V 2 * 8192 * 8 * 128 * 2
    # bytes = 33,554,432, of which 3/4 arrive: 25,165,824.
    assert F.cp_layer_comm_bytes(8192, 1, 8, 128, 4) == pytest.approx(25_165_824)
    # EP: 4096 tokens, top-2, h 4096, ep 8: 2 * 4096 * 2 * 4096 * 2 * 7/8 = 117,440,512.
    assert F.ep_layer_comm_bytes(4096, 4096, 2, 8) == pytest.approx(117_440_512)


def test_ptdp_training_time_gpt3():
    # PTD-P eq. 4, section 5.1's example: GPT-3 175B, 300B tokens, 1024 A100 at 140 TFLOP/s:
    # 8 * 300e9 * 175e9 / (1024 * 140e12) = 2,929,687 s = 33.9 days ("about 34 days").
    assert F.training_days_ptdp(300e9, 175e9, 1024, 140) == pytest.approx(33.9, abs=0.05)


def test_kv_cache_bytes_nemotron4_340b():
    # 2 (K and V) * 96 layers * 8 kv heads * 192 head dim * 2 bytes = 589,824 bytes per token.
    model = ModelConfig.from_name("nemotron4-340b")
    assert F.kv_cache_bytes(model, 1) == 589_824
    assert F.kv_cache_bytes(model, 4096, 1) == 589_824 * 4096 / 2


@pytest.mark.parametrize("name", [n for n, fields in PRESETS.items()
                                  if fields.get("family") not in ("t5", "bert")])
def test_parameter_counts_equal_every_decoder_preset(name):
    """The planner's total is the parameter shapes Tessera builds for every decoder preset:
    Qwen2's q/k/v-only biases, OLMo-2's projection-wide q/k norms, Gemma's weight-only
    (1 + w) RMSNorms and sandwich norms, multi-head latent attention included."""
    from tessera.core.parallel.sharding import num_parameters

    model = ModelConfig.from_name(name)
    assert F.parameter_counts(model).total == num_parameters(model)
