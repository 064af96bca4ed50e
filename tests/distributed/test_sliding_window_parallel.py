"""Sliding-window models (window 3 of a 16-token sequence) train under tp2 + SP and cp2 with the
loss and gradients of one process (`_parity`): cp with both K/V strategies, with packed
documents (window AND same document), and with the window on some layers only (Qwen2's
`max_window_layers`). The unpacked references run the plain masked path; the packed ones run
packed attention in one process, which tests/unit/core/test_sliding_window.py checks against a
dense window mask and against each document alone.
"""

from __future__ import annotations

import pytest

from tessera.core import fused
from tests.distributed._parity import Case, check_case, spawn_cases

EAGER = {"TESSERA_FUSED_KERNELS": "off"}
# init_std 0.5: peaked attention, so keys outside the window would move loss and gradients.
WINDOW = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "sliding_window": 3,
          "init_std": 0.5}
RING = {"cp_comm": "ring"}

CASES = [
    Case("tp2-sp-window", "llama-tiny", {"tp": 2, "sequence_parallel": True}, model=WINDOW,
         batch=4),
    Case("cp2-allgather-window", "llama-tiny", {"cp": 2}, model=WINDOW, batch=4),
    Case("cp2-ring-window", "llama-tiny", {"cp": 2, **RING}, model=WINDOW, batch=4),
    Case("cp2-ring-packed-window", "llama-tiny", {"cp": 2, **RING}, model=WINDOW, batch=4,
         packed=True),
    Case("cp2-allgather-packed-window-layer-1", "llama-tiny", {"cp": 2},
         model={**WINDOW, "sliding_window_layers": (1,)}, batch=4, packed=True),
]


@pytest.fixture(scope="module", autouse=True)
def eager_reference():
    fused.set_mode("off")
    yield
    fused.set_mode(None)


@pytest.fixture(scope="module")
def results():
    return spawn_cases(CASES, 2, timeout=300, env=EAGER)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sliding_window_on_2_ranks_matches_single_process(case, results):
    diffs = check_case(case, results[case.name])
    print(case.name, diffs)
