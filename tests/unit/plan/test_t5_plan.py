"""`tessera plan` for T5 (encoder-decoder): it proposes only what `tessera pretrain` runs for
T5 (no recomputation, one stage per rank, no cp, no fp8, pipeline sizes `t5_stage_split`
accepts) and refuses fixed flags that break those rules with the rule's own reason.
GPU profiles only: pure Python, no torch, no ranks."""

from __future__ import annotations

import pytest

from tessera.core.config import ConfigError, ModelConfig
from tessera.core.models.t5.layout import t5_pipeline_sizes, t5_stage_split
from tessera.plan import Fixed, PlanError, TrainingJob, load_hardware, plan_training


def _job(preset: str = "t5-base", gpus: int = 8, **kw) -> TrainingJob:
    return TrainingJob(model=ModelConfig.from_name(preset), gpus=gpus,
                       hardware=load_hardware("a100-80gb"), global_batch=256, seq_len=512, **kw)


def test_t5_candidates_are_what_pretrain_accepts():
    cands = plan_training(_job(gpus=24))
    assert cands
    pps = set()
    for c in cands:
        assert (c.recompute, c.virtual_stages, c.cp) == ("none", 1, 1)
        pps.add(c.pp)
    model = ModelConfig.from_name("t5-base")
    assert pps <= set(t5_pipeline_sizes(model))
    # dp divides the batch of 256, so tp x pp is 3 x a power of two (tp 1, 2, 4 or 8): pp 24 = 12 encoder + 12
    # decoder stages, which a decoder-only planner (pp dividing the 12 layers) never proposed.
    assert pps == {3, 6, 12, 24}


def test_t5_pipeline_sizes_follow_the_stage_split():
    # 12 encoder + 12 decoder layers: p stages split round(p/2) / p - round(p/2) (at least one
    # each), which must divide 12 each; e.g. 5 -> 2 + 3, 7 -> 4 + 3, 9 -> 4 + 5 (no).
    model = ModelConfig.from_name("t5-base")
    assert t5_pipeline_sizes(model) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 24]
    for p in range(1, 25):
        try:
            t5_stage_split(model, p)
            ok = True
        except ConfigError:
            ok = False
        assert ok == (p in t5_pipeline_sizes(model))


@pytest.mark.parametrize("fixed, says", [
    (Fixed(recompute="selective"), "recompute=selective: T5 trains without activation "
                                   "recomputation"),
    (Fixed(recompute="full"), "recompute=full: T5 trains without activation recomputation"),
    (Fixed(pp=2, virtual_stages=2), "virtual_stages=2: T5 runs one pipeline stage per rank"),
    (Fixed(cp=2), "cp=2: T5 runs without context parallelism"),
    (Fixed(pp=9), "cannot split over 4 encoder + 5 decoder stages evenly"),
])
def test_t5_fixed_flags_pretrain_refuses(fixed, says):
    with pytest.raises(PlanError) as err:
        plan_training(_job(gpus=72 if fixed.pp == 9 else 8), fixed)
    assert says in str(err.value)
    if fixed.pp != 9:  # 72 GPUs and batch 256 leave no valid pp at all
        assert "Valid here:" in str(err.value)


def test_t5_fp8_refused():
    job = TrainingJob(model=ModelConfig.from_name("t5-base"), gpus=8,
                      hardware=load_hardware("h100-80gb"), global_batch=256, seq_len=512,
                      precision="fp8")
    with pytest.raises(PlanError, match="T5 does not train in fp8"):
        plan_training(job)


def test_t5_memory_is_the_busiest_stage():
    # pp 2: stage 0 holds the embedding and 6 encoder layers, stage 1 the 6 decoder layers, a
    # copy of the embedding and the untied output: 162,623,616 parameters (formulas'
    # per-stage count, whose sum over stages is checked against HF in test_t5_counts.py),
    # 2 bytes each in bf16, 4 for the fp32 main gradients. At micro-batch 1 stage 0's two
    # micro-batches of encoder activations (~0.25 GB) weigh less than stage 1's extra 53M
    # parameters of model state (~0.85 GB), so stage 1 is the peak.
    from tessera.plan import evaluate

    c = evaluate(_job(), dict(tp=1, pp=2, dp=4, micro_batch=1))
    assert c.memory.weights == pytest.approx(2 * 162_623_616 / 2**30, rel=1e-12)
    assert c.memory.gradients == pytest.approx(4 * 162_623_616 / 2**30, rel=1e-12)
    assert c.time.recompute == 0 and c.time.bubble > 0


def test_t5_flops_and_mfu_count_both_stacks():
    from tessera.plan import estimate as E
    from tessera.plan import evaluate
    from tessera.plan.models.t5.formulas import t5_flops_per_step

    job = _job()
    flops = t5_flops_per_step(job.model, 256, 512, 116)
    assert E.hardware_flops(job._estimate, "none") == flops
    c = evaluate(job, dict(tp=1, pp=1, dp=8, micro_batch=8))
    assert c.tflops_per_gpu == pytest.approx(flops / c.step_time_s / 8 / 1e12, rel=1e-12)
    # By hand, t5-base (h 768, 12 heads x 64, f 2048 gated, V 32128, 12 + 12 layers), s_e 512,
    # s_d 116, forward per sample:
    #   encoder layer 2 x 512 x (4 x 768^2 + 3 x 768 x 2048) + 4 x 512^2 x 768 = 8,053,063,680
    #   decoder layer 2 x 116 x (6 x 768^2 + 3 x 768 x 2048) + 2 x 512 x 2 x 768^2
    #                 + 4 x 116 x (116 + 512) x 768 = 3,347,496,960
    #   output 2 x 116 x 768 x 32128 = 5,724,438,528
    #   12 x 8,053,063,680 + 12 x 3,347,496,960 + 5,724,438,528 = 142,531,166,208
    # step: 3 (forward + backward) x 256 samples = 109,463,935,647,744; a decoder-only count of
    # 12 layers over 512 tokens gave 93,621,697,118,208 (no decoder stack, logits over 512).
    assert flops == 3 * 256 * 142_531_166_208 == 109_463_935_647_744


def test_t5_output_yaml_is_what_pretrain_runs(tmp_path, capsys):
    """`tessera plan --output` for T5 writes a config `tessera pretrain` loads and its T5
    objective accepts (with the tokenizer the data needs), through the real loaders."""
    from tessera.__main__ import main
    from tessera.training.config import load_config
    from tessera.training.objectives import check_objective
    from tessera.training.run_plan import resolve_plan

    path = tmp_path / "run.yaml"
    assert main(["plan", "--model", "t5-tiny", "--gpus", "2", "--gpu", "a100-80gb",
                 "--global-batch", "8", "--seq-len", "128", "--pp", "2",
                 "--output", str(path)]) == 0
    assert "--tokenizer TOKENIZER" in capsys.readouterr().out
    cfg, _ = load_config(["--config", str(path), "--tokenizer", "tok.model"])
    assert (cfg.model.family, cfg.parallel.pp, cfg.parallel.recompute) == ("t5", 2, "none")
    check_objective(resolve_plan(cfg, 2))  # raises ConfigError on anything T5 pretraining refuses


def test_t5_layer_activations_by_hand():
    from tessera.plan.models.t5.formulas import (
        t5_decoder_layer_activation_bytes as dec,
    )
    from tessera.plan.models.t5.formulas import (
        t5_encoder_layer_activation_bytes as enc,
    )

    m = ModelConfig.from_name("t5-tiny")  # h 64, a 4 x d 16, f 128 gated
    # Encoder, s_e 32, b 2: s b h = 4096; Korthikanti units 10 replicated + 20 split (q 2, k v
    # 4, projection input 2, gated MLP 6 f/h = 12) + scores 5 a s/h = 10 -> 163,840; the
    # relative bias + padding mask 2 b a s^2 = 16,384.
    assert enc(m, 32, 2) == 163_840 + 16_384
    # tp 2 with sequence parallelism and a fused kernel: 4096 x (10 + 20)/2 + 2 x 2 x 2 x 32^2.
    assert enc(m, 32, 2, 2, True, True) == 61_440 + 8_192
    # Decoder, s_d 9: s b h = 1152 -> 1152 x (10 + 20 + 5 x 4 x 9/64) = 37,800; causal bias
    # 2 a s_d^2 = 648; cross-attention 5 x 1152 (norm and q inputs, dropout) + 4 x 1152
    # (q, projection input) + 4 x 32 x 2 x 64 (k, v) = 26,752; its scores 5 b a s_d s_e =
    # 11,520.
    assert dec(m, 9, 32, 2) == 37_800 + 648 + 26_752 + 11_520
    # tp 2, sp, fused: 1152 x 15 + 2 x 2 x 81 + (5 x 1152 + 4 x 1152 + 4 x 4096) / 2.
    assert dec(m, 9, 32, 2, 2, True, True) == 17_280 + 324 + 13_376


def test_t5_serving_and_measure_refused(capsys):
    from tessera.__main__ import main
    from tessera.plan import plan_serving

    with pytest.raises(PlanError, match="--serve plans decoder-only models"):
        plan_serving(ModelConfig.from_name("t5-base"), 8, load_hardware("h100-80gb"))
    assert main(["plan", "--measure", "--nproc-per-node", "2", "--model", "t5-tiny", "--gpu",
                 "cpu", "--global-batch", "8", "--seq-len", "128"]) == 2
    assert "T5 span corruption needs one" in capsys.readouterr().err
