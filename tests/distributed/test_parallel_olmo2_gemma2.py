"""OLMo-2 and Gemma 2 under tensor and sequence parallelism (OLMo-2 also context parallelism)
follow one process (loss and every gradient, `_parity`): OLMo-2's RMSNorm over the whole q and
k projections sums the squares over the tp ranks, forward and backward, and its norms on the
sublayer outputs see sequence chunks; Gemma 2's soft-capped attention over each rank's heads,
its four norms per layer and its soft-capped vocab-parallel logits; Gemma 3's (1 + w) q/k head
norms (replicated weights, gradients summed over tp) and its windowed layer rotating at its own
base, the window (4) shorter than the sequence (16)."""

from __future__ import annotations

import pytest

from tessera.core.models.decoder.gemma_options import Gemma2Options
from tests.distributed._parity import Case, check_case, spawn_cases

# The family's traits on the tiny Llama shape; 4 heads, 2 kv heads: each tp2 rank holds one.
OLMO2 = {"family": "olmo2", "qk_norm": True, "qk_norm_width": "projection",
         "norm_placement": "output", "num_kv_heads": 2}
GEMMA2 = {"family": "gemma2", "norm": "rmsnorm1p", "activation": "geglu",
          "norm_placement": "sandwich", "num_kv_heads": 2, "tied_embeddings": True,
          "options": Gemma2Options(query_pre_attn_scalar=6, attn_logit_softcapping=1.5,
                                   final_logit_softcapping=2.0)}
GEMMA3 = {**GEMMA2, "family": "gemma3", "qk_norm": True, "sliding_window": 4,
          "sliding_window_layers": (0, 1, 3), "sliding_window_rope_theta": 100.0,
          "options": Gemma2Options(query_pre_attn_scalar=6, final_logit_softcapping=2.0)}
CASES = [
    Case("olmo2-tp2", "llama-tiny", {"tp": 2}, model=OLMO2),
    Case("olmo2-tp2-sp", "llama-tiny", {"tp": 2, "sequence_parallel": True}, model=OLMO2),
    Case("olmo2-cp2", "llama-tiny", {"cp": 2}, model=OLMO2, batch=4),
    Case("gemma2-tp2", "llama-tiny", {"tp": 2}, model=GEMMA2),
    Case("gemma2-tp2-sp", "llama-tiny", {"tp": 2, "sequence_parallel": True}, model=GEMMA2),
    Case("gemma3-tp2-sp", "llama-tiny", {"tp": 2, "sequence_parallel": True}, model=GEMMA3),
]


@pytest.fixture(scope="module")
def results():
    return spawn_cases(CASES, 2, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_single_process(case, results):
    check_case(case, results[case.name])
