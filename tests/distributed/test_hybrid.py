"""Mixed layouts on 4 gloo ranks: tp2 x pp2, tp2 x dp2 and pp2 x dp2, each against the
single-process model (loss and every gathered gradient; parameters after an SGD step where an
optimizer is sharded). One spawn runs them all: every layout builds its own groups in turn.

Three context-parallel composites ride along in the same spawn (cheaper than a spawn of their
own): tp2 x cp2 with SP, cp2 x pp2 and cp2 x dp2 with ZeRO-1, ring and packed documents; the
full cp matrix is in test_context_parallel.py (slow)."""

from __future__ import annotations

import pytest

from tests.distributed._parity import Case, check_case, spawn_cases

MB4 = {"micro_batches": 4}

HYBRID = [
    Case("tp2xpp2-gpt2-tied-1f1b", "gpt2-tiny", {"tp": 2, "pp": 2, **MB4},
         model={"vocab_size": 1003}),
    Case("tp2xpp2-nemotron-sp-interleaved", "nemotron-tiny",
         {"tp": 2, "pp": 2, "sequence_parallel": True, "schedule": "interleaved-1f1b",
          "virtual_stages": 2, **MB4}),
    Case("tp2xpp2-llama-gqa-zbv", "llama-tiny",
         {"tp": 2, "pp": 2, "schedule": "zbv", "virtual_stages": 2, **MB4},
         model={"num_heads": 8, "num_kv_heads": 2}),
    # Qwen3's per-head q/k norm (tp-partial gradients of replicated weights) across stages.
    Case("tp2xpp2-qknorm-sp-1f1b", "llama-tiny",
         {"tp": 2, "pp": 2, "sequence_parallel": True, **MB4},
         model={"num_kv_heads": 2, "qk_norm": True, "head_dim": 12}),
    Case("tp2xdp2-llama-gqa-v1003-ddp", "llama-tiny", {"tp": 2, "dp": 2},
         model={"vocab_size": 1003, "num_kv_heads": 2}),
    Case("tp2xdp2-gpt2-sp-fsdp", "gpt2-tiny",
         {"tp": 2, "dp": 2, "sequence_parallel": True, "data_parallel": "fsdp"}, sgd_step=True),
    Case("pp2xdp2-gpt2-tied-1f1b", "gpt2-tiny", {"pp": 2, "dp": 2, "micro_batches": 2}),
    Case("pp2xdp2-llama-zero1-zero-bubble", "llama-tiny",
         {"pp": 2, "dp": 2, "schedule": "zero-bubble", "virtual_stages": 2,
          "micro_batches": 2, "data_parallel": "zero1"}, sgd_step=True),
    Case("pp2xdp2-nemotron-fsdp-1f1b", "nemotron-tiny",
         {"pp": 2, "dp": 2, "micro_batches": 2, "data_parallel": "fsdp"}),
    Case("tp2xcp2-sp-ring-packed-llama-gqa", "llama-tiny",
         {"tp": 2, "cp": 2, "sequence_parallel": True, "cp_comm": "ring"},
         model={"num_layers": 2}, batch=2, packed=True),
    Case("cp2xpp2-allgather-packed-gpt2-1f1b", "gpt2-tiny",
         {"cp": 2, "pp": 2, "micro_batches": 2}, model={"num_layers": 2}, batch=4, packed=True),
    Case("cp2xdp2-ring-zero1-llama-gqa", "llama-tiny",
         {"cp": 2, "dp": 2, "data_parallel": "zero1", "cp_comm": "ring"},
         model={"num_layers": 2}, batch=4, sgd_step=True),
]


@pytest.fixture(scope="module")
def hybrid_results():
    return spawn_cases(HYBRID, 4, timeout=240)


@pytest.mark.parametrize("case", HYBRID, ids=lambda c: c.name)
def test_hybrid_matches_single_process(case, hybrid_results):
    check_case(case, hybrid_results[case.name])
