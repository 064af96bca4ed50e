"""The converted Hugging Face families train under tp2 + sequence parallelism and cp2 with the
loss and every gradient of one process (`_parity`), each family's traits on the tiny Llama shape
(4 heads, 2 kv heads: each tp2 rank holds one): Qwen2's q/k/v-only biases split with their heads
and its tied output, Phi-3's partial rotary, Qwen2-MoE's biases with a shared expert, and Llama
with llama3, yarn, longrope and dynamic rope scaling past a length shorter than the sequence.

OLMo-2, Gemma 2 (test_parallel_olmo2_gemma2) and Mistral's window (test_sliding_window_parallel)
are covered there; Gemma 2's score scale and soft caps refuse context parallelism
(tests/unit/core/test_config_validation.py)."""

from __future__ import annotations

import pytest

from tests.distributed._parity import Case, check_case, spawn_cases

GQA = {"num_kv_heads": 2}
QWEN2 = {**GQA, "family": "qwen2", "qkv_bias": True, "tied_embeddings": True}
PHI3 = {**GQA, "family": "phi3", "rotary_fraction": 0.5}
QWEN2_MOE = {**GQA, "family": "qwen2_moe", "qkv_bias": True, "num_layers": 2,
             "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 16,
                     "shared_ffn_hidden_size": 32, "layer_freq": 2, "norm_topk": False}}
# Original lengths of 8 under a 16-token sequence: the scaled frequencies are the ones used.
LLAMA3 = {**GQA, "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}
YARN = {**GQA, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 8}}
# Frequencies chosen by the sequence length (longrope past its original length, dynamic NTK
# past max_position_embeddings): every cp rank must choose by the whole sequence.
LONGROPE = {**GQA, "rope_scaling": {"type": "longrope", "original_max_position_embeddings": 8,
                                    "short_factor": [1.0, 1.1, 1.3, 1.6],
                                    "long_factor": [1.0, 2.5, 5.0, 9.0]}}
DYNAMIC = {**GQA, "max_position_embeddings": 8, "rope_scaling": {"type": "dynamic",
                                                                  "factor": 4.0}}
FAMILIES = {"qwen2": QWEN2, "phi3": PHI3, "qwen2_moe": QWEN2_MOE, "llama3-rope": LLAMA3,
            "yarn-rope": YARN, "longrope": LONGROPE, "dynamic-rope": DYNAMIC}
LAYOUTS = {"tp2-sp": {"tp": 2, "sequence_parallel": True}, "cp2": {"cp": 2}}
CASES = [Case(f"{family}-{layout}", "llama-tiny", parallel, model=model, batch=4)
         for family, model in FAMILIES.items() for layout, parallel in LAYOUTS.items()]


@pytest.fixture(scope="module")
def results():
    return spawn_cases(CASES, 2, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_family_on_2_ranks_matches_single_process(case, results):
    diffs = check_case(case, results[case.name])
    print(case.name, diffs)

