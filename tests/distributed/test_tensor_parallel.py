"""Tensor (and sequence) parallelism on 2 and 4 gloo ranks against the single-process model:
the loss and every gathered gradient, for the GPT-2, Llama and Nemotron families, with grouped-
query attention and a vocabulary (1003) that does not divide by the tp size."""

from __future__ import annotations

import pytest

from tests.distributed._parity import Case, check_case, spawn_cases

GQA_1003 = {"vocab_size": 1003, "num_heads": 8, "num_kv_heads": 4}  # kv heads < heads

TP2 = [
    Case("llama-gqa-v1003", "llama-tiny", {"tp": 2}, model=GQA_1003),
    Case("llama-gqa-v1003-sp", "llama-tiny", {"tp": 2, "sequence_parallel": True},
         model=GQA_1003),
    Case("gpt2-tied-sp", "gpt2-tiny", {"tp": 2, "sequence_parallel": True}),
    Case("nemotron-v1003", "nemotron-tiny", {"tp": 2}, model={"vocab_size": 1003}),
]
TP4 = [
    Case("llama-gqa-v1003", "llama-tiny", {"tp": 4}, model=GQA_1003),
    Case("nemotron-gqa-v1003-sp", "nemotron-tiny", {"tp": 4, "sequence_parallel": True},
         model=GQA_1003),
    Case("gpt2-tied", "gpt2-tiny", {"tp": 4}),
]


@pytest.fixture(scope="module")
def tp2_results():
    return spawn_cases(TP2, 2, timeout=180)


@pytest.fixture(scope="module")
def tp4_results():
    return spawn_cases(TP4, 4, timeout=180)


@pytest.mark.parametrize("case", TP2, ids=lambda c: c.name)
def test_tp2_matches_single_process(case, tp2_results):
    check_case(case, tp2_results[case.name])


@pytest.mark.parametrize("case", TP4, ids=lambda c: c.name)
def test_tp4_matches_single_process(case, tp4_results):
    check_case(case, tp4_results[case.name])
