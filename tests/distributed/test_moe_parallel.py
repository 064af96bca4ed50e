"""Mixture-of-Experts models under tensor, sequence and pipeline parallelism (expert parallelism
1) on 2 gloo ranks against the single-process model: the loss and every gathered gradient, the
router, the experts and the shared expert included, with router losses weighted heavily enough
that a wrong aux-loss gradient shows. One spawn runs every case."""

from __future__ import annotations

import pytest

from tests.distributed._parity import Case, check_case, spawn_cases

# Large router-loss weights: their gradients must be as exact as the language-model loss's.
MIXTRAL = {"moe_aux_loss_coef": 0.5, "moe_z_loss_coef": 0.1}
QWEN = {**MIXTRAL, "moe_ffn_hidden_size": 16, "moe_shared_ffn_hidden_size": 32,
        "moe_layer_freq": 2}
CASES = [
    Case("mixtral-tp2", "mixtral-tiny", {"tp": 2}, model=MIXTRAL),
    Case("mixtral-tp2-sp", "mixtral-tiny", {"tp": 2, "sequence_parallel": True}, model=MIXTRAL),
    # Capacity is decided on the tokens a rank routes: the same tokens on every tp rank.
    Case("mixtral-tp2-capacity", "mixtral-tiny", {"tp": 2, "micro_batches": 2},
         model={**MIXTRAL, "moe_capacity_factor": 1.0}),
    Case("qwen-shared-tp2-sp", "qwen-moe-tiny", {"tp": 2, "sequence_parallel": True},
         model=QWEN),
    Case("mixtral-pp2", "mixtral-tiny", {"pp": 2, "micro_batches": 2},
         model={**MIXTRAL, "moe_router_score": "sigmoid"}),
    # Hugging Face's load-balancing loss pooled over the MoE layers (`core.moe.pooled_aux`): the
    # counts summed over the ranks that split the sequence (tp under SP, cp), one pool per
    # micro-batch, recomputation taking the original forward's pool.
    Case("qwen-pooled-tp2-sp", "qwen-moe-tiny",
         {"tp": 2, "sequence_parallel": True, "micro_batches": 2},
         model={**QWEN, "moe_aux_loss_pooling": "model"}),
    Case("mixtral-pooled-cp2-recompute", "mixtral-tiny", {"cp": 2, "recompute": "full"},
         model={**MIXTRAL, "moe_aux_loss_pooling": "model"}),
]


@pytest.fixture(scope="module")
def results():
    return spawn_cases(CASES, 2, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_moe_matches_single_process(case, results):
    diffs = check_case(case, results[case.name])
    print(f"{case.name}: {diffs}")
