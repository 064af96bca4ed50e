"""Data parallelism on 2 gloo ranks (DDP, ZeRO-1, FSDP2): gradients equal the single-process
full-batch gradients, and one SGD step gives the same parameters."""

from __future__ import annotations

import pytest

from tessera.core.config import ConfigError, TrainSchedule
from tessera.core.parallel.data_parallel import wrap_data_parallel
from tessera.core.parallel.groups import ParallelGroups
from tests.distributed._parity import Case, check_case, spawn_cases

DP2 = [
    Case("llama-ddp", "llama-tiny", {"dp": 2}, model={"num_kv_heads": 2}, sgd_step=True),
    Case("gpt2-zero1", "gpt2-tiny", {"dp": 2, "data_parallel": "zero1"}, sgd_step=True),
    Case("nemotron-fsdp", "nemotron-tiny", {"dp": 2, "data_parallel": "fsdp"}, sgd_step=True),
]


@pytest.fixture(scope="module")
def dp2_results():
    return spawn_cases(DP2, 2, timeout=180)


@pytest.mark.parametrize("case", DP2, ids=lambda c: c.name)
def test_dp2_matches_single_process(case, dp2_results):
    check_case(case, dp2_results[case.name])


def test_fsdp_refuses_split_backward_schedules():
    par = TrainSchedule(schedule="zbv", data_parallel="fsdp")
    with pytest.raises(ConfigError, match="zbv"):
        wrap_data_parallel([], par, ParallelGroups(dp_size=2, pp_size=2))


def test_single_replica_is_left_alone():
    modules = [object()]
    assert wrap_data_parallel(modules, TrainSchedule(), ParallelGroups()) == modules
