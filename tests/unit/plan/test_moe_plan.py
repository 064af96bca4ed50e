"""The planner's Mixture-of-Experts candidates agree with what `tessera pretrain` runs.

References nobody here wrote into the planner: the training code's own layout checks
(`Layout.problems`), its config loader, its expert sharding (`core.parallel.sharding.
expert_local_shape`, what the MoE layer allocates), and figures worked by hand.
"""

from __future__ import annotations

import json
import math

import pytest

from tessera.__main__ import main
from tessera.core.config import Layout, ModelConfig
from tessera.core.parallel.sharding import expert_local_shape, global_param_shapes, is_expert_param
from tessera.plan import Fixed, TrainingJob, evaluate, load_hardware, plan_training
from tessera.plan import estimate as E
from tessera.plan import formulas as F
from tessera.plan.run_config import run_config, write_run_config
from tessera.training.config import load_config

H100 = load_hardware("h100-80gb")

# Mixtral 8x7B by hand: h 4096, 32 layers, FFN 14336 (gated: three h x F matrices), 8 experts,
# vocabulary 32000 (untied), 32 heads of 128, 8 kv heads, RMSNorm, no biases.
EXPERTS_ALL = 32 * 8 * 3 * 4096 * 14336  # 45,097,156,608 routed-expert parameters
LAYER_DENSE = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 2 * 4096 + 4096 * 8  # attn, norms, router
# Per rank at tp 2 as `formulas.params_per_rank` counts it (layers / tp; embedding and output
# / tp; final norm whole).
DENSE_PER_RANK_TP2 = 32 * LAYER_DENSE // 2 + 2 * 32000 * 4096 // 2 + 4096


def test_zero1_optimizer_golden_mixtral_8x7b_tp2_ep8_dp32():
    """64 GPUs, tp2 ep8 dp32, zero1. Dense state: 12 B x dense/tp over dp = 32. Expert state:
    each rank holds 1/(ep etp) of the experts, sharded over edp = tp dp/(ep etp); per GPU
    12 B x all experts / 64 whatever the grid (the stage's 64 ranks split them once)."""
    assert LAYER_DENSE == 41_984_000 and DENSE_PER_RANK_TP2 == 802_820_096
    expert_gpu = 12 * EXPERTS_ALL // 64
    assert expert_gpu == 8_455_716_864  # 7.875 GiB
    dense_gpu = 12 * DENSE_PER_RANK_TP2 // 32
    assert dense_gpu == 301_057_536  # 0.28 GiB
    # The pure function, for etp 2 (edp 4, 1/16 of the experts) and etp 1 (edp 8, 1/8).
    assert F.optimizer_state_bytes(DENSE_PER_RANK_TP2, EXPERTS_ALL / 16, 32, 4, True) \
        == dense_gpu + expert_gpu
    assert F.optimizer_state_bytes(DENSE_PER_RANK_TP2, EXPERTS_ALL / 8, 32, 8, True) \
        == dense_gpu + expert_gpu
    assert F.optimizer_state_bytes(DENSE_PER_RANK_TP2, EXPERTS_ALL / 16, 32, 4, False) \
        == 12 * (DENSE_PER_RANK_TP2 + EXPERTS_ALL / 16)
    # The planner's memory for both grids (Layout-valid: sp with tp 2), in GiB.
    model = ModelConfig.from_name("mixtral-8x7b")
    job = TrainingJob(model, 64, H100, 256, 4096)
    for etp in (2, 1):
        c = evaluate(job, dict(tp=2, ep=8, etp=etp, sequence_parallel=True,
                               sharded_optimizer=True, recompute="full"))
        assert (c.dp, E.expert_dp_size(c)) == (32, {2: 4, 1: 8}[etp])
        assert c.memory.optimizer * F.GIB == pytest.approx(dense_gpu + expert_gpu, rel=1e-12)
        experts_rank = EXPERTS_ALL / (8 * etp)
        assert c.memory.weights * F.GIB == pytest.approx(2 * (DENSE_PER_RANK_TP2 + experts_rank))
    # What the planner counted before: all state over dp 32, experts split over ep x tp.
    old = 12 * (DENSE_PER_RANK_TP2 + EXPERTS_ALL / 16) / 32
    assert (dense_gpu + expert_gpu) / old > 6


def test_expert_gradients_reduce_over_edp_golden():
    """Mixtral 8x7B on one node of 8 H100s, tp2 ep4 dp4 zero1, reduction not overlapped. Dense
    gradients reduce-scatter (fp32) and weights all-gather (bf16) over dp 4: 3/4 x P x 6 bytes.
    Experts: at etp 2, edp = 8 / (4 x 2) = 1, nothing to reduce; at etp 1, edp 2 (ranks 4
    apart, same node), 1/2 x E/4 x 6 bytes. Ring over NVLink at 450 GB/s x 0.8, 20 us a call."""
    model = ModelConfig.from_name("mixtral-8x7b")
    job = TrainingJob(model, 8, H100, 256, 4096, overlap_grad_reduce=False)
    bw, lat = H100.intra_node_gbps * 1e9 * H100.comm_efficiency, H100.link_latency_us * 1e-6
    assert (bw, lat) == pytest.approx((360e9, 20e-6))
    dense = (3 / 4 * DENSE_PER_RANK_TP2 * 6) / bw + 2 * lat
    fields = dict(tp=2, ep=4, sequence_parallel=True, sharded_optimizer=True, recompute="full")
    assert evaluate(job, {**fields, "etp": 2}).time.dp == pytest.approx(dense, rel=1e-12)
    experts = (1 / 2 * EXPERTS_ALL / 4 * 6) / bw + 2 * lat
    assert evaluate(job, {**fields, "etp": 1}).time.dp == pytest.approx(dense + experts,
                                                                        rel=1e-12)
    # Replicated experts (ep 1) under sequence parallelism: each tp rank holds partial
    # gradients of all of them, summed over tp after the backward: 2 x 1/2 x E x 4 bytes, one
    # call. Beside it the layers' own tp traffic: an MoE layer all-gathers and reduce-scatters
    # only around attention (1/2 x s b h x 2 bytes each, 2 calls), forward and backward, 32
    # layers, 256 / dp 4 = 64 micro-batches of one sequence.
    c = evaluate(job, dict(tp=2, sequence_parallel=True, recompute="full"))
    assert c.micro_batches == 64
    sbh = 4096 * 4096 * 2
    layers = 2 * 32 * 64 * (sbh / bw + 2 * lat)
    assert c.time.tp == pytest.approx(layers + EXPERTS_ALL * 4 / bw + lat, rel=1e-12)


def _mixtral_tiny_job() -> TrainingJob:
    return TrainingJob(ModelConfig.from_name("mixtral-tiny"), 8, H100, 16, 128)


def test_planned_moe_yaml_runs_as_planned(tmp_path):
    """Every ep2 tp2 candidate (etp 1 and 2) written as a run config loads through
    pretraining's loader, passes its layout checks on 8 ranks, and holds the expert shards the
    estimate counted (the training code's own shapes)."""
    job = _mixtral_tiny_job()
    ranked = plan_training(job, Fixed(ep=2, tp=2))
    grids = {(c.ep, c.etp) for c in ranked}
    assert grids == {(2, 1), (2, 2)}
    seen = set()
    for c in ranked:
        if (c.etp, c.pp) in seen:
            continue
        seen.add((c.etp, c.pp))
        path = tmp_path / f"etp{c.etp}-pp{c.pp}.yaml"
        config = run_config(c.parallel_fields(), model="mixtral-tiny", model_fields={},
                            global_batch=job.global_batch, seq_len=job.seq_len,
                            precision="bf16")
        write_run_config(path, config, world_size=job.gpus)  # loads and validates, or raises
        cfg, _ = load_config(["--config", str(path)])
        lay = cfg.parallel.layout()
        assert (lay.tp, lay.pp, lay.dp, lay.ep, lay.etp, lay.sequence_parallel) == (
            c.tp, c.pp, c.dp, c.ep, c.etp, c.sequence_parallel)
        assert lay.problems(cfg.model, world_size=job.gpus, seq_len=job.seq_len) == []
        shapes = global_param_shapes(cfg.model)
        held = sum(math.prod(expert_local_shape(n, cfg.model, lay.ep, lay.etp))
                   for n in shapes if is_expert_param(n)) / lay.pp
        assert F.expert_params_per_rank(E.counts_of(cfg.model), lay.pp, lay.ep, lay.etp) == held
    assert {e for e, _ in seen} == {1, 2}


def test_plan_cli_writes_etp(tmp_path, capsys):
    """`tessera plan ... --ep 2 --tp 2 --etp 2 --output` writes the etp it planned with."""
    path = tmp_path / "run.yaml"
    code = main(["plan", "--model", "mixtral-tiny", "--gpus", "8", "--gpu", "h100-80gb",
                 "--global-batch", "16", "--seq-len", "128", "--ep", "2", "--tp", "2",
                 "--etp", "2", "--output", str(path), "--json"])
    best = json.loads(capsys.readouterr().out)["candidates"][0]
    assert code == 0 and (best["ep"], best["etp"]) == (2, 2)
    cfg, _ = load_config(["--config", str(path)])
    lay = cfg.parallel.layout()
    assert (lay.tp, lay.ep, lay.etp, lay.dp) == (2, 2, 2, 4)
    assert lay.problems(cfg.model, world_size=8, seq_len=128) == []


def test_moe_candidates_are_layout_valid_and_etp_is_fixable():
    """The search yields only layouts the training code accepts (its `Layout.problems`, not a
    copy of its rules); `etp` fixes like any dimension; a bad one is refused with Layout's
    message."""
    job = _mixtral_tiny_job()
    ranked = plan_training(job)
    assert any(c.ep > 1 for c in ranked) and any(c.etp > 1 for c in ranked)
    for c in ranked:
        lay = Layout(tp=c.tp, pp=c.pp, virtual_stages=c.virtual_stages, dp=c.dp, cp=c.cp,
                     sequence_parallel=c.sequence_parallel, ep=c.ep, etp=c.etp)
        assert lay.problems(job.model, world_size=job.gpus, seq_len=job.seq_len) == []
    assert {c.etp for c in plan_training(job, Fixed(tp=2, etp=2))} == {2}
    with pytest.raises(Exception, match="needs sequence_parallel"):
        evaluate(job, dict(tp=2, ep=2, sequence_parallel=False))
    with pytest.raises(Exception, match="not divisible by ep 3"):
        evaluate(job, dict(tp=1, ep=3, dp=8))
