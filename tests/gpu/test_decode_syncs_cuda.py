"""On a GPU, a decode step of the engine synchronises with the host at most once (reading back
its sampled ids), counted by CUDA's own sync debug mode after the first decode steps."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.serving_helper import run_decode_steps
from tests.unit.serving.engine.test_decode_syncs import GREEDY, SAMPLED, decode_requests, tiny_engine

WARM_UP = 2  # decode steps left uncounted: first-use allocations (pinned buffers, seen masks)


# Measured on an H200 (torch 2.11+cu130, 2026-11-27): greedy [2, 1, 1, ...] after the warm-up,
# sampled 2 on every step. The CPU counter (tests/unit/serving/engine/test_decode_syncs.py) sees 1:
# the other wait is one it cannot see, most likely a copy from pageable host memory to the GPU.
# strict: the test fails as soon as the second wait is gone, so this mark is removed then.
@pytest.mark.xfail(strict=True, reason="a second host wait per decode step on CUDA, not yet "
                                       "found (measured on an H200, see above)")
@pytest.mark.parametrize("settings", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_cuda_decode_step_synchronises_at_most_once(settings):
    counts: list[int] = []

    def counted(step) -> None:
        if len(counts) < WARM_UP:
            counts.append(-1)
            step()
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))

    with tiny_engine("cuda", torch.bfloat16) as engine:
        steps = run_decode_steps(engine, decode_requests(settings), counted)
    assert steps >= 10, steps
    assert max(counts[WARM_UP:]) <= 1, counts
