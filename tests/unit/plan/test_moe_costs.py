"""What an MoE layer pays beyond its FLOPs: token permutation, routing, and how close the
planner comes to Megatron-LM's published Mixtral 8x7B throughput.

References nobody here wrote: Megatron-LM's published Mixtral 8x7B run (MoE README, MCore
v0.8 "Reference Best Parallel Mapping" and v0.9's 468 TFLOPS), its kernels as released in
v0.9 (`moe_utils.permute` / `unpermute`), and figures worked by hand from them.
"""

from __future__ import annotations

import pytest

from tessera.core.config import ModelConfig
from tessera.plan import TrainingJob, evaluate, load_hardware
from tessera.plan import estimate as E
from tessera.plan import formulas as F

H100 = load_hardware("h100-80gb")

# Megatron-LM's MoE README (core_v0.9.0, megatron/core/transformer/moe/README.md): "Mixtral
# 8X7B bf16 training ... 438 TFLOPS as of MCore v0.8", raised to "468 TFLOPS as of MCore v0.9"
# in the top-level README of Nov 2024 ("47% MFU during BF16 training for 8x7B on H100"), with
# the reference mapping of its table: 64 H100 80GB (8 per node, NVLink 4, 8x400 Gb/s IB),
# dropless, all-to-all dispatcher, sequence 4096, TP1 EP8 PP4 VP8, micro-batch 1, global
# batch 256. `examples/mixtral/train_mixtral_8x7b_distributed.sh` (v0.9) runs it with
# grouped GEMM, the distributed optimizer, overlapped gradient reduction and no
# recomputation flag. Megatron's MFU counts the same FLOPs as the planner
# (`num_floating_point_operations`: no router, full causal attention).
PUBLISHED_TFLOPS = 468.0
PUBLISHED_MFU = PUBLISHED_TFLOPS / H100.peak("bf16")  # 0.473
PUBLISHED = dict(tp=1, pp=4, virtual_stages=8, ep=8, etp=1, micro_batch=1, recompute="none")


def _mixtral_job() -> TrainingJob:
    return TrainingJob(ModelConfig.from_name("mixtral-8x7b"), 64, H100, 256, 4096)


def test_dispatch_and_router_bytes_golden_mixtral_layer():
    """One Mixtral 8x7B MoE layer on one rank of the published layout: tp 1 without sequence
    parallelism, so the rank routes its whole micro-batch, n = 4096 tokens; k = 2 copies each,
    c = 8192; h = 4096 in bf16, a row 8192 bytes; E = 8 experts over ep 8, one local expert.

    Permutation (Megatron-Core v0.9, unfused): forward gather 2c, unpermute 6c + n; backward
    4c + 2c + (2c + n): 8c + n = 69,632 rows each way = 570,425,344 bytes. Two local experts
    would add the sort by local expert and back, 4c rows = 268,435,456 bytes.
    Router, per token: forward h d + 3 E d + 8 E = 8192 + 48 + 64 = 8304 bytes; backward
    2 h d + 6 E d + 16 E = 16384 + 96 + 128 = 16608. Gating GEMM 2 n h E = 268,435,456 FLOPs."""
    n, h, k, experts = 4096, 4096, 2, 8
    assert F.moe_dispatch_bytes(n, h, k, local_experts=1) == (570_425_344, 570_425_344)
    two_local = F.moe_dispatch_bytes(n, h, k, local_experts=2)
    assert two_local[0] - 570_425_344 == 268_435_456 == two_local[1] - 570_425_344
    # Expert tensor parallelism sorts the etp x larger gathered buffer.
    assert F.moe_dispatch_bytes(n, h, k, 2, etp=2)[0] - 570_425_344 == 2 * 268_435_456
    assert F.moe_router_bytes(n, h, experts) == (4096 * 8304, 4096 * 16608)
    assert F.moe_router_flops(n, h, experts) == 268_435_456
    # The stored h-sized rows per copy (permuted input + expert output) the generic
    # elementwise pass no longer charges: c x 2 x 2h bytes.
    assert F.moe_routed_row_bytes(n, h, k) == 134_217_728


def test_routing_time_golden_mixtral_layer():
    """The same layer in seconds at the H100's 3.35 TB/s. The gating GEMM (4096 x 8 x 4096)
    runs at 0.75 x 8/(8 + 96) = 5.77% of 989.5 TFLOP/s, 4.70 us, below the 10.02 us its
    33.5 MB input takes to read: memory bound (backward 9.40 us against 20.03 us).
    Forward: 570,425,344 B dispatch + (34,013,184 - 33,554,432) B of scores + the GEMM's
    10.02 us = 180.43 us; backward 570,425,344 + (68,026,368 - 67,108,864) B + 20.03 us =
    190.58 us. The elementwise pass drops 134,217,728 B (40.06 us; 80.13 backward)."""
    job = _mixtral_job()
    c = evaluate(job, PUBLISHED)
    bw = 3350e9
    fwd, bwd = E._routing_times(job._estimate, c.config, 4096, H100.peak("bf16") * 1e12)
    gemm = 268_435_456 / (989.5e12 * 0.75 * 8 / 104)
    assert gemm == pytest.approx(4.702e-6, rel=1e-3)
    assert fwd == pytest.approx((570_425_344 + 458_752) / bw + max(gemm, 33_554_432 / bw),
                                rel=1e-12)
    assert bwd == pytest.approx((570_425_344 + 917_504) / bw + max(2 * gemm, 67_108_864 / bw),
                                rel=1e-12)
    assert (fwd, bwd) == pytest.approx((180.43e-6, 190.58e-6), rel=1e-4)
    lt = E._kind_times(job._estimate, c.config, moe=True)
    assert (lt.routing, lt.routing_bwd) == (fwd, bwd)
    stored = F.moe_layer_activation_bytes(job.model, 4096, 1, 1, False, "none", 1, True, 1)
    assert lt.elementwise == pytest.approx((stored - 134_217_728) / bw, rel=1e-12)
    # A dense layer pays none of it.
    dense = E._kind_times(job._estimate, c.config, moe=False)
    assert (dense.routing, dense.routing_bwd) == (0.0, 0.0)


def test_published_mixtral_layout_step_increase_by_hand():
    """The published layout's step grows by exactly the layer costs above. Before them the
    planner gave compute 2.091777 s, bubble 0.049558 s, exposed dp reduction 0.030102 s
    (step 2.591413 s). Per layer and micro-batch: +180.43 - 40.06 us forward and
    +190.58 - 80.13 us backward = 250.8 us; each rank runs 8 layers for 256 / 16 = 16
    micro-batches: compute +128 x 250.8 us = +32.1 ms; the interleaved bubble (p - 1)/v = 3/8
    of one micro-batch's 8 layers: +0.75 ms; the longer last backward (8 x 110.45 us) hides
    0.88 ms more of the dp reduction."""
    job = _mixtral_job()
    c = evaluate(job, PUBLISHED)
    assert (c.dp, c.micro_batches, c.sequence_parallel) == (16, 16, False)
    lt = E._kind_times(job._estimate, c.config, moe=True)
    bw = 3350e9
    fwd = lt.routing - 134_217_728 / bw
    bwd = lt.routing_bwd - 2 * 134_217_728 / bw
    assert fwd + bwd == pytest.approx(250.8e-6, rel=1e-3)
    assert c.time.compute - 2.091777 == pytest.approx(128 * (fwd + bwd), abs=2e-6)
    assert c.time.bubble - 0.049558 == pytest.approx(3 / 8 * 8 * (fwd + bwd), abs=2e-6)
    assert 0.030102 - c.time.dp == pytest.approx(8 * bwd, abs=2e-6)
    assert c.time.total - 2.591413 == pytest.approx(131 * (fwd + bwd) - 8 * bwd, abs=5e-6)


def test_published_mixtral_mfu_bounded():
    """Megatron-LM's published Mixtral 8x7B run, 468 TFLOP/s = 47.3% MFU, against the
    planner for exactly that layout. The planner over-predicts: 52.99% MFU before the MoE
    costs above (step 2.591 s), 52.34% with them (2.623 s), +10.7% over the published figure.
    What it still lacks is not found and not fitted: load imbalance between the ep ranks
    (dropless routing waits for the most loaded expert; no published max/mean load for this
    setting), the dispatcher's host synchronisation for the all-to-all splits and the many
    small routing kernels (launch-bound, 0 on the GPU profiles), and the all-to-all's real
    NVLink rate. Bounded so that it cannot grow unnoticed, nor shrink without this note
    being revisited."""
    c = evaluate(_mixtral_job(), PUBLISHED)
    assert c.mfu == pytest.approx(0.5234, abs=5e-4)
    assert c.step_time_s == pytest.approx(2.623, abs=1e-3)
    over = c.mfu / PUBLISHED_MFU - 1
    assert 0.08 < over < 0.13, over
