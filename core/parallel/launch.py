"""Joining a torchrun world, and the `--nproc-per-node` hand-over to torch's own launcher.

Every verb that runs on many ranks (`tessera pretrain`, `tune`, `serve`) does the same two
things: with `--nproc-per-node N` in a single process, re-run itself under
`torch.distributed.run --standalone` (`launch_local_ranks`); as a rank of a torchrun world, join
it (`init_distributed`). Both live here once. With `--max-restarts R` the launcher restarts the
whole group up to R times when a rank fails (training continues from its latest checkpoint:
`--resume auto`).

Exit codes of `launch_local_ranks` follow the shell's convention, so a scheduler can tell a
preemption from a failure and requeue: 0 done; a failing rank's own code; 128 + the signal
number (130 SIGINT, 143 SIGTERM) when the launcher was signalled, after torch's launcher has
forwarded the signal to the ranks and they have stopped (the training loops save first).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

# How long torch's launcher waits for signalled ranks before it kills them (its default, 30 s,
# can cut short the checkpoint a stopping rank is writing). Set the variable to override it.
SHUTDOWN_TIMEOUT_S = 120


# The bound on each collective of the groups this process creates (`collective_timeout`);
# set when it joins the world through `init_distributed`.
_joined_timeout: timedelta | None = None


def init_distributed(device: torch.device,
                     timeout: timedelta = timedelta(minutes=10)) -> bool:
    """Join the torchrun world if this process was launched into one (env WORLD_SIZE > 1).

    Uses NCCL for a CUDA `device` (made this process's current device first: its index, or
    LOCAL_RANK when it has none) and gloo otherwise; `timeout` bounds each collective, of the
    world and (through `collective_timeout`) of every group `groups.new_groups` makes. Joining
    twice is a no-op, and so is a single process. Returns whether a process group is up.
    """
    global _joined_timeout
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            index = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(index)
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        _joined_timeout = timeout
    return dist.is_initialized()


def collective_timeout() -> timedelta | None:
    """The collective timeout this process joined the world with (`init_distributed`); None
    when it joined some other way (torch's default then applies to new groups)."""
    return _joined_timeout if dist.is_initialized() else None


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """The launcher's store with keys of this attempt only, when torchrun shares its own store
    with the ranks (TORCHELASTIC_USE_AGENT_STORE): that store outlives a restart, and a group
    restarted after a rank failed would otherwise read the failed group's addresses and never
    connect. None otherwise (`init_process_group` reads the env as usual)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"tessera/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                            store)


# The launcher's own flags, each with a value: the ranks re-run argv without them.
LAUNCHER_FLAGS = ("--nproc-per-node", "--max-restarts")


def strip_launcher_flags(argv: list[str]) -> list[str]:
    """`argv` without `LAUNCHER_FLAGS` (`--flag N` / `--flag=N`): what the ranks re-run."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LAUNCHER_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in LAUNCHER_FLAGS)):
            rest.append(arg)
    return rest


def launch_local_ranks(verb: str, argv: list[str], nproc: int, max_restarts: int = 0) -> int:
    """Re-run `tessera VERB ARGV` on `nproc` local ranks under torch's launcher; the exit code.

    When a rank fails, the launcher stops the others and starts the whole group again, up to
    `max_restarts` times (each attempt sees `TORCHELASTIC_RESTART_COUNT`). Blocks until every
    rank has ended. Returns 0, the first failing rank's exit code (its traceback is already
    printed by the rank) once no restart is left, or 128 + signal number when this process was
    signalled (see the module docstring); never raises for those.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                  "-m", "tessera", verb, *strip_launcher_flags(argv)])
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"tessera {verb}: rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:  # the launcher has stopped the ranks (they saw it too)
        code = 128 + int(exc.sigval)
        print(f"tessera {verb}: stopped by {exc.sigval.name}; exit code {code}", file=sys.stderr)
        return code
    return 0
