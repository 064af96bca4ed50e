"""Run a function on N gloo ranks on CPU, each in a fresh spawned process (tests, benchmarks).

    from tessera.core.parallel.spawn import run_ranks

    def _body(rank, world_size, n):      # module level, so spawn can pickle it
        ...
        return something_picklable

    assert run_ranks(_body, 2, 8) == [rank0_result, rank1_result]

A failing rank's traceback is raised in the caller as a RuntimeError; a run that outlives `timeout`
is killed and raised as a TimeoutError naming the ranks that had not finished. `timeout` counts
from the moment every rank has joined the process group, so a busy machine's slow start (spawning,
importing torch) does not eat it; joining has its own bound, `startup_timeout`.

Ranks are forked from a forkserver that has imported torch once (a fraction of a second per rank),
and take the caller's environment as it is at the call. A run given `env` is spawned instead,
each rank importing torch itself (seconds per rank), because `env` must be in place before torch
is imported. Either way, put several checks in one body rather than one body per check.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Gloo raises instead of hanging once a collective waits this long (see the feasibility notes).
GLOO_TIMEOUT = timedelta(seconds=60)


# What the forkserver imports once, so that forked ranks start with it loaded.
_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing",
            # optimizers import it on first use: seconds per rank, once here instead
            "torch._dynamo"]


def _context(env: dict[str, str] | None):
    if env:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first call)
    return ctx


def _worker(rank: int, world_size: int, init_method: str, fn: Callable, args: tuple, results,
            environ: dict[str, str] | None = None):
    if environ is not None:
        # A forked rank inherits the forkserver's environment, frozen when it started: use the
        # caller's instead (tests set variables with monkeypatch before calling run_ranks).
        os.environ.clear()
        os.environ.update(environ)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=GLOO_TIMEOUT
        )
        results.put((rank, None, None))  # joined: the parent's `timeout` starts when all have
        report = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:
        report = (rank, False, traceback.format_exc())
    results.put(report)
    # Flush before tearing down the group: the peers of a failing rank only see errors once its
    # sockets close, so its own traceback reaches the parent first. No barrier here, ever.
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    startup_timeout: float = 180,
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results by rank.

    `fn` and `args` must be picklable (`fn` defined at module level); so must its return value.
    `env` is added to the ranks' environment before they start (before torch is imported there).
    """
    ctx = _context(env)
    environ = None if env else dict(os.environ)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/rendezvous"  # a fresh file per run: no port races
        procs = [
            ctx.Process(target=_worker,
                        args=(r, world_size, init_method, fn, args, results, environ))
            for r in range(world_size)
        ]
        started = []
        try:
            with mock.patch.dict(os.environ, env or {}):
                for p in procs:
                    p.start()  # pickles fn and args: a lambda fails here, clearly
                    started.append(p)
            return _collect(procs, results, timeout, startup_timeout)
        finally:
            for p in started:
                p.kill()  # no-op for ranks that have exited
                p.join()


def _collect(procs: list, results, timeout: float, startup_timeout: float) -> list[Any]:
    done: dict[int, Any] = {}
    joined: set[int] = set()
    start_by = time.monotonic() + startup_timeout
    deadline = None  # set once every rank has joined
    while len(done) < len(procs):
        now = time.monotonic()
        pending = [r for r in range(len(procs)) if r not in done]
        if deadline is None and now >= start_by:
            late = [r for r in range(len(procs)) if r not in joined]
            raise TimeoutError(f"ranks {late} did not start within {startup_timeout} s")
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"ranks {pending} did not finish within {timeout} s")
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            _raise_if_dead(procs, done)
            continue
        if ok is None:
            joined.add(rank)
            if len(joined) == len(procs):
                deadline = time.monotonic() + timeout
            continue
        if not ok:
            # A rank that died (e.g. killed) makes its peers fail at their next collective;
            # their reports can arrive first. Name the root cause when there is one.
            deadline_dead = time.monotonic() + 2.0
            while time.monotonic() < deadline_dead:
                _raise_if_dead(procs, {**done, rank: None}, also=f"rank {rank} failed after it:\n{payload}")
                time.sleep(0.1)
            raise RuntimeError(f"rank {rank} of {len(procs)} failed:\n{payload}")
        done[rank] = pickle.loads(payload)
    return [done[r] for r in range(len(procs))]


def _raise_if_dead(procs: list, done: dict[int, Any], also: str = "") -> None:
    """Raise for the first rank not in `done` that exited with an error without reporting."""
    for r, p in enumerate(procs):
        if r not in done and p.exitcode not in (None, 0):
            extra = f" ({also})" if also else ""
            raise RuntimeError(f"rank {r} died with exit code {p.exitcode}{extra}") from None
