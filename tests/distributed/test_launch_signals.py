"""`tessera pretrain --nproc-per-node 2` stopped by a signal: the ranks save, and the launcher
exits with the shell's code for that signal (130 SIGINT, 143 SIGTERM), without a traceback, so a
scheduler can tell a preemption from a failure and requeue (then `--resume` continues)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time

import pytest

from tessera.core.checkpoint import load_checkpoint
from tessera.training.state import latest_checkpoint, read_training_record
from tests.pretrain_helper import pretrain_argv, tessera_command

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STEPS = 400  # far more than run before the signal arrives


def _wait_for(lines: queue.Queue, seen: list[str], prefix: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if line.startswith(prefix):
            return
    raise AssertionError(f"no line starting {prefix!r}; output:\n{''.join(seen)}")


@pytest.mark.timeout(300)
# SIGINT takes the same path as SIGTERM with another exit code: `make test-slow` runs it.
@pytest.mark.parametrize("sig, code", [pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow),
                                      (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_saves_then_exits_with_the_signal_code(tiny, tmp_path, sig, code):
    run = tmp_path / "run"
    argv = pretrain_argv(tiny, run, "--steps", str(STEPS), "--save-interval", "0",
                         "--nproc-per-node", "2")
    # Its own session: the signal reaches the launcher only, as `kill` from a scheduler would;
    # torch's launcher forwards it to the ranks.
    proc = subprocess.Popen(tessera_command("pretrain", *argv), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    seen: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        _wait_for(lines, seen, "step ", timeout=180)  # the ranks are training
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == code, "".join(seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=10)
    while not lines.empty():
        seen.append(lines.get() or "")
    output = "".join(seen)
    assert "Traceback" not in output and "SignalException" not in output, output
    assert f"stopped by {sig.name}; exit code {code}" in output
    ckpt = latest_checkpoint(run)
    assert ckpt is not None, output
    stopped_at = read_training_record(ckpt)["step"]
    assert 1 <= stopped_at < STEPS, "the run ended before the signal arrived"
    load_checkpoint(ckpt)
