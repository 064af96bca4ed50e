"""The MoE model under expert parallelism on 4 gloo ranks against the single-process model:
one training step's loss (1e-5 relative) and every gradient (1e-4),
expert banks put back together from their ep x etp pieces with `sharding.unshard_tensors`,
and the global gradient norm (`training.optim.global_grad_norm`, which must count every
expert piece once under ep x tp) equal to the one-process norm. One spawn runs every case.

Capacity: each rank drops on the tokens it routes itself. With pure data-parallel rows (no
sequence parallelism or cp) those are exactly its dp chunk, which the reference runs as its
own micro-batch, so dropped tokens match one process; the capacity cases use such layouts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tessera.core.init import build_model
from tessera.core.moe.losses import set_aux_loss_scale
from tessera.core.parallel.data_parallel import allreduce_gradients
from tessera.core.parallel.groups import init_groups
from tessera.core.parallel.pipeline import (
    broadcast_loss,
    build_schedule,
    build_stages,
    pipeline_loss_fn,
    pipeline_step,
    sync_kv_replica_grads,
    sync_sequence_parallel_grads,
    sync_tied_embedding_grads,
)
from tessera.core.parallel.sharding import (
    global_param_shapes,
    is_expert_param,
    kv_replicas,
    unshard_tensors,
)
from tessera.training.optim import global_grad_norm
from tests.distributed._parity import (
    GRAD_ATOL,
    LOSS_RTOL,
    Case,
    _gather,
    make_batch,
    reference,
)

# Heavy router-loss weights: a wrong aux-loss gradient must show.
MIXTRAL = {"moe_aux_loss_coef": 0.5, "moe_z_loss_coef": 0.1}
QWEN = {**MIXTRAL, "moe_ffn_hidden_size": 16, "moe_shared_ffn_hidden_size": 32,
        "moe_layer_freq": 2}
CAPACITY = {**MIXTRAL, "moe_capacity_factor": 1.0}
# DeepSeek-V3 style: layer 0 dense, an ungated shared expert, sigmoid scores chosen among the 2
# best of 4 expert groups, scaled weights. (Its routing bias takes no gradient, which these
# gradient comparisons cannot hold; `test_reshard_experts.py` carries it through expert grids.)
DEEPSEEK = {**MIXTRAL, "moe_ffn_hidden_size": 16, "moe_shared_ffn_hidden_size": 32,
            "moe_shared_expert_gated": False, "moe_first_dense_layers": 1,
            "moe_router_score": "sigmoid", "moe_num_groups": 4,
            "moe_topk_groups": 2, "moe_group_score": "top2_sum", "moe_routed_scale": 2.5}
SP = {"tp": 2, "dp": 2, "sequence_parallel": True}
CASES = [
    Case("ep4", "mixtral-tiny", {"dp": 4, "ep": 4}, model=MIXTRAL),
    # Full recomputation: dispatch and combine run again inside the recomputed layer.
    Case("ep2-edp2-capacity-recompute", "mixtral-tiny", {"dp": 4, "ep": 2, "recompute": "full"},
         model=CAPACITY),
    Case("ep4-capacity-allgather", "mixtral-tiny",
         {"dp": 4, "ep": 4, "moe_dispatcher": "allgather"}, model=CAPACITY),
    Case("ep2-tp2-sp-etp1", "qwen-moe-tiny", {**SP, "ep": 2}, model=QWEN),
    Case("ep2-tp2-sp-deepseek", "qwen-moe-tiny", {**SP, "ep": 2}, model=DEEPSEEK),
    # Hugging Face's load-balancing loss pooled over the MoE layers (`core.moe.pooled_aux`).
    Case("ep2-tp2-sp-pooled-aux", "qwen-moe-tiny", {**SP, "ep": 2},
         model={**QWEN, "moe_aux_loss_pooling": "model"}),
    Case("ep2-tp2-sp-etp1-allgather", "mixtral-tiny",
         {**SP, "ep": 2, "moe_dispatcher": "allgather"}, model=MIXTRAL),
    Case("ep2-tp2-sp-etp2", "mixtral-tiny", {**SP, "ep": 2, "etp": 2}, model=MIXTRAL),
    Case("ep2-etp2-tp1", "qwen-moe-tiny", {"dp": 4, "ep": 2, "etp": 2}, model=QWEN),
    Case("ep2-pp2", "mixtral-tiny", {"pp": 2, "dp": 2, "ep": 2, "micro_batches": 2},
         model={**MIXTRAL, "moe_router_score": "sigmoid"}),
    Case("ep2-cp2", "mixtral-tiny", {"cp": 2, "dp": 2, "ep": 2}, model=MIXTRAL),
]


def _run_case(case: Case) -> dict[str, Any]:
    config, (lay, sched) = case.model_config(), case.parallel_config()
    groups = init_groups(lay, kv_replicas=kv_replicas(config, lay.tp))
    ids, labels = make_batch(case, config.vocab_size)
    per_dp = case.batch // lay.dp
    rows = slice(groups.dp_rank * per_dp, (groups.dp_rank + 1) * per_dp)
    ids, labels = ids[rows], labels[rows]
    if lay.pp > 1:
        models = build_stages(config, lay, groups, schedule=sched, seed=case.seed)
        schedule = build_schedule(models, lay, sched, groups, pipeline_loss_fn(config, groups))
        loss = broadcast_loss(pipeline_step(schedule, models, groups, ids, labels), lay, groups)
    else:
        # Unwrapped: DDP's reducer would average expert pieces over dp x cp.
        models = [build_model(config, lay, groups, schedule=sched, seed=case.seed)]
        n_mb, losses = sched.micro_batches, []
        set_aux_loss_scale(models[0], 1 / n_mb)
        for i, lab in zip(ids.chunk(n_mb), labels.chunk(n_mb)):
            losses.append(models[0](i, labels=lab))
            (losses[-1] / n_mb).backward()
        loss = torch.stack([x.detach() for x in losses]).mean()
    sync_tied_embedding_grads(models, groups)
    if lay.sequence_parallel:
        sync_sequence_parallel_grads(models, groups)
    sync_kv_replica_grads(models, groups)
    allreduce_gradients(models, groups)  # expert pieces over edp, the rest over dp x cp
    grads = [(m.global_name(n), p.grad.detach().clone()) for m in models
             for n, p in m.named_parameters()]
    return {"coords": (groups.tp_rank, groups.pp_rank, groups.dp_rank, groups.cp_rank),
            "expert": (groups.ep_rank, groups.etp_rank, groups.ep_size, groups.etp_size),
            "loss": float(loss), "grads": grads, "norm": float(global_grad_norm(models)),
            "dispatchers": {type(m.dispatcher).__name__ for model in models
                            for m in model.modules() if hasattr(m, "dispatcher")}}


def _run_all(rank: int, world_size: int, cases: list[Case]) -> list[dict[str, Any]]:
    return [_run_case(case) for case in cases]


def _expert_grads(results: list[dict[str, Any]], config) -> dict[tuple[int, str], torch.Tensor]:
    """(pp, name) -> the global expert-bank gradient from the ep x etp pieces; every edp copy
    of a piece must be the same."""
    pieces: dict[tuple[int, str], dict[tuple[int, int], torch.Tensor]] = {}
    ep = etp = 1
    for r in results:
        ep_rank, etp_rank, ep, etp = r["expert"]
        for name, t in r["grads"]:
            if is_expert_param(name):
                held = pieces.setdefault((r["coords"][1], name), {})
                seen = held.setdefault((ep_rank, etp_rank), t)
                assert torch.allclose(seen, t, atol=1e-6), f"{name}: edp copies differ"
    out = {}
    for key, held in pieces.items():
        assert sorted(held) == [(e, t) for e in range(ep) for t in range(etp)], key
        out[key] = unshard_tensors(key[1], [held[k] for k in sorted(held)], config)
    return out


def check(case: Case, results: list[dict[str, Any]]) -> dict[str, float]:
    config = case.model_config()
    kind = case.parallel.get("moe_dispatcher", "alltoall")
    want_kind = {"alltoall": "AllToAllDispatcher", "allgather": "AllGatherDispatcher"}[kind]
    assert all(r["dispatchers"] == {want_kind} for r in results), case.name
    ref = reference(case)
    loss_rel = max(abs(r["loss"] - ref["losses"][r["coords"][2]]) / abs(ref["losses"][0])
                   for r in results)
    assert loss_rel <= LOSS_RTOL, f"{case.name}: loss relative diff {loss_rel:.2e}"
    dense = [{**r, "grads": [(n, t) for n, t in r["grads"] if not is_expert_param(n)]}
             for r in results]
    got = {(pp, name): t for _dp, pp, name, t in _gather(dense, "grads", config)}
    got.update(_expert_grads(results, config))
    worst = 0.0
    for (_pp, name), t in got.items():
        want = ref["grads"][name]
        assert t.shape == want.shape, f"{case.name}: {name} {tuple(t.shape)} vs {want.shape}"
        diff = (t - want).abs().max().item()
        assert diff <= GRAD_ATOL, f"{case.name}: grad {name} diff {diff:.2e}"
        worst = max(worst, diff)
    missing = set(global_param_shapes(config)) - {name for _pp, name in got}
    assert not missing, f"{case.name}: no rank reported {sorted(missing)}"
    want_norm = torch.linalg.vector_norm(
        torch.stack([g.norm() for g in ref["grads"].values()])).item()
    norm_rel = max(abs(r["norm"] - want_norm) / want_norm for r in results)
    assert norm_rel <= 1e-5, f"{case.name}: grad norm {[r['norm'] for r in results]} " \
                             f"vs {want_norm}"
    return {"loss_rel": loss_rel, "grad": worst, "norm_rel": norm_rel}


@pytest.fixture(scope="module")
def results():
    from tests.distributed_helper import run_ranks

    per_rank = run_ranks(_run_all, 4, CASES, timeout=300)
    return {c.name: [r[i] for r in per_rank] for i, c in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_expert_parallel_matches_single_process(case, results):
    print(f"{case.name}: {check(case, results[case.name])}")


def test_capacity_drops_tokens():
    """The capacity cases drop assignments in one process (so they test dropping)."""
    case = CASES[1]
    model = build_model(case.model_config(), seed=case.seed)
    ids, _ = make_batch(case, case.model_config().vocab_size)
    router = next(m for m in model.modules() if hasattr(m, "router")).router
    h = torch.randn(ids.shape[0] // 4 * ids.shape[1], case.model_config().hidden_size)
    assert (router(h).expert_ids < 0).any()
