"""BERT under tensor (+ sequence), pipeline and data parallelism against the single-process
model: loss (relative 1e-5) and every gathered gradient (1e-4), with padding, two segments,
masked-LM labels on some positions and, in one case, the next-sentence head.

One spawn of 4 gloo ranks runs every layout in turn (start-up is paid once): tp2 x dp2,
tp2 x dp2 with sequence parallelism and the NSP head (the pooler gathers the [CLS] row), and
pp2 x dp2 under 1F1B (the decoder's copy of the word embedding on the last stage, synced with
the first). The reference takes the same micro-batches in one process (dp rank d, micro-batch m
is chunk `d * micro_batches + m`), as `_parity` does for GPT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tessera.core.config import ModelConfig
from tessera.core.init import build_model
from tessera.core.parallel.data_parallel import allreduce_gradients, wrap_data_parallel
from tessera.core.parallel.groups import init_groups
from tessera.core.parallel.pipeline import (
    broadcast_loss,
    build_schedule,
    build_stages,
    pipeline_loss_fn,
    pipeline_step,
    split_layout_and_schedule,
    sync_sequence_parallel_grads,
    sync_tied_embedding_grads,
)
from tessera.core.parallel.sharding import global_param_shapes
from tests.distributed._parity import GRAD_ATOL, LOSS_RTOL, _gather, _named


@dataclass(frozen=True)
class BertCase:
    name: str
    parallel: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)
    batch: int = 8
    seq: int = 16
    seed: int = 7

    def config(self) -> ModelConfig:
        return ModelConfig.from_name("bert-tiny", **{
            "hidden_size": 32, "num_layers": 4, "num_heads": 4, "ffn_hidden_size": 64,
            "vocab_size": 97, "max_position_embeddings": 32, **self.model})


CASES = [
    BertCase("tp2xdp2", {"tp": 2, "dp": 2}),
    BertCase("tp2xdp2-sp-nsp", {"tp": 2, "dp": 2, "sequence_parallel": True},
             model={"binary_head": True}),
    BertCase("pp2xdp2-1f1b", {"pp": 2, "dp": 2, "micro_batches": 2}),
]


def make_batch(case: BertCase, vocab: int) -> dict[str, torch.Tensor]:
    """ids, labels (15% of the real tokens), token types (A then B), padding, NSP labels."""
    gen = torch.Generator().manual_seed(case.seed)
    B, T = case.batch, case.seq
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    mask = (torch.arange(T) < lengths[:, None]).long()
    types = (torch.arange(T) >= (lengths // 2)[:, None]).long() * mask
    chosen = (torch.rand(B, T, generator=gen) < 0.15) & mask.bool()
    chosen[:, 1] = True  # every row has a target
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    nsp = torch.randint(0, 2, (B,), generator=gen)
    return {"ids": ids, "labels": labels, "token_types": types, "attention_mask": mask,
            "next_sentence": nsp}


def _kwargs(batch: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    kw = {"token_types": batch["token_types"], "attention_mask": batch["attention_mask"]}
    if config.options.binary_head:
        kw["next_sentence"] = batch["next_sentence"]
    return kw


def _rows(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in batch.items()}


def _chunks(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    parts = {k: v.chunk(n) for k, v in batch.items()}
    return [{k: parts[k][i] for k in batch} for i in range(n)]


def run_bert_cases(rank: int, world_size: int, cases: list[BertCase]) -> list[dict[str, Any]]:
    """Rank body: every case in order, each on its own groups."""
    out = []
    for case in cases:
        config = case.config()
        lay, sched = split_layout_and_schedule(case.parallel)
        groups = init_groups(lay)
        per_dp = case.batch // lay.dp
        batch = _rows(make_batch(case, config.vocab_size),
                      slice(groups.dp_rank * per_dp, (groups.dp_rank + 1) * per_dp))
        if lay.pp > 1:
            models = build_stages(config, lay, groups, schedule=sched, seed=case.seed)
            modules = wrap_data_parallel(models, sched, groups)
            schedule = build_schedule(modules, lay, sched, groups,
                                      pipeline_loss_fn(config, groups))
            loss = pipeline_step(schedule, models, groups, batch["ids"], batch["labels"],
                                 extra=_kwargs(batch, config))
            loss = broadcast_loss(loss, lay, groups)
        else:
            models = [build_model(config, lay, groups, schedule=sched, seed=case.seed)]
            modules = wrap_data_parallel(models, sched, groups)
            losses = []
            for mb in _chunks(batch, sched.micro_batches):
                losses.append(modules[0](mb["ids"], mb["labels"], **_kwargs(mb, config)))
                (losses[-1] / sched.micro_batches).backward()
            loss = torch.stack([x.detach() for x in losses]).mean()
        sync_tied_embedding_grads(models, groups)
        sync_sequence_parallel_grads(models, groups)
        if lay.pp > 1:
            allreduce_gradients(models, groups)
        out.append({"coords": (groups.tp_rank, groups.pp_rank, groups.dp_rank, groups.cp_rank),
                    "loss": float(loss), "grads": _named(models, lambda p: p.grad)})
    return out


@pytest.fixture(scope="module")
def results():
    from tests.distributed_helper import run_ranks

    per_rank = run_ranks(run_bert_cases, 4, CASES, timeout=240)
    return {c.name: [r[i] for r in per_rank] for i, c in enumerate(CASES)}


def _reference(case: BertCase) -> tuple[list[float], dict[str, torch.Tensor]]:
    config = case.config()
    lay, sched = split_layout_and_schedule(case.parallel)
    model = build_model(config, seed=case.seed)
    n = lay.dp * sched.micro_batches
    losses = []
    for mb in _chunks(make_batch(case, config.vocab_size), n):
        loss = model(mb["ids"], mb["labels"], **_kwargs(mb, config))
        (loss / n).backward()
        losses.append(loss.detach())
    replica = torch.stack(losses).view(lay.dp, sched.micro_batches).mean(dim=1).tolist()
    return replica, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bert_matches_single_process(case, results):
    config = case.config()
    want_losses, want_grads = _reference(case)
    for r in results[case.name]:
        want = want_losses[r["coords"][2]]
        assert abs(r["loss"] - want) / abs(want) <= LOSS_RTOL, (case.name, r["loss"], want)
    covered = set()
    for dp, pp, name, got in _gather(results[case.name], "grads", config):
        diff = (got - want_grads[name]).abs().max().item()
        assert diff <= GRAD_ATOL, f"{case.name}: {name} (dp {dp}, pp {pp}) diff {diff}"
        covered.add(name)
    assert covered == set(global_param_shapes(config))
