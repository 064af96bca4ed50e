"""What an MoE layer pays beyond its FLOPs: token permutation, routing, and how close the
planner comes to Megatron-LM's published Mixtral 8x7B throughput.

References nobody here wrote: Megatron-LM's published Mixtral 8x7B run (MoE README, MCore
v0.8 "Reference Best Parallel Mapping" and v0.9's 468 TFLOPS), its kernels as released in
v0.9 (`moe_utils.permute` / `unpermute`), and figures worked by hand from them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tessera.core.config import ModelConfig
from tessera.plan import TrainingJob, evaluate, load_hardware
from tessera.plan import estimate as E
from tessera.plan import formulas as F

# The datasheet H100 this file's hand arithmetic was done on (3.35 TB/s, GEMMs at 0.75 of peak,
# attention at 0.6), not the built-in profile's measured rates, so the goldens stay checkable by
# hand; the published-run comparison below uses the built-in profile, as users get it.
H100 = dataclasses.replace(load_hardware("h100-80gb"), memory_gbps=3350.0, gemm_efficiency=0.75,
                           attention_efficiency=0.6)

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

    Permutation (Megatron-Core v0.9, unfused), in rows: forward gather n + c, unpermute
    c + 3c + 2c + (c + n): 8c + 2n = 73,728 rows = 603,979,776 bytes; backward (n + 2c) + c +
    (n + c) + 2c + (n + (n + c) + n): 7c + 5n = 77,824 rows = 637,534,208 bytes. Two local
    experts add the sort by local expert and back, 4c rows = 268,435,456 bytes each way.
    Router, per token: forward h d + 3 E d + 8 E = 8192 + 48 + 64 = 8304 bytes; backward
    2 h d + 9 E d + 4 E = 16384 + 144 + 32 = 16560. Gating GEMM 2 n h E = 268,435,456 FLOPs."""
    n, h, k, experts = 4096, 4096, 2, 8
    assert F.moe_dispatch_bytes(n, h, k, local_experts=1) == (603_979_776, 637_534_208)
    fwd2, bwd2 = F.moe_dispatch_bytes(n, h, k, local_experts=2)
    assert (fwd2 - 603_979_776, bwd2 - 637_534_208) == (268_435_456, 268_435_456)
    # Expert tensor parallelism sorts the etp x larger gathered buffer.
    assert F.moe_dispatch_bytes(n, h, k, 2, etp=2)[0] - 603_979_776 == 2 * 268_435_456
    assert F.moe_router_bytes(n, h, experts) == (4096 * 8304, 4096 * 16560)
    assert F.moe_router_flops(n, h, experts) == 268_435_456
    # The stored h-sized rows per copy (permuted input + expert output) the generic
    # elementwise pass no longer charges: c x 2 x 2h bytes.
    assert F.moe_routed_row_bytes(n, h, k) == 134_217_728


class _CountBytes(TorchDispatchMode):
    """Sums, over every ATen op that moves data, the bytes of its floating-point inputs (a
    broadcast view counted by its storage) and outputs: the rule `moe_dispatch_bytes` counts
    by. Views are free; a zeros fill writes only."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        floats = [t for t in tree_flatten(((args, kwargs or {}), out))[0]
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        ins = [t for t in tree_flatten((args, kwargs or {}))[0]
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
        outs = [t for t in floats if not any(t is i for i in ins)]
        ptrs = {i.untyped_storage().data_ptr() for i in ins}
        if not func._schema.is_mutable and any(o.untyped_storage().data_ptr() in ptrs
                                               for o in outs):
            return out  # a view of its input
        if "zeros" in str(func):
            ins = []
        self.bytes += sum(min(t.numel(), t.untyped_storage().nbytes() // t.element_size())
                          * t.element_size() for t in ins)
        self.bytes += sum(t.numel() * t.element_size() for t in outs)
        return out


@pytest.mark.parametrize("k,experts,ep", [(2, 8, 8), (8, 16, 2)])
def test_dispatch_bytes_match_the_kernels_autograd_runs(k, experts, ep):
    """Megatron-Core v0.9's permute / unpermute written as the PyTorch ops it calls (gather
    of each token's copies in expert order, scatter-add into a zeroed buffer, weighting by the
    probabilities, sum over k; with several local experts the split-and-concatenate sort before
    and after the experts), run forward and backward on a tiny bf16 input: the bytes PyTorch's
    kernels read and write, autograd choosing the backward ones, are the formula's."""
    n, h = 24, 16
    local = experts // ep
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, dtype=torch.bfloat16, generator=gen, requires_grad=True)
    probs = torch.rand(n, k, dtype=torch.bfloat16, generator=gen, requires_grad=True)
    routes = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)])
    order = torch.argsort(routes.view(-1), stable=True)  # copies in expert order
    chunks = [n * k // local] * local  # balanced: equal chunks per local expert

    def sort(t: torch.Tensor) -> torch.Tensor:
        return torch.cat(list(reversed(torch.split(t, chunks))))

    with _CountBytes() as fwd:
        permuted = torch.gather(x, 0, (order // k).unsqueeze(1).expand(-1, h))
        if local > 1:
            permuted = sort(permuted)
    expert_in = permuted.detach().requires_grad_()  # the expert GEMMs are not counted here
    with _CountBytes() as fwd2:
        y = sort(expert_in) if local > 1 else expert_in
        back = torch.zeros(n * k, h, dtype=y.dtype).scatter_add(
            0, order.unsqueeze(1).expand(-1, h), y)
        out = (back.view(n, k, h) * probs.unsqueeze(-1)).sum(dim=1)
    grad = torch.randn(n, h, dtype=torch.bfloat16, generator=gen)
    with _CountBytes() as bwd:
        out.backward(grad)
        permuted.backward(expert_in.grad)
    row = h * 2
    # The (n, k) probabilities, left out by the formula: read forward; read, and their
    # gradient written, backward.
    probs_bytes = n * k * 2
    f, b = F.moe_dispatch_bytes(n, h, k, local)
    assert fwd.bytes + fwd2.bytes - probs_bytes == f, (fwd.bytes + fwd2.bytes) / row
    assert bwd.bytes - 2 * probs_bytes == b, bwd.bytes / row


def test_routing_time_golden_mixtral_layer():
    """The same layer in seconds at the H100's 3.35 TB/s. The gating GEMM (4096 x 8 x 4096)
    runs at 0.75 x 8/(8 + 96) = 5.77% of 989.5 TFLOP/s, 4.70 us, below the 10.02 us its
    33.5 MB input takes to read: memory bound (backward 9.40 us against 20.03 us).
    Forward: 603,979,776 B dispatch + (34,013,184 - 33,554,432) B of scores + the GEMM's
    10.02 us = 190.45 us; backward 637,534,208 + (67,829,760 - 67,108,864) B + 20.03 us =
    210.56 us. The elementwise pass drops 134,217,728 B (40.06 us; 80.13 backward)."""
    job = _mixtral_job()
    c = evaluate(job, PUBLISHED)
    bw = 3350e9
    fwd, bwd = E._routing_times(job._estimate, c.config, 4096, H100.peak("bf16") * 1e12)
    gemm = 268_435_456 / (989.5e12 * 0.75 * 8 / 104)
    assert gemm == pytest.approx(4.702e-6, rel=1e-3)
    assert fwd == pytest.approx((603_979_776 + 458_752) / bw + max(gemm, 33_554_432 / bw),
                                rel=1e-12)
    assert bwd == pytest.approx((637_534_208 + 720_896) / bw + max(2 * gemm, 67_108_864 / bw),
                                rel=1e-12)
    assert (fwd, bwd) == pytest.approx((190.446e-6, 210.556e-6), rel=1e-5)
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
    (step 2.591413 s). Per layer and micro-batch: +190.45 - 40.06 us forward and
    +210.56 - 80.13 us backward = 280.81 us; each rank runs 8 layers for 256 / 16 = 16
    micro-batches: compute +128 x 280.81 us = +35.94 ms; the interleaved bubble
    (p - 1)/v = 3/8 of one micro-batch's 8 layers: +0.84 ms; the longer last backward
    (8 x 130.43 us) hides 1.04 ms more of the dp reduction: step 2.627155 s."""
    job = _mixtral_job()
    c = evaluate(job, PUBLISHED)
    assert (c.dp, c.micro_batches, c.sequence_parallel) == (16, 16, False)
    lt = E._kind_times(job._estimate, c.config, moe=True)
    bw = 3350e9
    fwd = lt.routing - 134_217_728 / bw
    bwd = lt.routing_bwd - 2 * 134_217_728 / bw
    assert fwd + bwd == pytest.approx(280.807e-6, rel=1e-5)
    assert c.time.compute - 2.091777 == pytest.approx(128 * (fwd + bwd), abs=2e-6)
    assert c.time.bubble - 0.049558 == pytest.approx(3 / 8 * 8 * (fwd + bwd), abs=2e-6)
    assert 0.030102 - c.time.dp == pytest.approx(8 * bwd, abs=2e-6)
    assert c.step_time_s == pytest.approx(2.627155, abs=2e-6)


def test_published_mixtral_mfu_bounded():
    """Megatron-LM's published Mixtral 8x7B run, 468 TFLOP/s = 47.3% MFU, against the
    planner for exactly that layout. The planner over-predicts: 52.99% MFU before the MoE
    costs above (step 2.591 s), 52.34% with them (2.623 s) on the datasheet H100, and 51.48%
    (2.667 s) on the built-in profile with the rates measured on an H200 (GEMMs at 0.7533 of
    peak, attention 0.5255, HBM 2.96 TB/s): +8.9% over the published figure.
    What it still lacks is not found and not fitted: load imbalance between the ep ranks
    (dropless routing waits for the most loaded expert; no published max/mean load for this
    setting), the dispatcher's host synchronisation for the all-to-all splits and the many
    small routing kernels (launch-bound, 0 on the GPU profiles), and the all-to-all's real
    NVLink rate. And one thing the planner over-charges here: it sends pipeline activations
    blocking, as the 2021 Megatron it was checked on (0.319 s of this 2.627 s step, 262
    transfers), while v0.9 overlaps them with compute under the interleaved schedule
    (`--no-overlap-p2p-communication` turns that off; `arguments.py`); hidden, the step would
    be ~2.31 s and the MFU ~59.5%, so the MoE gap is larger than the ~10% shown here. Bounded
    so that it cannot grow unnoticed, nor shrink without this note being revisited."""
    job = TrainingJob(ModelConfig.from_name("mixtral-8x7b"), 64, load_hardware("h100-80gb"), 256,
                      4096)
    c = evaluate(job, PUBLISHED)
    assert c.mfu == pytest.approx(0.5148, abs=5e-4)
    over = c.mfu / PUBLISHED_MFU - 1
    assert 0.08 < over < 0.13, over


def test_expert_gemm_shape_is_the_per_expert_gemm(monkeypatch):
    """Megatron's `--moe-grouped-gemm` (TE GroupedLinear, v0.9: "launch multiple local GEMM
    kernels in multiple streams", MoE README) runs one GEMM per local expert, so the shape
    rule sees each expert's own GEMM: M = the tokens routed to it. Balanced, at the published
    layout a rank receives 4096 tokens x k 2 x ep 8 / E 8 = 8192 copies for its one expert:
    (8192 x 4096) @ (4096 x 2 x 14336) and (8192 x 14336) @ (14336 x 4096), 6 x 8192 x 4096
    x 14336 FLOPs together. The weight gradient's inner dimension is those 8192 tokens; the
    rule takes the smallest side, so forward and backward shapes rate alike. Qwen3-30B-A3B at
    ep 8 (128 experts, 16 a rank, k 8): 4096 x 8 x 8 / 128 = 2048 tokens an expert."""
    seen = []
    real = E._gemm_time

    def spy(flops, shape, peak, hw):
        seen.append((flops, tuple(shape)))
        return real(flops, shape, peak, hw)

    monkeypatch.setattr(E, "_gemm_time", spy)
    job = _mixtral_job()
    E._kind_times(job._estimate, evaluate(job, PUBLISHED).config, moe=True)
    assert (2 * 8192 * 3 * 14336 * 4096, (8192, 14336, 4096)) in seen
    seen.clear()
    qwen = TrainingJob(ModelConfig.from_name("qwen3-30b-a3b"), 64, H100, 256, 4096)
    c = evaluate(qwen, dict(tp=1, pp=1, ep=8, micro_batch=1, recompute="none"))
    E._kind_times(qwen._estimate, c.config, moe=True)
    assert (2 * 4096 * 8 * 3 * 768 * 2048, (2048, 768, 2048)) in seen
