"""Validation of the expert-parallel part of a `Layout`, kept out of `core.config`.

`expert_layout_problems(layout, model)` lists every reason the `ep` / `etp` fields of a layout
cannot hold a model, each naming the numbers that clash and the fix; `Layout.problems` appends
them. No torch here: the planner reads layouts too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.core.config import Layout, ModelConfig


def expert_ffn_size(model: ModelConfig) -> int:
    """Each expert's FFN width: `moe.ffn_hidden_size`, or `ffn_hidden_size` when unset."""
    return model.moe.ffn_hidden_size or model.ffn_hidden_size


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_layout_problems(lay: Layout, model: ModelConfig) -> list[str]:
    """Every reason `lay.ep` / `lay.etp` cannot hold `model` (empty when they can)."""
    ep, etp = getattr(lay, "ep", 1), getattr(lay, "etp", 1)
    bad = [f"{name} must be >= 1, got {v}" for name, v in (("ep", ep), ("etp", etp)) if v < 1]
    if bad or ep * etp == 1:
        return bad
    experts = model.moe.num_experts
    if experts <= 0:
        return [f"ep {ep} x etp {etp} splits the experts of a Mixture-of-Experts model, but "
                f"this model is dense (num_experts {experts}); set ep 1 and etp 1, or pick an "
                "MoE model"]
    out = []
    if experts % ep:
        out.append(f"num_experts {experts} is not divisible by ep {ep}; each ep rank holds "
                   f"num_experts / ep experts: use ep in {_divisors(experts)}")
    dp_cp = lay.dp * lay.cp
    if dp_cp % ep:
        out.append(f"ep {ep} does not divide dp {lay.dp} x cp {lay.cp} = {dp_cp}: expert "
                   f"parallelism is carved out of the data-parallel ranks and adds none; use "
                   f"ep in {_divisors(dp_cp)} or launch more data-parallel ranks "
                   f"(dp = {ep // lay.cp if ep % lay.cp == 0 else ep} or a multiple)")
    ffn = expert_ffn_size(model)
    if ffn % etp:
        out.append(f"the expert FFN size {ffn} is not divisible by etp {etp}; use etp in "
                   f"{_divisors(ffn)}")
    stage = lay.tp * lay.cp * lay.dp
    if stage % (ep * etp):
        out.append(f"ep {ep} x etp {etp} = {ep * etp} does not divide the ranks of a pipeline "
                   f"stage, tp {lay.tp} x cp {lay.cp} x dp {lay.dp} = {stage}; the expert grid "
                   f"etp x ep x edp is folded over those ranks: pick ep x etp in "
                   f"{_divisors(stage)}")
    if lay.tp > 1 and not lay.sequence_parallel:
        out.append(f"tp {lay.tp} with ep {ep} x etp {etp} needs sequence_parallel: every rank "
                   "must enter the expert layer with tokens of its own (set sequence_parallel, "
                   "or ep 1 and etp 1)")
    return out
