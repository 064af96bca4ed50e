"""Multi-head latent attention (DeepSeek-V2/V3) under tensor and sequence parallelism follows
one process (loss and every gradient, `_parity`): heads split over tp, the replicated latent
down-projections and their norms with gradients summed over tp, their input gathered once
under sequence parallelism. Context parallelism is refused by the layout check."""

from __future__ import annotations

import pytest

from tessera.core.config import Layout, ModelConfig
from tessera.core.errors import ConfigError
from tessera.core.mla_config import MLAConfig
from tests.distributed._parity import Case, check_case, spawn_cases

# V3's shape (q bottleneck) and V2-Lite's (one q projection) on the tiny Llama sizes.
V3 = {"family": "deepseek_v3", "num_kv_heads": 4,
      "mla": MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                       q_lora_rank=12)}
V2 = {"family": "deepseek_v2", "num_kv_heads": 4,
      "mla": MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)}
CASES = [
    Case("deepseek_v3-tp2", "llama-tiny", {"tp": 2}, model=V3),
    Case("deepseek_v3-tp2-sp", "llama-tiny", {"tp": 2, "sequence_parallel": True}, model=V3),
    Case("deepseek_v2-tp2-sp", "llama-tiny", {"tp": 2, "sequence_parallel": True}, model=V2),
]


@pytest.fixture(scope="module")
def results():
    return spawn_cases(CASES, 2, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_single_process(case, results):
    check_case(case, results[case.name])


def test_context_parallelism_is_refused():
    model = ModelConfig.from_name("llama-tiny", **V3)
    with pytest.raises(ConfigError, match="cp 2: multi-head latent attention .mla. has no "
                                          "context-parallel path; use cp 1"):
        Layout(cp=2).validate(model, world_size=2)
