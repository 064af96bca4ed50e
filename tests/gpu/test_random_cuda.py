"""The model-parallel RNG on CUDA: dropout masks on a CUDA tensor differ per tensor-parallel
rank inside `tracker.fork()` and agree outside it; the CUDA state is checkpointed and replayed
under recomputation (skipped without CUDA; tests/unit/core/test_random.py checks the logic on
CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.core.parallel import random as mp_random
from tessera.core.parallel.random import ModelParallelRNG

SEED = 5


def _mask(device: torch.device) -> torch.Tensor:
    return F.dropout(torch.ones(1 << 14, device=device), 0.5, True) != 0


def test_cuda_dropout_differs_per_tp_rank_inside_fork_only():
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.ones(1, device=dev)  # CUDA in use before seeding, as in a training run
    inside, outside, after = [], [], []
    for tp_rank in (0, 1):  # two simulated tp ranks: same seed, different tp rank
        torch.manual_seed(SEED)
        rng = ModelParallelRNG()
        rng.seed(SEED, tp_rank)
        assert set(rng.get_states()) == {"cpu", str(dev)}
        before = torch.cuda.get_rng_state(dev)
        with rng.fork():
            inside.append(_mask(dev))
        assert torch.equal(torch.cuda.get_rng_state(dev), before)  # default state put back
        outside.append(_mask(dev))
        with rng.fork():
            after.append(_mask(dev))
    assert not torch.equal(inside[0], inside[1])
    assert torch.equal(outside[0], outside[1])
    assert not torch.equal(inside[0], after[0])  # the forked stream advanced


def test_cuda_tracker_state_round_trips_and_replays_under_recompute(monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = ModelParallelRNG()
    monkeypatch.setattr(mp_random, "tracker", rng)
    rng.seed(SEED, 1)
    with rng.fork():
        _mask(dev)
    saved = rng.state_tensors("tracker")
    assert set(saved) == {"tracker", f"tracker.{dev}"}
    with rng.fork():
        expected = _mask(dev)
    resumed = ModelParallelRNG()
    resumed.seed(0, 0)
    resumed.load_state_tensors(saved, "tracker")
    with resumed.fork():
        assert torch.equal(_mask(dev), expected)

    def body(x: torch.Tensor) -> torch.Tensor:
        with rng.fork():
            return F.dropout(x, 0.5, True) * 3

    grads = []
    for recompute in (False, True):
        torch.manual_seed(SEED)
        rng.seed(SEED, 1)
        x = torch.randn(256, 64, device=dev, requires_grad=True)
        y = mp_random.recompute(body, x) if recompute else body(x)
        y.square().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
