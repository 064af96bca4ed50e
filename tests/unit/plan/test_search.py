"""The planner against published results: PTD-P Table 1 (Narayanan et al. 2021), GPT-3 175B
training time with sequence parallelism and selective recomputation (Korthikanti et al. 2022),
Nemotron-4 340B serving on one DGX H100; and its answers to bad input."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys

import pytest

from tessera.core.config import ModelConfig
from tessera.plan import (
    Fixed,
    PlanError,
    TrainingJob,
    evaluate,
    explain,
    load_hardware,
    plan_serving,
    plan_training,
)

A100 = load_hardware("a100-80gb")

# PTD-P Table 1: params (B), heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU.
TABLE1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
          (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
          (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
          (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
          (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
          (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
          (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
          (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
ROWS = {row[0]: row for row in TABLE1}
# The 2021 runs: fp16 with 16-bit gradient all-reduce, full activation recomputation (the
# FLOPs of eq. 3), no sequence parallelism and no distributed optimizer (neither existed),
# unfused attention. The published launch script of Table 1 (Megatron-LM
# examples/sc21/run_table_1.sh) gives what the paper does not list: the micro-batch, the layers
# per virtual stage, and torch DDP (reduction overlapping the backward) for the pp = 1 rows,
# local DDP (reduction after the backward) for the pipelined ones, as the 2021 schedules
# require (see estimate.overlaps_grad_reduce). The search tests below leave micro-batch and
# virtual stages to the planner; test_ptdp_table1_published_configurations fixes them.
# billions: (micro-batch, layers per virtual stage or None for 1F1B)
SC21_RUNS = {1.7: (16, None), 3.6: (16, None), 7.5: (16, None), 18.4: (8, None),
             39.1: (4, None), 76.1: (2, 5), 145.6: (2, 5), 310.1: (1, 3), 529.6: (1, 1),
             1008.0: (1, None)}
PAPER_FIXED = Fixed(recompute="full", sequence_parallel=False, sharded_optimizer=False, cp=1)


def ptdp_job(billions: float) -> TrainingJob:
    _, a, h, L, _, _, gpus, batch, _ = ROWS[billions]
    model = ModelConfig(name=f"gpt-{billions}b", family="gpt2", norm="layernorm",
                        activation="gelu_tanh", position="learned", bias=True,
                        tied_embeddings=True, vocab_size=51200, hidden_size=h, num_layers=L,
                        num_heads=a, ffn_hidden_size=4 * h, max_position_embeddings=2048)
    return TrainingJob(model, gpus, A100, batch, 2048, flash_attention=False,
                       overlap_grad_reduce=True, overlap_grad_reduce_in_pipeline=False,
                       grad_reduce_bytes=2)


@functools.cache  # each row is searched once for both tests below
def paper_and_best(billions: float):
    _, _, _, _, tp, pp, _, _, _ = ROWS[billions]
    ranked = plan_training(ptdp_job(billions), PAPER_FIXED)
    paper = next(c for c in ranked if (c.tp, c.pp) == (tp, pp))
    return paper, ranked[0]


@pytest.mark.parametrize("billions", list(ROWS))
def test_ptdp_table1_published_configurations(billions):
    # Each row exactly as launched (layout, micro-batch, virtual stages, DDP): the predicted
    # TFLOP/s per GPU against the measured one. All within 7% (1T: -6.4%, 76.1B: +4.4%, the
    # rest within 3.3%); the brief's bar is 15%.
    _, _, _, L, tp, pp, _, _, measured = ROWS[billions]
    mb, layers_per_virtual = SC21_RUNS[billions]
    v = 1 if layers_per_virtual is None else L // pp // layers_per_virtual
    c = evaluate(ptdp_job(billions), dict(tp=tp, pp=pp, virtual_stages=v, micro_batch=mb,
                                          **{f: getattr(PAPER_FIXED, f) for f in
                                             ("recompute", "sequence_parallel",
                                              "sharded_optimizer", "cp")}))
    assert c.fits
    assert c.tflops_per_gpu == pytest.approx(measured, rel=0.07)


@pytest.mark.parametrize("billions", list(ROWS))
def test_ptdp_table1_throughput_within_15_percent(billions):
    # The brief's bar is 15%; every row is within 6% (see docs/planner-model.md), so
    # the model cannot drift far unnoticed.
    paper, _ = paper_and_best(billions)
    assert paper.fits
    assert paper.tflops_per_gpu == pytest.approx(ROWS[billions][-1], rel=0.15)
    assert paper.tflops_per_gpu == pytest.approx(ROWS[billions][-1], rel=0.06)


# The paper's (tp, pp) is the planner's first choice or within 3% of its best throughput.
# The model disagrees with the paper's rule of thumb (PTD-P section 5.4, takeaway #1: tp up
# to the node size first) where a smaller tp with a few interleaved pipeline stages avoids
# tp's NVLink all-reduces, its thinner per-rank GEMMs and its replicated norm/dropout work (no
# sequence parallelism in 2021), after the pipeline's own costs (bubble, blocking p2p with
# scatter/gather, fill and drain, tied-embedding all-reduce, the heavier last stage, and a
# gradient reduction that cannot overlap the backward in a 2021 pipeline): 18.4B (tp2 pp4 v5
# predicted 6.6% faster), and by less 3.6B, 7.5B, 39.1B. Table 1's runs did not measure those
# layouts; where the paper measured the trade-off itself (Fig. 13 to 15) the model agrees with
# it (below). docs/planner-model.md, "PTD-P Table 1, 18.4B", has the analysis.
_18B_REASON = (
    "tp2 pp4 v5 mb2 predicted 6.6% faster than the paper's tp8 pp1 (8.54 vs 9.10 s a step; "
    "148.6 vs 139.4 TFLOP/s, the paper measured 135): tp8 spends 1.42 s in NVLink "
    "all-reduces (0.95 s + 0.47 s in the recompute: 6 a layer per micro-batch, each "
    "2 x 7/8 x s b h x 2 bytes at 240 GB/s; nccl-tests users measure ~205 GB/s, which would cost more) "
    "against tp2's 0.22 s; tp2 pp4 v5 pays 0.28 s bubble, 0.34 s p2p (at PTD-P Fig. 18's "
    "14 GB/s per send) and 0.12 s of data-parallel reduction that tp8 hides behind its "
    "backward (torch DDP, pp = 1). PTD-P Fig. 12 shows the model over-predicting the "
    "interleaved schedule by ~0.2 s a step, cause not found (test_ptdp_figure_12_schedules)")
LAYOUT_CHOICE = [
    pytest.param(1.7, 0.03, id="1.7B"),
    pytest.param(18.4, 0.03, id="18.4B", marks=pytest.mark.xfail(strict=True,
                                                                  reason=_18B_REASON)),
    pytest.param(76.1, 0.03, id="76.1B"),
    pytest.param(145.6, 0.03, id="145.6B"),
    pytest.param(310.1, 0.03, id="310.1B"),
    pytest.param(529.6, 0.03, id="529.6B"),
    pytest.param(1008.0, 0.03, id="1008B"),
    # Known deviations, bounded so that the model cannot drift further unnoticed.
    pytest.param(3.6, 0.05, id="3.6B-deviation"),
    pytest.param(7.5, 0.08, id="7.5B-deviation"),
    pytest.param(39.1, 0.085, id="39.1B-deviation"),  # 7.4%
    pytest.param(18.4, 0.07, id="18.4B-deviation"),  # 6.6%
]


@pytest.mark.parametrize("billions,gap", LAYOUT_CHOICE)
def test_ptdp_table1_layout_choice(billions, gap):
    paper, best = paper_and_best(billions)
    assert best.tokens_per_s <= paper.tokens_per_s * (1 + gap), (
        f"best {best.layout} {best.tflops_per_gpu:.0f} TFLOP/s vs paper {paper.layout} "
        f"{paper.tflops_per_gpu:.0f}")


def gpt_2021(hidden: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(name=f"gpt-h{hidden}", family="gpt2", norm="layernorm",
                       activation="gelu_tanh", position="learned", bias=True,
                       tied_embeddings=True, vocab_size=51200, hidden_size=hidden,
                       num_layers=layers, num_heads=heads, ffn_hidden_size=4 * hidden,
                       max_position_embeddings=2048)


def _tflops(model: ModelConfig, batch: int, tp: int, pp: int) -> float:
    job = TrainingJob(model, 64, A100, batch, 2048, flash_attention=False,
                      overlap_grad_reduce=False, grad_reduce_bytes=2)
    fixed = dataclasses.replace(PAPER_FIXED, tp=tp, pp=pp, virtual_stages=1, micro_batch=1)
    return plan_training(job, fixed, top=1)[0].tflops_per_gpu


def test_ptdp_section_5_4_trade_offs():
    # PTD-P section 5.4 measures the trade-offs directly on 64 A100s, micro-batch 1, with the
    # non-interleaved schedule; the model ranks them as the paper does.
    # Fig. 13, 161B (32 layers, hidden 20480, 128 heads), tp x pp = 64: tp up to the node
    # size (tp8 pp8) beats more pipeline stages (tp4 pp16, tp2 pp32) at every batch size.
    big = gpt_2021(20480, 32, 128)
    for batch in (32, 128, 512):
        t2, t4, t8 = (_tflops(big, batch, tp, 64 // tp) for tp in (2, 4, 8))
        assert t8 > t4 > t2, (batch, t2, t4, t8)
    # Fig. 14 and 15, 5.9B (32 layers, hidden 3840, 32 heads): with data parallelism over the
    # rest, throughput falls as the pipeline (tp 1) or tensor-parallel (pp 1) size grows.
    small = gpt_2021(3840, 32, 32)
    for batch in (128, 512):
        p2, p4, p8 = (_tflops(small, batch, 1, pp) for pp in (2, 4, 8))
        assert p2 > p4 > p8, (batch, p2, p4, p8)
        t2, t4, t8 = (_tflops(small, batch, tp, 1) for tp in (2, 4, 8))
        assert t2 > t4 > t8, (batch, t2, t4, t8)


# PTD-P Fig. 12 (and Fig. 18's scatter/gather curve, the same runs): GPT-3 175B on 96 A100s,
# tp8 pp12, micro-batch 1, full recomputation, local DDP, 2 layers per virtual stage when
# interleaved (Megatron-LM examples/sc21/run_figure_12.sh). TFLOP/s per GPU read off the
# figure (about +-2): batch -> (non-interleaved, interleaved).
FIG12 = {12: (82, 119), 24: (109, 134), 36: (122, 141), 48: (130, 143), 60: (135, 146)}


@pytest.mark.parametrize("batch", list(FIG12))
def test_ptdp_figure_12_schedules(batch):
    # The non-interleaved schedule within 2% at every batch size; the interleaved one is
    # over-predicted by 1.6-5.4% (about 0.2 s a step, flat in the batch size: a cost of the
    # interleaved schedule the model lacks, not found; docs/planner-model.md, "PTD-P Table 1, 18.4B"),
    # bounded here so that it cannot grow unnoticed.
    job = TrainingJob(gpt_2021(12288, 96, 96), 96, A100, batch, 2048, flash_attention=False,
                      overlap_grad_reduce=True, overlap_grad_reduce_in_pipeline=False,
                      grad_reduce_bytes=2)
    non, inter = (evaluate(job, dict(tp=8, pp=12, virtual_stages=v, micro_batch=1,
                                     **{f: getattr(PAPER_FIXED, f) for f in
                                        ("recompute", "sequence_parallel",
                                         "sharded_optimizer", "cp")})).tflops_per_gpu
                  for v in (1, 4))
    paper_non, paper_inter = FIG12[batch]
    assert non == pytest.approx(paper_non, rel=0.02)
    assert paper_inter <= inter <= paper_inter * 1.06


def test_pipeline_transfers_by_hand():
    # 18.4B, tp2 pp4 v5 micro-batch 2, 256 GPUs: m = 1024 / (32 x 2) = 16 micro-batches.
    # Each of the 2 v m + 2 (p - 1) = 166 transfers: a tp rank's half of s b h in 16 bits over
    # its HDR port at PTD-P Fig. 18's 0.56 x 25 GB/s plus 20 us, then the NVLink all-gather of
    # the other half (240 GB/s, 20 us). Then the tied embedding's gradient all-reduce between
    # the first and last stage (two ranks: V h / 2 x 2 bytes once, over 0.8 x 25 GB/s).
    c = evaluate(ptdp_job(18.4), dict(tp=2, pp=4, virtual_stages=5, micro_batch=2,
                                      recompute="full", sequence_parallel=False,
                                      sharded_optimizer=False))
    sbh = 2048 * 2 * 6144 * 2
    one = sbh / 2 / (0.56 * 25e9) + 20e-6 + sbh / 2 / 240e9 + 20e-6
    embedding = 51200 / 2 * 6144 * 2 / (0.8 * 25e9) + 20e-6
    assert c.time.pp == pytest.approx(166 * one + embedding, rel=1e-9)


def gpt3_job() -> TrainingJob:
    # Korthikanti et al. 2022 ran Megatron with unfused attention and no gradient-reduction
    # overlap; GPT-3's batch of 1536 sequences of 2048 tokens, 300B tokens.
    return TrainingJob(ModelConfig.from_name("gpt3-175b"), 1024, A100, 1536, 2048,
                       tokens=300e9, flash_attention=False, overlap_grad_reduce=False)


def test_gpt3_175b_training_days():
    selective = plan_training(gpt3_job(), Fixed(sequence_parallel=True, recompute="selective",
                                                cp=1), top=1)[0]
    assert selective.days == pytest.approx(24, rel=0.20)
    full = plan_training(gpt3_job(), Fixed(sequence_parallel=True, recompute="full", cp=1),
                         top=1)[0]
    assert 1.20 <= full.days / selective.days <= 1.30
    # Full recomputation executes more FLOPs per second but trains slower (MFU).
    assert full.tflops_per_gpu > selective.tflops_per_gpu
    assert full.mfu < selective.mfu


def test_nemotron4_340b_serving_on_one_dgx_h100():
    model, h100 = ModelConfig.from_name("nemotron4-340b"), load_hardware("h100-80gb")
    bf16 = plan_serving(model, 8, h100, "bf16")
    assert not bf16.fits and bf16.recommended is None
    assert "does not fit" in bf16.message and "FP8" in bf16.message
    fp8 = plan_serving(model, 8, h100, "fp8")
    assert fp8.fits
    assert fp8.recommended.tp * fp8.recommended.pp == 8
    assert fp8.recommended.memory_gib <= h100.memory_gib
    assert fp8.recommended.max_batch >= 1
    assert "weight-only" not in fp8.message  # H100 runs FP8 GEMMs


def test_fp8_serving_on_a100_is_said_to_be_weight_only():
    a100 = load_hardware("a100-80gb")
    plan = plan_serving(ModelConfig.from_name("llama3-8b"), 8, a100, "fp8")
    bf16 = plan_serving(ModelConfig.from_name("llama3-8b"), 8, a100, "bf16")
    assert plan.fits and "a100-80gb has no FP8 tensor cores, so this is weight-only FP8" in \
        plan.message
    # Decode streams the weights, so the halved bytes still shorten a token.
    assert plan.recommended.time_per_token_s < bf16.recommended.time_per_token_s


def test_gradient_reduction_overlaps_only_where_the_2021_schedules_let_it():
    # 18.4B, 256 GPUs, dp 32 either way, 16-bit gradients.
    # Without overlap, by hand: ring all-reduce 2 x 31/32 x P x 2 bytes over the link of the
    # ranks' nodes (tp8: one dp rank per node, one 25 GB/s NIC at 80%; tp2: four ranks, four
    # NICs) plus two start-ups of 20 us.
    job = ptdp_job(18.4)
    fixed = dict(recompute="full", sequence_parallel=False, sharded_optimizer=False)
    tp8 = dict(tp=8, pp=1, micro_batch=8, **fixed)
    tp2 = dict(tp=2, pp=4, virtual_stages=5, micro_batch=2, **fixed)
    never = dataclasses.replace(job, overlap_grad_reduce=False)
    always = dataclasses.replace(job, overlap_grad_reduce_in_pipeline=True)
    # Parameters of the most loaded rank: its layers' 12 h^2 / tp, the word embedding's
    # V h / tp and the learned positions' s h (norms and biases: < 0.1%).
    h = 6144
    params = {8: 40 * 12 * h * h / 8 + 51200 * h / 8 + 2048 * h,
              2: 10 * 12 * h * h / 2 + 51200 * h / 2 + 2048 * h}
    by_hand = {8: 2 * 31 / 32 * params[8] * 2 / 20e9 + 40e-6,
               2: 2 * 31 / 32 * params[2] * 2 / 80e9 + 40e-6}
    assert evaluate(never, tp8).time.dp == pytest.approx(by_hand[8], rel=0.01)
    assert evaluate(never, tp2).time.dp == pytest.approx(by_hand[2], rel=0.01)
    # torch DDP (pp 1) hides it behind the last micro-batch's backward (~1 s here) ...
    assert evaluate(job, tp8).time.dp == 0.0
    # ... the pipelined schedules of 2021 did not (local DDP, after the backward) ...
    assert evaluate(job, tp2).time.dp == evaluate(never, tp2).time.dp
    # ... and a schedule that can overlap in a pipeline hides it there too.
    assert evaluate(always, tp2).time.dp == 0.0


@pytest.mark.parametrize("fields,layer_units", [
    # (layout, recompute): forward units of layer cost per micro-batch on the slowest rank
    (dict(tp=1, pp=1, recompute="none"), 24 * 3),  # forward + 2 x backward of 24 layers
    (dict(tp=1, pp=1, recompute="full"), 24 * 4),  # + the recomputed forward
    (dict(tp=1, pp=2, recompute="none"), 12 * 3),  # 12 layers a rank
])
def test_fixed_costs_per_layer_and_micro_batch(fields, layer_units):
    # 1.7B on 32 GPUs, micro-batch 16: dp 32 -> m = 1 (pp 1); dp 16 -> m = 2 (pp 2), whose
    # pipeline adds (p - 1) = 1 micro-batch slot of bubble. By hand: slots x (units x layer +
    # micro-batch cost).
    job = dataclasses.replace(ptdp_job(1.7), overlap_grad_reduce=False)
    costly = dataclasses.replace(job, hardware=dataclasses.replace(
        A100, layer_overhead_us=100.0, microbatch_overhead_us=500.0))
    config = dict(micro_batch=16, sequence_parallel=False, sharded_optimizer=False, **fields)
    slots = 1 if fields["pp"] == 1 else 2 + 1
    extra = evaluate(costly, config).step_time_s - evaluate(job, config).step_time_s
    assert extra == pytest.approx(slots * (layer_units * 100e-6 + 500e-6))


def test_fixed_dimensions_and_evaluate_agree():
    job = TrainingJob(ModelConfig.from_name("gpt-1.7b"), 32, A100, 512, 2048)
    ranked = plan_training(job, Fixed(tp=2, micro_batch=4), top=3)
    assert len(ranked) == 3
    assert all(c.tp == 2 and c.micro_batch == 4 for c in ranked)
    assert [c.step_time_s for c in ranked] == sorted(c.step_time_s for c in ranked)
    best = ranked[0]
    again = evaluate(job, {k: getattr(best, k) for k in (
        "tp", "pp", "virtual_stages", "cp", "ep", "micro_batch", "sequence_parallel",
        "recompute", "recompute_layers", "sharded_optimizer")})
    assert again == best
    assert "faster than" in explain(ranked[0], ranked[1])


def test_candidate_json_contract():
    job = TrainingJob(ModelConfig.from_name("gpt-1.7b"), 32, A100, 512, 2048, tokens=1e11)
    best = plan_training(job, Fixed(tp=2, cp=1), top=1)[0]
    d = best.to_dict()
    # A candidate is its configuration plus the prediction: the configuration alone, passed
    # back, predicts the same.
    assert dataclasses.asdict(best.config).items() <= d.items()
    assert evaluate(job, dataclasses.asdict(best.config)).to_dict() == d
    for key in ("tp", "pp", "virtual_stages", "dp", "cp", "ep", "micro_batch",
                "sequence_parallel", "recompute", "recompute_layers", "memory_gib",
                "step_time_s", "tflops_per_gpu", "mfu", "days"):
        assert key in d
    assert d["memory_gib"] == pytest.approx(d["memory"]["total"])
    assert d["step_time_s"] == pytest.approx(d["time"]["total"])
    assert d["days"] == pytest.approx(1e11 / d["tokens_per_s"] / 86400)


def test_evaluate_names_every_broken_rule():
    job = TrainingJob(ModelConfig.from_name("gpt-1.7b"), 32, A100, 512, 2048)
    with pytest.raises(PlanError) as err:
        evaluate(job, {"tp": 16, "pp": 5})
    text = str(err.value)
    assert "tp 16" in text and "num_layers 24 is not divisible by pp 5" in text


def test_model_that_fits_nothing_says_what_would():
    job = TrainingJob(ModelConfig.from_name("llama3-8b"), 1, load_hardware("a100-40gb"), 8, 2048)
    with pytest.raises(PlanError) as err:
        plan_training(job)
    text = str(err.value)
    assert "does not fit on 1 x a100-40gb" in text
    assert "4 x a100-40gb would fit" in text and "h200" in text


def test_gpus_not_a_multiple_of_the_node():
    job = TrainingJob(ModelConfig.from_name("gpt-1.7b"), 12, A100, 96, 2048)
    with pytest.raises(PlanError, match="12 GPUs is not a whole number of 8-GPU nodes; use 8 or 16"):
        plan_training(job)


def test_unknown_gpu_and_missing_precision():
    with pytest.raises(PlanError, match=r"unknown hardware 'b200'; choose one of \['a100-40gb'"):
        load_hardware("b200")
    job = TrainingJob(ModelConfig.from_name("gpt-1.7b"), 8, A100, 64, 2048, precision="fp8")
    with pytest.raises(PlanError, match="a100-80gb has no fp8 peak"):
        plan_training(job)


def test_planning_imports_no_torch():
    code = ("import sys, tessera.plan; from tessera.plan import plan_training; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_memory_breakdown_by_hand_1_7b():
    # gpt-1.7b, tp1 pp1 dp32, micro-batch 1, no recompute, no sharded optimizer, unfused
    # attention. P = 1,652,230,656: weights 2P = 3,304,461,312 bytes = 3.0775 GiB, grads
    # 4P = 6.1550 GiB, Adam 12P = 18.4651 GiB. Activations: s b h = 2048 * 2304 = 4,718,592;
    # per layer (34 + 5 * 24 * 2048 / 2304 = 140.667) s b h = 663,748,608, x 24 layers =
    # 15,929,966,592; embedding 8 s b + s b h = 4,734,976; logits 4 s b (h + V) =
    # 4 * 2048 * 53504 = 438,304,768; in all 16,373,006,336 bytes = 15.2486 GiB.
    # Sum 42.9462 GiB, plus the framework overhead.
    job = TrainingJob(ModelConfig.from_name("gpt-1.7b"), 32, A100, 512, 2048,
                      flash_attention=False)
    c = evaluate(job, {"micro_batch": 1, "recompute": "none", "sharded_optimizer": False})
    assert c.memory.weights == pytest.approx(3.0775, abs=1e-4)
    assert c.memory.gradients == pytest.approx(6.1550, abs=1e-4)
    assert c.memory.optimizer == pytest.approx(18.4651, abs=1e-4)
    assert c.memory.activations == pytest.approx(15.2486, abs=1e-4)
    assert c.memory.total == pytest.approx(42.9462 + A100.framework_overhead_gib, abs=1e-3)
    # A sharded optimizer over the 32 data-parallel ranks: 18.4651 / 32 = 0.5770 GiB.
    z = evaluate(job, {"micro_batch": 1, "recompute": "none", "sharded_optimizer": True})
    assert z.memory.optimizer == pytest.approx(0.5770, abs=1e-4)
    # Full recomputation keeps 2 s b h per layer (24 * 9,437,184 = 226,492,416) plus one
    # layer's activations while recomputing it (663,748,608): with embedding and logits
    # 1,333,280,768 bytes = 1.2417 GiB.
    f = evaluate(job, {"micro_batch": 1, "recompute": "full", "sharded_optimizer": False})
    assert f.memory.activations == pytest.approx(1.2417, abs=1e-4)


def test_serving_memory_by_hand():
    # llama3-8b in bf16 on one H100: weights 8,030,261,248 * 2 bytes = 14.96 GiB; KV cache
    # per 8192-token sequence 2 * 32 * 8 * 128 * 8192 * 2 = 1 GiB (1,073,741,824 bytes); the
    # free memory after weights and overhead, 79.6 - 14.96 - 3 = 61.64 GiB, holds 61.
    plan = plan_serving(ModelConfig.from_name("llama3-8b"), 1, load_hardware("h100-80gb"),
                        "bf16", batch=4, context=8192)
    best = plan.recommended
    assert (best.tp, best.pp) == (1, 1)
    assert best.weights_gib == pytest.approx(14.958, abs=1e-3)
    assert best.kv_cache_gib == pytest.approx(4.0)
    assert best.max_batch == 61
    # A latency bound nothing meets is said plainly, not ignored.
    strict = plan_serving(ModelConfig.from_name("llama3-8b"), 1, load_hardware("h100-80gb"),
                          max_latency_ms=0.1)
    assert not strict.fits and "latency" in strict.message


def test_activations_match_megatron_theoretical_memory():
    # Megatron-LM's theoretical_memory_usage.compute_activation_memory (SP + selective) for
    # GPT-3 175B, s 2048, b 1, t 8, p 8, v 1, m >= p, by hand: 34 s b h per layer x 96
    # layers = 25,165,824 * 34 * 96 = 82,141,249,536; embedding input 8 s b p = 131,072 and
    # dropout s b h p = 201,326,592; divided by t: 10,292,838,400 bytes. The planner adds one
    # layer's attention scores while they are recomputed, (80/8) s b h = 251,658,240.
    job = TrainingJob(ModelConfig.from_name("gpt3-175b"), 1024, A100, 1536, 2048,
                      flash_attention=False)
    c = evaluate(job, {"tp": 8, "pp": 8, "micro_batch": 1, "sequence_parallel": True,
                       "recompute": "selective"})
    assert c.memory.activations * 2**30 == pytest.approx(10_292_838_400 + 251_658_240)
    # Interleaved with v = 2: Megatron multiplies by 1 + (p - 1)/(p v) = 1 + 7/16.
    i = evaluate(job, {"tp": 8, "pp": 8, "virtual_stages": 2, "micro_batch": 1,
                       "sequence_parallel": True, "recompute": "selective"})
    assert i.memory.activations * 2**30 == pytest.approx(10_292_838_400 * 23 / 16 + 251_658_240)


def test_searched_full_recompute_takes_the_fewest_layers_that_fit():
    # llama2-7b, sequence 4096, on 8 A100-40GB at tp2 with SP and micro-batch 1: neither no
    # recompute nor selective fits; full recompute of 2 of the 32 layers does, 1 does not.
    job = TrainingJob(ModelConfig.from_name("llama2-7b"), 8, load_hardware("a100-40gb"), 64,
                      4096)
    ranked = plan_training(job, Fixed(tp=2, pp=1, cp=1, micro_batch=1, sequence_parallel=True))
    assert [(c.recompute, c.recompute_layers) for c in ranked] == [("full", 2)]
    one = evaluate(job, {"tp": 2, "micro_batch": 1, "sequence_parallel": True,
                         "recompute": "full", "recompute_layers": 1})
    assert not one.fits
    # Fixing recompute="full" means every layer (None), as TrainSchedule reads it.
    every = plan_training(job, Fixed(tp=2, pp=1, cp=1, micro_batch=1, sequence_parallel=True,
                                     recompute="full"))
    assert every[0].recompute_layers is None
    assert every[0].memory_gib < ranked[0].memory_gib
    assert every[0].step_time_s > ranked[0].step_time_s


def test_fp32_runs_count_fp32_states_and_activations():
    # A CPU run in fp32: weights 4 + grads 4 + Adam moments 8 = 16 bytes per parameter (no
    # master copy) against 2 + 4 + 12 in bf16, and activations twice the 16-bit counts.
    model = ModelConfig.from_name("llama-demo")
    fields = {"micro_batch": 2, "recompute": "none", "sharded_optimizer": False}
    bf16 = evaluate(TrainingJob(model, 1, A100, 8, 256), fields).memory
    fp32 = evaluate(TrainingJob(model, 1, A100, 8, 256, precision="fp32"), fields).memory
    assert fp32.weights == pytest.approx(2 * bf16.weights)
    assert fp32.gradients == pytest.approx(bf16.gradients)
    assert fp32.optimizer == pytest.approx(bf16.optimizer * 8 / 12)
    assert fp32.activations == pytest.approx(2 * bf16.activations)


def test_nemotron4_340b_training_mfu_on_h100():
    # Nemotron-4 340B technical report: 6144 H100 (768 DGX nodes), tp 8, pp 12 interleaved,
    # dp 64, sequence 4096, batch 2304, bf16: 41-42% MFU. The planner, free to pick the
    # interleaving depth, micro-batch and recomputation for that layout, predicts within 15%.
    job = TrainingJob(ModelConfig.from_name("nemotron4-340b"), 6144, load_hardware("h100-80gb"),
                      2304, 4096)
    best = plan_training(job, Fixed(tp=8, pp=12, cp=1, sequence_parallel=True), top=1)[0]
    assert best.dp == 64
    assert best.mfu == pytest.approx(0.415, rel=0.15)


def test_search_respects_head_rules_and_node_size():
    # 12 heads, 3 kv heads: tp 2 and 4 split kv heads unevenly (3 % tp and tp % 3 both
    # nonzero) and tp 8 does not divide 12 heads, so only tp 1 is valid (core.config rules).
    odd = ModelConfig(name="odd", vocab_size=1024, hidden_size=768, num_layers=4, num_heads=12,
                      num_kv_heads=3, ffn_hidden_size=2048, max_position_embeddings=1024)
    ranked = plan_training(TrainingJob(odd, 8, A100, 64, 1024))
    assert {c.tp for c in ranked} == {1}
    # With 4 GPUs per node, tp stays within 4 even on 16 GPUs.
    job = TrainingJob(ModelConfig.from_name("gpt-1.7b"), 16, A100, 256, 2048, gpus_per_node=4)
    assert max(c.tp for c in plan_training(job, Fixed(cp=1, micro_batch=1))) == 4


def test_fixed_recompute_layers_implies_full_recompute():
    # Layers to recompute mean full recomputation (as the CLI's --recompute-layers alone): every
    # candidate is then "full" with those layers; with another mode it is a mistake, refused.
    job = TrainingJob(ModelConfig.from_name("gpt-1.7b"), 8, A100, 64, 2048)
    ranked = plan_training(job, Fixed(recompute_layers=2), top=20)
    assert ranked and all(c.recompute == "full" and c.recompute_layers == 2 for c in ranked)
    with pytest.raises(PlanError, match="needs recompute='full'"):
        Fixed(recompute="selective", recompute_layers=2)


def test_fixed_recompute_layers_past_a_chunk_read_as_all():
    # 24 layers: 9 layers to recompute are 9 of a pp1 or pp2 chunk, but all of a pp2 v2
    # (6-layer) chunk, which the candidate says with None (as estimate.memory counts it).
    job = TrainingJob(ModelConfig.from_name("gpt-1.7b"), 8, A100, 64, 2048)
    ranked = plan_training(job, Fixed(recompute_layers=9), top=500)
    seen = {(c.pp, c.virtual_stages): c.recompute_layers for c in ranked}
    assert seen[(1, 1)] == 9 and seen[(2, 1)] == 9 and seen[(2, 2)] is None
