"""Context parallelism against the single-process model: loss (1e-5
relative) and every gathered gradient (1e-4) after one step, for both K/V strategies (allgather,
ring), with and without packed documents, GQA + RoPE and learned positions, alone and combined
with tp (+SP), pp and dp (DDP, ZeRO-1, FSDP: parameters after an SGD step too): every cell of
cp2, cp4, tp2 x cp2 (SP), cp2 x pp2, cp2 x dp2 x {allgather, ring} x {plain, packed} with GQA
and RoPE, and dynamic cp (cp2, cp4, tp2 x cp2, cp2 x dp2).

One spawn per world size runs every case (each builds its own groups, `_parity.run_cases`).
The 2-rank body (both strategies, plain and packed, GQA + RoPE, learned positions, selective
recompute, micro-batches) runs by default; the 4-rank body (cp4, tp2 x cp2 with SP, cp2 x pp2,
cp2 x dp2 with DDP / ZeRO-1 / FSDP) is `slow`: its spawn took 130 s on the loaded 2-core CI
machine, more than the default suite's budget has left (`make test-slow` runs it).
The single-process references take the same batch and, for packed cases, the same document ids;
that packed single-process attention equals running each document alone is checked in
tests/unit/core/test_context_parallel.py.
"""

from __future__ import annotations

import pytest

from tessera.core import fused
from tests.distributed._parity import Case, check_case, spawn_cases

# Eager kernels on both sides: compiling the fused kernels in every spawned rank (and for each
# new shape) cost minutes on the shared CI machine, and parity does not depend on them.
EAGER = {"TESSERA_FUSED_KERNELS": "off"}

TINY = {"num_layers": 2}
GQA = {**TINY, "num_heads": 4, "num_kv_heads": 2}  # llama-tiny: RoPE, SwiGLU, GQA 4:2
RING = {"cp_comm": "ring"}

CASES_2 = [
    Case("cp2-allgather-llama-gqa", "llama-tiny", {"cp": 2}, model=GQA, batch=4),
    Case("cp2-ring-llama-gqa", "llama-tiny", {"cp": 2, **RING}, model=GQA, batch=4),
    Case("cp2-allgather-packed-gpt2-learned-selective", "gpt2-tiny",
         {"cp": 2, "recompute": "selective"}, model=TINY, batch=4, packed=True),
    Case("cp2-ring-packed-llama-gqa-mb2", "llama-tiny", {"cp": 2, "micro_batches": 2, **RING},
         model=GQA, batch=4, packed=True),
    Case("cp2-allgather-packed-llama-gqa", "llama-tiny", {"cp": 2}, model=GQA, batch=4,
         packed=True),
    # Dynamic cp: the 22-token document spans both ranks (padded to 24), the 5-token ones stay
    # whole, one per rank; with two micro-batches the 32-token row spans both ranks in the
    # first and the second's four documents stay whole (`test_dynamic_cases_use_every_block`).
    Case("cp2-dynamic-allgather-packed-llama-gqa", "llama-tiny", {"cp": 2, "cp_dynamic": True},
         model=GQA, batch=1, seq=32, cuts=((22, 27),)),
    Case("cp2-dynamic-ring-packed-gpt2-learned-mb2", "gpt2-tiny",
         {"cp": 2, "cp_dynamic": True, "micro_batches": 2, **RING}, model=TINY, batch=2, seq=32,
         cuts=((), (5, 9, 20))),
]

CASES_4 = [
    Case("cp4-allgather-llama-gqa", "llama-tiny", {"cp": 4}, model=GQA, batch=2),
    Case("cp4-ring-packed-llama-gqa", "llama-tiny", {"cp": 4, **RING}, model=GQA, batch=2,
         packed=True),
    Case("tp2xcp2-sp-allgather-packed-llama-gqa", "llama-tiny",
         {"tp": 2, "cp": 2, "sequence_parallel": True}, model=GQA, batch=2, packed=True),
    Case("tp2xcp2-sp-ring-nemotron", "nemotron-tiny",
         {"tp": 2, "cp": 2, "sequence_parallel": True, **RING}, model=GQA, batch=2),
    Case("cp2xpp2-allgather-1f1b-gpt2-tied", "gpt2-tiny", {"cp": 2, "pp": 2, "micro_batches": 2},
         model=TINY, batch=4),
    Case("cp2xpp2-ring-1f1b-packed-llama-gqa", "llama-tiny",
         {"cp": 2, "pp": 2, "micro_batches": 2, **RING}, model=GQA, batch=4, packed=True),
    Case("cp2xdp2-allgather-ddp-llama-gqa", "llama-tiny", {"cp": 2, "dp": 2}, model=GQA,
         batch=4),
    Case("cp2xdp2-ring-zero1-packed-llama-gqa", "llama-tiny",
         {"cp": 2, "dp": 2, "data_parallel": "zero1", **RING}, model=GQA, batch=4, packed=True,
         sgd_step=True),
    # The rest of the matrix: every layout x strategy, plain and packed, with GQA and RoPE.
    Case("cp4-allgather-packed-llama-gqa", "llama-tiny", {"cp": 4}, model=GQA, batch=2,
         packed=True),
    Case("cp4-ring-llama-gqa", "llama-tiny", {"cp": 4, **RING}, model=GQA, batch=2),
    Case("tp2xcp2-sp-allgather-llama-gqa", "llama-tiny",
         {"tp": 2, "cp": 2, "sequence_parallel": True}, model=GQA, batch=2),
    Case("tp2xcp2-sp-ring-packed-llama-gqa", "llama-tiny",
         {"tp": 2, "cp": 2, "sequence_parallel": True, **RING}, model=GQA, batch=2, packed=True),
    Case("cp2xpp2-allgather-1f1b-packed-llama-gqa", "llama-tiny",
         {"cp": 2, "pp": 2, "micro_batches": 2}, model=GQA, batch=4, packed=True),
    Case("cp2xpp2-ring-1f1b-llama-gqa", "llama-tiny", {"cp": 2, "pp": 2, "micro_batches": 2, **RING},
         model=GQA, batch=4),
    Case("cp2xdp2-allgather-ddp-packed-llama-gqa", "llama-tiny", {"cp": 2, "dp": 2}, model=GQA,
         batch=4, packed=True),
    Case("cp2xdp2-ring-ddp-llama-gqa", "llama-tiny", {"cp": 2, "dp": 2, **RING}, model=GQA,
         batch=4),
    # Dynamic cp over 4 ranks: the 36-token document spans all four (padded to 40), the 18-token
    # one a sub-group of two (padded to 20), the 5-token ones one rank each.
    Case("cp4-dynamic-allgather-packed-llama-gqa", "llama-tiny", {"cp": 4, "cp_dynamic": True},
         model=GQA, batch=1, seq=64, cuts=((36, 54, 59),)),
    Case("cp4-dynamic-ring-packed-llama-gqa", "llama-tiny",
         {"cp": 4, "cp_dynamic": True, **RING}, model=GQA, batch=1, seq=64, cuts=((36, 54, 59),)),
    Case("tp2xcp2-dynamic-ring-packed-llama-gqa", "llama-tiny",
         {"tp": 2, "cp": 2, "cp_dynamic": True, **RING}, model=GQA, batch=1, seq=32,
         cuts=((22, 27),)),
    Case("cp2xdp2-dynamic-allgather-zero1-packed-llama-gqa", "llama-tiny",
         {"cp": 2, "dp": 2, "cp_dynamic": True, "data_parallel": "zero1"}, model=GQA, batch=2,
         seq=32, cuts=((22, 27), ()), sgd_step=True),
    Case("cp2xdp2-allgather-fsdp-gpt2", "gpt2-tiny", {"cp": 2, "dp": 2, "data_parallel": "fsdp"},
         model=TINY, batch=4, sgd_step=True),
]


@pytest.fixture(scope="module", autouse=True)
def eager_reference():
    fused.set_mode("off")
    yield
    fused.set_mode(None)


@pytest.fixture(scope="module")
def results_2():
    return spawn_cases(CASES_2, 2, timeout=300, env=EAGER)


@pytest.fixture(scope="module")
def results_4():
    return spawn_cases(CASES_4, 4, timeout=400, env=EAGER)


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c.name)
def test_cp_on_2_ranks_matches_single_process(case, results_2):
    diffs = check_case(case, results_2[case.name])
    print(case.name, diffs)  # parity errors, for the report (-s)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.name)
def test_cp_on_4_ranks_matches_single_process(case, results_4):
    diffs = check_case(case, results_4[case.name])
    print(case.name, diffs)


def _blocks_used(case: Case) -> set[int]:
    """The block sizes the dynamic-cp scheduler picks for a case's micro-batches."""
    from tessera.core.parallel.dynamic_cp import LayerCost, schedule
    from tessera.core.parallel.dynamic_cp_runtime import sequences
    from tests.distributed._parity import make_documents

    config, (lay, sched) = case.model_config(), case.parallel_config()
    cost = LayerCost.from_model(config.hidden_size, config.ffn_hidden_size, config.num_heads,
                                config.num_kv_heads, gated_mlp=config.activation == "swiglu")
    used = set()
    for docs in make_documents(case).chunk(lay.dp * sched.micro_batches):
        lengths = [n for _, _, n in sequences(docs)]
        used |= {a.ranks for a in schedule(lengths, lay.cp, cost).assignments}
    return used


def test_dynamic_cases_use_every_block():
    """The dynamic-cp parity cases keep sequences whole and spread them over 2 (and 4) ranks,
    so the parity checks cover every kind of block."""
    for case in CASES_2 + CASES_4:
        if case.parallel.get("cp_dynamic"):
            want = {1, 2, 4} if case.parallel["cp"] == 4 else {1, 2}
            assert _blocks_used(case) == want, case.name
