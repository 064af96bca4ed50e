"""Parity harness: run one training step under a parallel layout on gloo ranks and compare its
loss and gathered gradients with the single-process model built from the same seed.

A `Case` names a model (preset + overrides) and a layout. `run_cases` is the rank body (for
`run_ranks`): for each case it builds the layout's groups and model chunks, runs one step
(pipelined when pp > 1), applies the gradient syncs, and returns its loss, its local gradients
by global name and its (tp, pp, dp, cp) coordinates. Every cp rank is given the whole sequence
(the model keeps its own tokens); with `packed` the rows hold several documents, given to the
model as per-token document ids (the reference takes the same ids in one process).
`check_case` builds the reference in this process, unshards the tp gradients with
`sharding.unshard_tensors` and compares every global parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tessera.core.config import Layout, ModelConfig, TrainSchedule
from tessera.core.init import build_model
from tessera.core.moe.losses import set_aux_loss_scale
from tessera.core.parallel.data_parallel import (
    allreduce_gradients,
    build_zero_optimizer,
    wrap_data_parallel,
)
from tessera.core.parallel.dynamic_cp_runtime import DynamicCP
from tessera.core.parallel.groups import init_groups
from tessera.core.parallel.pipeline import (
    broadcast_loss,
    build_schedule,
    build_stages,
    pipeline_loss_fn,
    pipeline_step,
    split_layout_and_schedule,
    sync_kv_replica_grads,
    sync_sequence_parallel_grads,
    sync_tied_embedding_grads,
)
from tessera.core.parallel.sharding import global_param_shapes, kv_replicas, unshard_tensors

LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-4
LR = 0.5  # SGD step checked in the data-parallel cases


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    parallel: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)  # overrides of the preset
    batch: int = 8
    seq: int = 16
    seed: int = 1234
    sgd_step: bool = False  # also take one SGD step (ZeRO / FSDP) and compare the parameters
    packed: bool = False  # rows of several documents (per-token document ids)
    cuts: tuple[tuple[int, ...], ...] | None = None  # packed, with these document starts per row

    def model_config(self) -> ModelConfig:
        base = {"hidden_size": 32, "num_layers": 4, "num_heads": 4, "ffn_hidden_size": 64,
                "vocab_size": 96, "max_position_embeddings": 64}
        return ModelConfig.from_name(self.preset, **{**base, **self.model})

    def parallel_config(self) -> tuple[Layout, TrainSchedule]:
        return split_layout_and_schedule(self.parallel)


def make_batch(case: Case, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels `(B, T)`, with a few ignored (-100) labels."""
    gen = torch.Generator().manual_seed(case.seed)
    tokens = torch.randint(0, vocab_size, (case.batch, case.seq + 1), generator=gen)
    ids, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    labels[0, :3] = -100
    labels[-1, -2:] = -100
    return ids, labels


def make_documents(case: Case) -> torch.Tensor | None:
    """Per-token document ids `(B, T)` for a packed case: each row cut at 1-3 random places
    (so documents straddle the cp chunks), or None when the case is not packed."""
    if case.cuts is not None:
        docs = torch.zeros(case.batch, case.seq, dtype=torch.long)
        for row, cuts in zip(docs, case.cuts, strict=True):
            for cut in cuts:
                row[cut:] += 1
        return docs
    if not case.packed:
        return None
    gen = torch.Generator().manual_seed(case.seed + 1)
    docs = torch.zeros(case.batch, case.seq, dtype=torch.long)
    for row in docs:
        n = int(torch.randint(1, 4, (), generator=gen))
        for cut in torch.randperm(case.seq - 1, generator=gen)[:n] + 1:
            row[cut:] += 1
    return docs


# ---------------------------------------------------------------------------------- rank side


def run_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Rank body: run every case in order (all ranks the same order) and report each."""
    return [_run_case(case) for case in cases]


def spawn_cases(cases: list[Case], world_size: int, timeout: float = 240,
                env: dict[str, str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Run every case in one spawn of `world_size` gloo ranks (start-up is paid once);
    each case's per-rank results, by case name. `env`: added to the ranks' environment."""
    from tests.distributed_helper import run_ranks

    per_rank = run_ranks(run_cases, world_size, cases, timeout=timeout, env=env)
    return {c.name: [r[i] for r in per_rank] for i, c in enumerate(cases)}


def _run_case(case: Case) -> dict[str, Any]:
    config, (lay, sched) = case.model_config(), case.parallel_config()
    groups = init_groups(lay, kv_replicas=kv_replicas(config, lay.tp))
    ids, labels = make_batch(case, config.vocab_size)
    docs = make_documents(case)
    per_dp = case.batch // lay.dp
    rows = slice(groups.dp_rank * per_dp, (groups.dp_rank + 1) * per_dp)
    ids, labels = ids[rows], labels[rows]
    docs = None if docs is None else docs[rows]
    if lay.pp > 1:
        models = build_stages(config, lay, groups, schedule=sched, seed=case.seed)
        modules = wrap_data_parallel(models, sched, groups)
        schedule = build_schedule(modules, lay, sched, groups, pipeline_loss_fn(config, groups))
        loss = pipeline_step(schedule, models, groups, ids, labels, document_ids=docs)
        loss = broadcast_loss(loss, lay, groups)
    else:
        models = [build_model(config, lay, groups, schedule=sched, seed=case.seed)]
        modules = wrap_data_parallel(models, sched, groups)
        losses = []
        n_mb = sched.micro_batches
        set_aux_loss_scale(models[0], 1 / n_mb)  # MoE router losses: scaled as the loss
        doc_chunks = [None] * n_mb if docs is None else docs.chunk(n_mb)
        dynamic = DynamicCP.create(config, lay, groups, sched.cp_comm) if sched.cp_dynamic else None
        for i, lab, d in zip(ids.chunk(n_mb), labels.chunk(n_mb), doc_chunks):
            if dynamic is not None:  # this rank's sequences only
                i, lab, kw = dynamic.model_inputs(i, lab, d)
                losses.append(modules[0](i, labels=lab, **kw))
            else:
                losses.append(modules[0](i, labels=lab, document_ids=d) if d is not None
                              else modules[0](i, labels=lab))
            (losses[-1] / n_mb).backward()
        loss = torch.stack([x.detach() for x in losses]).mean()
    sync_tied_embedding_grads(models, groups)
    # As the training loop does: every tp-partial replicated gradient (the norms under SP,
    # Qwen3's q/k norms always) is summed over tp; a no-op when nothing is marked.
    sync_sequence_parallel_grads(models, groups)
    sync_kv_replica_grads(models, groups)
    if lay.pp > 1 and sched.data_parallel != "fsdp":
        allreduce_gradients(models, groups)
    grads = _named(models, lambda p: p.grad)
    params = None
    if case.sgd_step:
        params_list = [p for m in models for p in m.parameters()]
        if sched.data_parallel == "zero1":
            opt = build_zero_optimizer(params_list, groups, torch.optim.SGD, lr=LR)
        else:
            opt = torch.optim.SGD(params_list, lr=LR)
        opt.step()
        params = _named(models, lambda p: p)
    return {"coords": (groups.tp_rank, groups.pp_rank, groups.dp_rank, groups.cp_rank),
            "loss": float(loss),
            "grads": grads, "params": params}


def _named(models, pick) -> list[tuple[str, torch.Tensor]]:
    out = []
    for m in models:
        for name, p in m.named_parameters():
            t = pick(p)
            if isinstance(t, DTensor):
                t = t.full_tensor()  # collective over dp: every rank walks the same order
            out.append((m.global_name(name), t.detach().clone()))
    return out


# ---------------------------------------------------------------------------------- test side


def reference(case: Case) -> dict[str, Any]:
    """Single-process loss per dp replica, gradients and (optionally) post-SGD parameters."""
    config, (lay, sched) = case.model_config(), case.parallel_config()
    model = build_model(config, seed=case.seed)
    ids, labels = make_batch(case, config.vocab_size)
    docs = make_documents(case)
    n = lay.dp * sched.micro_batches  # dp rank d, micro-batch m is chunk d * micro_batches + m
    set_aux_loss_scale(model, 1 / n)  # MoE router losses: scaled as the loss
    chunk_losses = []
    doc_chunks = [None] * n if docs is None else docs.chunk(n)
    for i, lab, d in zip(ids.chunk(n), labels.chunk(n), doc_chunks):
        loss = model(i, labels=lab) if d is None else model(i, labels=lab, document_ids=d)
        (loss / n).backward()
        chunk_losses.append(loss.detach())
    replica = torch.stack(chunk_losses).view(lay.dp, sched.micro_batches).mean(dim=1)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    params = None
    if case.sgd_step:
        with torch.no_grad():
            params = {name: p - LR * p.grad for name, p in model.named_parameters()}
    return {"losses": replica.tolist(), "grads": grads, "params": params}


def _gather(results: list[dict[str, Any]], key: str, config: ModelConfig) -> list[tuple]:
    """(dp, pp, name, global tensor) for every parameter held by a full row of tp ranks, once
    per cp rank (each cp rank's copy is checked)."""
    tp_size = 1 + max(r["coords"][0] for r in results)
    pieces: dict[tuple, dict[int, torch.Tensor]] = {}
    for r in results:
        tp, pp, dp, cp = r["coords"]
        seen: dict[str, torch.Tensor] = {}
        for name, t in r[key]:
            if name in seen:  # a tied embedding with both copies on this rank
                assert torch.equal(seen[name], t), f"{name}: the two tied copies differ on {r}"
                continue
            seen[name] = t
            pieces.setdefault((dp, pp, cp, name), {})[tp] = t
    out = []
    for (dp, pp, _cp, name), by_tp in pieces.items():
        assert sorted(by_tp) == list(range(tp_size)), f"{name}: tp shards {sorted(by_tp)}"
        shards = [by_tp[t] for t in range(tp_size)]
        out.append((dp, pp, name, unshard_tensors(name, shards, config)))
    return out


def check_case(case: Case, results: list[dict[str, Any]]) -> dict[str, float]:
    """Assert parity with the single-process reference; return the max differences."""
    config = case.model_config()
    ref = reference(case)
    loss_diff = 0.0
    for r in results:
        want = ref["losses"][r["coords"][2]]
        loss_diff = max(loss_diff, abs(r["loss"] - want) / abs(want))
    assert loss_diff <= LOSS_RTOL, f"{case.name}: loss relative diff {loss_diff:.2e}"
    diffs = {"loss_rel": loss_diff}
    for key in ("grads", "params") if case.sgd_step else ("grads",):
        worst, covered = 0.0, set()
        for dp, pp, name, got in _gather(results, key, config):
            want = ref[key][name]
            assert got.shape == want.shape, f"{case.name}: {name} {got.shape} vs {want.shape}"
            diff = (got - want).abs().max().item()
            assert diff <= GRAD_ATOL, f"{case.name}: {key} {name} (dp {dp}, pp {pp}) diff {diff}"
            worst = max(worst, diff)
            covered.add(name)
        missing = set(global_param_shapes(config)) - covered
        assert not missing, f"{case.name}: no rank reported {sorted(missing)}"
        diffs[key] = worst
    return diffs
