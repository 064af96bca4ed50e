"""A model-parallel random stream so dropout is right under tensor and sequence parallelism.

Activations that are replicated over the tp group (hidden states without SP) must drop the same
elements on every tp rank, so they use the default generators, seeded identically on those
ranks. Activations that differ per tp rank (attention heads, sequence chunks under SP) must drop
independent elements, so they run inside `tracker.fork()`, which swaps in generator states
seeded with `seed + offset + tp_rank`: one for the CPU and, once the process uses CUDA, one for
its current CUDA device (dropout on a CUDA tensor draws from that device's generator, so forking
the CPU one alone would give every tp rank the same CUDA masks). Recomputation restores the
tracked states (see `recompute`); training checkpoints save them (`state_tensors`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils.checkpoint

_TP_SEED_OFFSET = 2718


def _fork_devices() -> list[torch.device]:
    """The devices whose default generator `fork` swaps: the CPU, and the current CUDA device
    once this process has initialized CUDA (never initializing it here)."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    return devices


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    return torch.cuda.default_generators[device.index]


def _seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    """The state of a fresh generator of `device`'s kind seeded with `seed`."""
    return torch.Generator(device=device).manual_seed(seed).get_state()


class ModelParallelRNG:
    """The tp-rank-specific random streams of one process (one per device), forked into around
    dropout calls."""

    def __init__(self) -> None:
        self._seed: int | None = None
        self._states: dict[str, torch.Tensor] = {}  # device name ("cpu", "cuda:0") -> state

    def seed(self, seed: int, tp_rank: int) -> None:
        """Restart every stream from `seed` for this tp rank (a device first used later gets
        its state from the same seed then)."""
        self._seed = seed + _TP_SEED_OFFSET + tp_rank
        self._states = {}
        for device in _fork_devices():
            self._state(device)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of the tracked states by device name; empty before `seed` or a `fork`."""
        return {device: state.clone() for device, state in self._states.items()}

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replace the tracked states (devices absent from `states` restart from the seed)."""
        self._states = dict(states)

    def state_tensors(self, prefix: str = "tracker") -> dict[str, torch.Tensor]:
        """The states as flat tensor-file entries: `prefix` for the CPU (the key training
        checkpoints have always used) and `prefix.cuda:N` for a CUDA device."""
        return {prefix if device == "cpu" else f"{prefix}.{device}": state
                for device, state in self.get_states().items()}

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor],
                           prefix: str = "tracker") -> None:
        """Restore the states `state_tensors` wrote (other entries of `tensors` are ignored);
        devices it has no entry for keep their current state."""
        for key, state in tensors.items():
            if key == prefix:
                self._states["cpu"] = state.clone()
            elif key.startswith(prefix + "."):
                self._states[key[len(prefix) + 1:]] = state.clone()

    def _state(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._states:
            if self._seed is None:
                self._seed = _TP_SEED_OFFSET  # never seeded: as `seed(0, 0)`
            self._states[key] = _seeded_state(device, self._seed)
        return self._states[key]

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body with the tracked states in the default generators of the CPU and the
        current CUDA device (if in use), then put the default states back."""
        devices = _fork_devices()
        generators = [_default_generator(d) for d in devices]
        defaults = [g.get_state() for g in generators]
        for device, gen in zip(devices, generators, strict=True):
            gen.set_state(self._state(device))
        try:
            yield
        finally:
            for device, gen, default in zip(devices, generators, defaults, strict=True):
                self._states[str(device)] = gen.get_state()
                gen.set_state(default)


# One stream per process, like the default generators it complements.
tracker = ModelParallelRNG()


def rank_rng_states() -> dict[str, torch.Tensor]:
    """This process's RNG states as tensor-file entries: `cpu` (torch's default generator),
    the tracker's (`tracker`, `tracker.cuda:N`) and `cuda` where CUDA is in use. Training and
    tuning checkpoints store one such dict per rank."""
    states = {"cpu": torch.get_rng_state(), **tracker.state_tensors("tracker")}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def load_rank_rng_states(states: Mapping[str, torch.Tensor]) -> None:
    """Set this process's RNG states from `rank_rng_states()`'s entries."""
    torch.set_rng_state(states["cpu"])
    tracker.load_state_tensors(states, "tracker")
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def recompute(fn: Callable[..., Any], *args: Any) -> Any:
    """`torch.utils.checkpoint` that also replays the model-parallel RNG on recomputation."""
    saved = tracker.get_states()
    calls = [0]

    def run(*inner: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return fn(*inner)
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            return fn(*inner)
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
