"""T5 under tensor (+ sequence), data and pipeline parallelism on gloo ranks, against the single-
process T5 built from the same seed: the loss (1e-5 relative) and every gathered gradient (1e-4).

One spawn per world size runs all its cases. Two ranks: tp2, tp2 + sequence parallel (the
original T5: ReLU, tied and scaled output), and pp2 (encoder on stage 0, decoder on stage 1,
1F1B over two micro-batches). Four ranks: tp2 x dp2 (DDP), and pp4 (two encoder stages that
pass the position bias on, two decoder stages that pass the encoder output on; tied output, so
the embedding has copies on stages 0, 2 and 3). Every batch has a padded encoder row and
ignored labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tessera.core.config import ModelConfig
from tessera.core.parallel.sharding import global_param_shapes
from tests.distributed._parity import GRAD_ATOL, LOSS_RTOL, _gather
from tests.distributed_helper import run_ranks

ORIGINAL = {"activation": "relu", "tied_embeddings": True, "scaled_output": True}


@dataclass(frozen=True)
class T5Case:
    name: str
    parallel: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)
    batch: int = 8
    enc_len: int = 16
    dec_len: int = 8
    seed: int = 7

    def config(self) -> ModelConfig:
        base = {"vocab_size": 101, "hidden_size": 32, "num_heads": 4, "ffn_hidden_size": 64,
                "relative_attention_num_buckets": 8, "relative_attention_max_distance": 12}
        return ModelConfig.from_name("t5-tiny", **{**base, **self.model})


def make_batch(case: T5Case):
    """encoder ids + mask (row 1 padded), decoder inputs and labels (a few ignored)."""
    gen = torch.Generator().manual_seed(case.seed)
    vocab = case.config().vocab_size
    enc = torch.randint(2, vocab, (case.batch, case.enc_len), generator=gen)
    mask = torch.ones_like(enc)
    mask[1, case.enc_len - 5:] = 0
    labels = torch.randint(2, vocab, (case.batch, case.dec_len), generator=gen)
    dec = torch.cat([torch.zeros(case.batch, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    labels[0, -3:] = -100
    return enc, mask, dec, labels


def _run(case: T5Case) -> dict[str, Any]:
    from tessera.core.models.t5.init import build_t5_stages
    from tessera.core.models.t5.pipeline import (
        sync_t5_embedding_grads,
        t5_embedding_group,
        t5_pipeline_step,
    )
    from tessera.core.parallel.data_parallel import allreduce_gradients, wrap_data_parallel
    from tessera.core.parallel.groups import init_groups
    from tessera.core.parallel.pipeline import (
        broadcast_loss,
        build_schedule,
        pipeline_loss_fn,
        split_layout_and_schedule,
        sync_sequence_parallel_grads,
    )

    config = case.config()
    lay, sched = split_layout_and_schedule(case.parallel)
    groups = init_groups(lay)
    emb_group = t5_embedding_group(config, lay, groups)
    enc, mask, dec, labels = make_batch(case)
    rows = slice(groups.dp_rank * case.batch // lay.dp, (groups.dp_rank + 1) * case.batch // lay.dp)
    enc, mask, dec, labels = enc[rows], mask[rows], dec[rows], labels[rows]
    models = build_t5_stages(config, lay, groups, schedule=sched, seed=case.seed)
    modules = wrap_data_parallel(models, sched, groups)
    if lay.pp > 1:
        schedule = build_schedule(modules, lay, sched, groups, pipeline_loss_fn(config, groups))
        loss = t5_pipeline_step(schedule, models, groups, enc, dec, labels, mask)
        loss = broadcast_loss(loss, lay, groups)
    else:
        loss = modules[0](enc, decoder_input_ids=dec, labels=labels, encoder_mask=mask)
        loss.backward()
    sync_t5_embedding_grads(models, emb_group)
    if lay.sequence_parallel:
        sync_sequence_parallel_grads(models, groups)
    if lay.pp > 1:
        allreduce_gradients(models, groups)
    grads = [(m.global_name(n), p.grad.detach().clone()) for m in models
             for n, p in m.named_parameters()]
    return {"coords": (groups.tp_rank, groups.pp_rank, groups.dp_rank, 0),
            "loss": float(loss.detach()), "grads": grads}


def run_cases(rank: int, world_size: int, cases: list[T5Case]) -> list[dict[str, Any]]:
    return [_run(c) for c in cases]


def reference(case: T5Case, dp: int, micro_batches: int) -> dict[str, Any]:
    from tessera.core.models.t5.init import build_t5_model

    model = build_t5_model(case.config(), seed=case.seed)
    enc, mask, dec, labels = make_batch(case)
    n = dp * micro_batches
    losses = []
    for e, m, d, lab in zip(enc.chunk(n), mask.chunk(n), dec.chunk(n), labels.chunk(n)):
        loss = model(e, decoder_input_ids=d, labels=lab, encoder_mask=m)
        (loss / n).backward()
        losses.append(loss.detach())
    replica = torch.stack(losses).view(dp, micro_batches).mean(dim=1)
    return {"losses": replica.tolist(),
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def check(case: T5Case, results: list[dict[str, Any]]) -> None:
    dp, mb = case.parallel.get("dp", 1), case.parallel.get("micro_batches", 1)
    ref = reference(case, dp, mb)
    for r in results:
        want = ref["losses"][r["coords"][2]]
        assert abs(r["loss"] - want) / abs(want) <= LOSS_RTOL, (case.name, r["loss"], want)
    covered = set()
    for dp_rank, pp, name, got in _gather(results, "grads", case.config()):
        diff = (got - ref["grads"][name]).abs().max().item()
        assert diff <= GRAD_ATOL, f"{case.name}: {name} (dp {dp_rank}, pp {pp}) diff {diff}"
        covered.add(name)
    assert covered == set(global_param_shapes(case.config())), case.name


WORLD2 = [
    T5Case("tp2", {"tp": 2}),
    T5Case("tp2-sp-original", {"tp": 2, "sequence_parallel": True}, model=ORIGINAL),
    T5Case("pp2", {"pp": 2, "micro_batches": 2, "schedule": "1f1b"}),
]
WORLD4 = [
    T5Case("tp2-dp2", {"tp": 2, "dp": 2}),
    T5Case("pp4-original", {"pp": 4, "micro_batches": 4, "schedule": "1f1b"}, model=ORIGINAL),
]


@pytest.fixture(scope="module")
def world2():
    per_rank = run_ranks(run_cases, 2, WORLD2, timeout=240)
    return {c.name: [r[i] for r in per_rank] for i, c in enumerate(WORLD2)}


@pytest.fixture(scope="module")
def world4():
    per_rank = run_ranks(run_cases, 4, WORLD4, timeout=240)
    return {c.name: [r[i] for r in per_rank] for i, c in enumerate(WORLD4)}


@pytest.mark.parametrize("case", WORLD2, ids=lambda c: c.name)
def test_t5_two_ranks_match_single_process(case, world2):
    check(case, world2[case.name])


@pytest.mark.slow  # a second spawn of four ranks; the default run covers tp, SP and pp on two
@pytest.mark.parametrize("case", WORLD4, ids=lambda c: c.name)
def test_t5_four_ranks_match_single_process(case, world4):
    check(case, world4[case.name])
