"""The model-parallel RNG tracker, on CPU: per-tp-rank dropout inside `fork`, the shared stream
outside it, one state per device (a CUDA device simulated by a CPU generator standing in for
its default generator), checkpoint round trips, and the replay under recomputation.

tests/gpu/test_random_cuda.py checks the same on a real CUDA device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.core.parallel import random as mp_random
from tessera.core.parallel.random import ModelParallelRNG

SEED = 11


def _mask(n: int = 4096) -> torch.Tensor:
    return F.dropout(torch.ones(n), 0.5, True) != 0


def test_dropout_differs_per_tp_rank_inside_fork_and_not_outside():
    inside, outside = [], []
    for tp_rank in (0, 1):
        torch.manual_seed(SEED)
        rng = ModelParallelRNG()
        rng.seed(SEED, tp_rank)
        with rng.fork():
            inside.append(_mask())
        outside.append(_mask())
    assert not torch.equal(inside[0], inside[1])
    assert torch.equal(outside[0], outside[1])
    # The fork left the default stream where it was: the draw after it is the first draw.
    torch.manual_seed(SEED)
    assert torch.equal(outside[0], _mask())


def test_fork_continues_its_own_stream_and_checkpoints_round_trip():
    rng = ModelParallelRNG()
    rng.seed(SEED, 0)
    with rng.fork():
        first = _mask()
    saved = rng.state_tensors("tracker")
    cuda = [f"tracker.{d}" for d in mp_random._fork_devices() if d.type == "cuda"]
    assert sorted(saved) == ["tracker", *cuda]  # the CPU's, and the CUDA device's if in use
    with rng.fork():
        second = _mask()
    assert not torch.equal(first, second)  # not the same masks again
    resumed = ModelParallelRNG()
    resumed.seed(SEED, 0)
    resumed.load_state_tensors({"cpu": torch.get_rng_state(), **saved}, "tracker")
    with resumed.fork():
        assert torch.equal(_mask(), second)


class _FakeCuda:
    """Two CUDA devices whose default generators are CPU generators, current device 1."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.generators = {i: torch.Generator().manual_seed(100 + i) for i in (0, 1)}
        self.current = 1
        monkeypatch.setattr(mp_random, "_fork_devices", lambda: [
            torch.device("cpu"), torch.device("cuda", self.current)])
        monkeypatch.setattr(mp_random, "_default_generator", lambda d: (
            torch.default_generator if d.type == "cpu" else self.generators[d.index]))
        monkeypatch.setattr(mp_random, "_seeded_state",
                            lambda d, seed: torch.Generator().manual_seed(seed).get_state())

    def draw(self, index: int) -> torch.Tensor:
        return torch.rand(8, generator=self.generators[index])


def test_fork_swaps_the_current_cuda_generator_and_keeps_its_state(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    states = []
    for tp_rank in (0, 1):
        rng = ModelParallelRNG()
        rng.seed(SEED, tp_rank)
        states.append(rng.get_states())
    assert set(states[0]) == {"cpu", "cuda:1"}
    assert not torch.equal(states[0]["cuda:1"], states[1]["cuda:1"])  # seeded per tp rank

    rng = ModelParallelRNG()
    rng.seed(SEED, 1)
    before = {i: g.get_state() for i, g in cuda.generators.items()}
    cpu_before = torch.get_rng_state()
    with rng.fork():
        forked = cuda.draw(1)
        untouched = cuda.draw(0)
    # Inside: device 1 drew from the tracked state (the seed), device 0 from its own.
    assert torch.equal(forked, torch.rand(8, generator=torch.Generator().manual_seed(
        SEED + mp_random._TP_SEED_OFFSET + 1)))
    assert torch.equal(untouched, torch.rand(8, generator=torch.Generator().manual_seed(100)))
    # After: device 1's and the CPU's default states are back, the tracked one advanced.
    assert torch.equal(cuda.generators[1].get_state(), before[1])
    assert torch.equal(torch.get_rng_state(), cpu_before)
    with rng.fork():
        assert not torch.equal(cuda.draw(1), forked)

    saved = rng.state_tensors("tracker")
    assert set(saved) == {"tracker", "tracker.cuda:1"}
    resumed = ModelParallelRNG()
    resumed.seed(0, 0)
    resumed.load_state_tensors(saved, "tracker")
    assert {k: torch.equal(v, rng.get_states()[k]) for k, v in resumed.get_states().items()} \
        == {"cpu": True, "cuda:1": True}

    # A device first used after seeding starts from the same seed.
    cuda.current = 0
    with rng.fork():
        assert torch.equal(cuda.draw(0), forked)
    assert set(rng.get_states()) == {"cpu", "cuda:0", "cuda:1"}


def test_recompute_replays_the_forked_states_on_every_device(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    rng = ModelParallelRNG()
    monkeypatch.setattr(mp_random, "tracker", rng)
    draws = []

    def body(x: torch.Tensor) -> torch.Tensor:
        with rng.fork():
            draws.append(cuda.draw(1))
            return F.dropout(x, 0.5, True) * 3

    grads = []
    for recompute in (False, True):
        torch.manual_seed(SEED)
        rng.seed(SEED, 1)
        x = torch.randn(64, 32, requires_grad=True)
        y = mp_random.recompute(body, x) if recompute else body(x)
        y.square().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
    # Without recompute: one draw. With it: the forward and its replay drew the same numbers.
    assert len(draws) == 3 and torch.equal(draws[1], draws[2]) and torch.equal(draws[0], draws[1])
