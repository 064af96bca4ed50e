"""Expert parallelism on gloo against one process: one spawn per world size.

- token dispatchers (`_expert_toy`): all-to-all and all-gather, forward and backward, against
  a one-process expert bank: ep2 and etp2 alone on 2 ranks; ep4 and ep2 x etp2 on 4;
- gradient reduction and the global norm (`_expert_grads`, 4 ranks): dense gradients averaged
  over dp x cp, expert pieces over their expert-data-parallel group only, and a norm that
  counts every expert once under ep x tp;
- checkpoints (`_expert_ckpt`, 4 ranks): expert banks saved and loaded across ep1, ep2 x etp2,
  ep4, tp2 x ep2 and tp2, bit-exact.
"""

from __future__ import annotations

import torch

from tessera.core.parallel.spawn import run_ranks
from tests.distributed._expert_ckpt import check_checkpoints, check_saved, save_single
from tests.distributed._expert_grads import check_gradients
from tests.distributed._expert_toy import check_dispatchers


def _two(rank: int, world: int) -> None:
    torch.set_default_dtype(torch.float64)
    check_dispatchers(rank, world, [(2, 1), (1, 2)])


def _four(rank: int, world: int, root: str) -> None:
    torch.set_default_dtype(torch.float64)
    check_dispatchers(rank, world, [(4, 1), (2, 2)])
    check_gradients(rank, world)
    torch.set_default_dtype(torch.float32)
    check_checkpoints(rank, world, root)


def test_expert_parallel_two_ranks():
    """ep2 (both dispatchers) and etp2 with ep1."""
    run_ranks(_two, 2)


def test_expert_parallel_four_ranks(tmp_path):
    """ep4 and ep2 x etp2 dispatchers, gradients and norm, checkpoints across layouts."""
    save_single(tmp_path)
    run_ranks(_four, 4, str(tmp_path))
    check_saved(tmp_path)
