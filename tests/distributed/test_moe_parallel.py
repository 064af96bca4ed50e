"""Mixture-of-Experts models under tensor, sequence and pipeline parallelism (expert parallelism
1) on 2 gloo ranks against the single-process model: the loss and every gathered gradient, the
router, the experts and the shared expert included, with router losses weighted heavily enough
that a wrong aux-loss gradient shows. One spawn runs every case.

Capacity under sequence and context parallelism: each rank decides it on the tokens it routes,
its sequence chunk (as Megatron's router, `get_capacity(num_tokens * topk, ...)` on its local
tokens). The reference for those cases is the single-process model whose router applies the
capacity to each rank's chunk of tokens separately, and the plain single-process model is
checked to differ (so the cases do drop, and differently from one process).
"""

from __future__ import annotations

import pytest
import torch

from tessera.core.mla_config import MLAConfig
from tessera.core.moe.router import Router, Routing
from tessera.core.parallel.context_parallel import zigzag_index
from tests.distributed._parity import Case, check_case, spawn_cases

# Large router-loss weights: their gradients must be as exact as the language-model loss's.
MIXTRAL = {"moe_aux_loss_coef": 0.5, "moe_z_loss_coef": 0.1}
QWEN = {**MIXTRAL, "moe_ffn_hidden_size": 16, "moe_shared_ffn_hidden_size": 32,
        "moe_layer_freq": 2}
# DeepSeek-V3: latent attention, layer 0 dense, 8 experts in 4 groups of which each token uses
# 2 (top-2-sum group scores on sigmoid scores), scaled weights, an ungated shared expert.
DEEPSEEK_V3 = {**MIXTRAL, "family": "deepseek_v3", "num_kv_heads": 4, "num_experts": 8,
               "mla": MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                v_head_dim=6, q_lora_rank=12),
               "moe_ffn_hidden_size": 16, "moe_shared_ffn_hidden_size": 32,
               "moe_shared_expert_gated": False, "moe_first_dense_layers": 1,
               "moe_router_score": "sigmoid", "moe_num_groups": 4, "moe_topk_groups": 2,
               "moe_group_score": "top2_sum", "moe_routed_scale": 2.5}
CASES = [
    Case("mixtral-tp2", "mixtral-tiny", {"tp": 2}, model=MIXTRAL),
    Case("deepseek_v3-moe-tp2-sp", "llama-tiny", {"tp": 2, "sequence_parallel": True},
         model=DEEPSEEK_V3),
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
CAPACITY = {**MIXTRAL, "moe_capacity_factor": 1.0}
CHUNKED = [
    Case("mixtral-tp2-sp-capacity-per-chunk", "mixtral-tiny",
         {"tp": 2, "sequence_parallel": True}, model=CAPACITY),
    Case("mixtral-cp2-capacity-per-chunk", "mixtral-tiny", {"cp": 2}, model=CAPACITY),
]


@pytest.fixture(scope="module")
def results():
    return spawn_cases(CASES + CHUNKED, 2, timeout=240)


def _rank_rows(case: Case, n: int) -> list[torch.Tensor]:
    """The rows of a single-process FFN input `(T * B, C)` (T-major) each rank routes, in its
    local order: a contiguous half of the sequence under SP, the zigzag chunks under cp."""
    seq = case.seq
    batch = n // seq
    if case.parallel.get("cp", 1) > 1:
        cp = case.parallel["cp"]
        return [(zigzag_index(seq, cp, r)[:, None] * batch + torch.arange(batch)).reshape(-1)
                for r in range(cp)]
    return list(torch.arange(n).chunk(case.parallel["tp"]))


def _route_per_rank_chunk(case: Case, monkeypatch) -> None:
    """Make the single-process router decide capacity on each rank's chunk of tokens."""
    original = Router.forward

    def forward(self, x):
        rows = _rank_rows(case, x.shape[0])
        parts = [original(self, x[r]) for r in rows]
        inverse = torch.empty(x.shape[0], dtype=torch.long)
        inverse[torch.cat(rows)] = torch.arange(x.shape[0])
        return Routing(*(torch.cat(fields)[inverse] for fields in zip(
            *((p.expert_ids, p.weights, p.logits, p.scores, p.chosen) for p in parts))))

    monkeypatch.setattr(Router, "forward", forward)


@pytest.mark.parametrize("case", CHUNKED, ids=lambda c: c.name)
def test_capacity_is_decided_on_each_ranks_chunk(case, results, monkeypatch):
    with pytest.raises(AssertionError):  # one process deciding on the whole sequence differs
        check_case(case, results[case.name])
    _route_per_rank_chunk(case, monkeypatch)
    print(f"{case.name}: {check_case(case, results[case.name])}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_moe_matches_single_process(case, results):
    diffs = check_case(case, results[case.name])
    print(f"{case.name}: {diffs}")
