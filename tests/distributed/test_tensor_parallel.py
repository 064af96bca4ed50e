"""Tensor (and sequence) parallelism on 2 and 4 gloo ranks against the single-process model:
the loss and every gathered gradient, for the GPT-2, Llama and Nemotron families, with grouped-
query attention and a vocabulary (1003) that does not divide by the tp size, and Llama with
Qwen3's per-head q/k norm (with and without SP, and with kv heads replicated over tp 4)."""

from __future__ import annotations

import pytest

from tests.distributed._parity import Case, check_case, spawn_cases

GQA_1003 = {"vocab_size": 1003, "num_heads": 8, "num_kv_heads": 4}  # kv heads < heads
QK_NORM = {"qk_norm": True, "head_dim": 12}  # Qwen3 (core.qk_norm)

TP2 = [
    Case("llama-gqa-v1003", "llama-tiny", {"tp": 2}, model=GQA_1003),
    Case("llama-gqa-v1003-sp", "llama-tiny", {"tp": 2, "sequence_parallel": True},
         model=GQA_1003),
    Case("gpt2-tied-sp", "gpt2-tiny", {"tp": 2, "sequence_parallel": True}),
    Case("nemotron-v1003", "nemotron-tiny", {"tp": 2}, model={"vocab_size": 1003}),
    # Qwen3's per-head q/k norm (replicated weights, tp-partial gradients), head_dim != C / nh.
    Case("qknorm-gqa-hd12", "llama-tiny", {"tp": 2}, model={**GQA_1003, **QK_NORM}),
    Case("qknorm-gqa-hd12-sp", "llama-tiny", {"tp": 2, "sequence_parallel": True},
         model={**GQA_1003, **QK_NORM}),
]
TP4 = [
    Case("llama-gqa-v1003", "llama-tiny", {"tp": 4}, model=GQA_1003),
    Case("nemotron-gqa-v1003-sp", "nemotron-tiny", {"tp": 4, "sequence_parallel": True},
         model=GQA_1003),
    Case("gpt2-tied", "gpt2-tiny", {"tp": 4}),
    # q/k norm with 2 kv heads replicated over 4 ranks: each replica's k_norm gradient is partial.
    Case("qknorm-kv-replicated-sp", "llama-tiny", {"tp": 4, "sequence_parallel": True},
         model=QK_NORM),
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
