"""OLMo-2 under tensor, sequence and context parallelism follows one process (loss and every
gradient, `_parity`): its RMSNorm over the whole q and k projections sums the squares over the
tp ranks, forward and backward, and its norms on the sublayer outputs see sequence chunks."""

from __future__ import annotations

import pytest

from tests.distributed._parity import Case, check_case, spawn_cases

# The family's traits on the tiny Llama shape; 4 heads, 2 kv heads: each tp2 rank holds one.
OLMO2 = {"family": "olmo2", "qk_norm": True, "qk_norm_width": "projection",
         "norm_placement": "output", "num_kv_heads": 2}
CASES = [
    Case("olmo2-tp2", "llama-tiny", {"tp": 2}, model=OLMO2),
    Case("olmo2-tp2-sp", "llama-tiny", {"tp": 2, "sequence_parallel": True}, model=OLMO2),
    Case("olmo2-cp2", "llama-tiny", {"cp": 2}, model=OLMO2, batch=4),
]


@pytest.fixture(scope="module")
def results():
    return spawn_cases(CASES, 2, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_olmo2_matches_single_process(case, results):
    check_case(case, results[case.name])
