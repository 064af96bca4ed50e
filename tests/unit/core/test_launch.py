"""`core.parallel.launch`: the `--nproc-per-node` hand-over's argv and exit codes, and joining a
world only when launched into one. (A real signalled launch: tests/distributed/test_launch_signals.py.)"""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tessera.core.parallel.groups import new_groups
from tessera.core.parallel.launch import init_distributed, launch_local_ranks, strip_launcher_flags


@pytest.mark.parametrize("argv", [
    ["--nproc-per-node", "4", "--tp", "2"],
    ["--tp", "2", "--nproc-per-node=4"],
    ["--tp", "2", "--nproc-per-node", "4"],
    ["--max-restarts", "3", "--tp", "2", "--nproc-per-node", "4"],
    ["--tp", "2", "--max-restarts=3", "--nproc-per-node=4"],
])
def test_the_ranks_rerun_argv_without_the_launchers_flags(argv):
    assert strip_launcher_flags(argv) == ["--tp", "2"]


def _torchrun_raising(exc: BaseException, seen: list):
    def fake(args):
        seen.append(args)
        raise exc
    return fake


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signalled_launch_exits_128_plus_the_signal(monkeypatch, capsys, sig, code):
    seen: list = []
    monkeypatch.setattr("torch.distributed.run.main",
                        _torchrun_raising(SignalException("got it", sigval=sig), seen))
    assert launch_local_ranks("pretrain", ["--steps", "3", "--nproc-per-node", "2"], 2) == code
    assert seen == [["--standalone", "--nproc-per-node=2", "--max-restarts=0", "-m", "tessera",
                     "pretrain", "--steps", "3"]]
    assert f"stopped by {sig.name}; exit code {code}" in capsys.readouterr().err


def test_max_restarts_reaches_torchs_launcher(monkeypatch):
    seen: list = []
    monkeypatch.setattr("torch.distributed.run.main", seen.append)
    argv = ["--steps", "3", "--max-restarts", "2", "--nproc-per-node", "4"]
    assert launch_local_ranks("pretrain", argv, 4, max_restarts=2) == 0
    assert seen == [["--standalone", "--nproc-per-node=4", "--max-restarts=2", "-m", "tessera",
                     "pretrain", "--steps", "3"]]


def test_a_failing_rank_gives_its_own_exit_code(monkeypatch, capsys):
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=2, error_file="")
    monkeypatch.setattr("torch.distributed.run.main", _torchrun_raising(
        ChildFailedError("tessera", {1: failure}), []))
    assert launch_local_ranks("tune", [], 2) == 2
    assert "tessera tune: rank 1 exited with code 2" in capsys.readouterr().err


def test_a_single_process_joins_no_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed(torch.device("cpu")) is False
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed(torch.device("cpu")) is False
    assert not dist.is_initialized()


def test_new_groups_time_out_as_the_world_does(monkeypatch):
    """torch gives a new group its own 30-minute default; the world's timeout must reach it."""
    join = dist.init_process_group  # one rank on an in-memory store, in place of torchrun's
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: join(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout))
    made = []
    monkeypatch.setattr(dist, "new_group",
                        lambda ranks, timeout=None: made.append(timeout) or "group")
    try:
        assert init_distributed(torch.device("cpu"), timeout=timedelta(seconds=7))
        assert new_groups([[0, 1]]) == "group"
    finally:
        dist.destroy_process_group()
    assert made == [timedelta(seconds=7)]
