"""A rank that stops answering ends the job: `tessera pretrain --nproc-per-node` with a short
`--collective-timeout-s` and one rank made to sleep an hour at a step (the watchdog's test
hook) exits by itself, non-zero, with a message naming that rank; and the slowest rank of each
logging interval is logged."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tessera.training.watchdog import HANG_EXIT_CODE
from tests.pretrain_helper import pretrain_argv, tessera_command

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(argv: list[str], env: dict[str, str], bound_s: float) -> tuple[int, str]:
    """Exit code and output of `tessera pretrain ARGV`; killed (and failed) past `bound_s`,
    far below the hook's hour of sleep."""
    proc = subprocess.Popen(tessera_command("pretrain", *argv), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=bound_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"the job did not end by itself:\n{output}") from None
    return proc.returncode, output


@pytest.mark.timeout(400)
# 3 ranks (a silent rank among two waiting ones) runs under `make test-slow`: 30 s more.
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)],
                         ids=["2-ranks", "3-ranks"])
def test_a_silent_rank_ends_the_job_naming_it(tiny, tmp_path, world):
    # The timeout bounds every collective, start-up's too: 10 s leaves room for a loaded
    # machine's pauses, so that only the hook's silence times out.
    argv = pretrain_argv(tiny, tmp_path / "run", "--steps", "50", "--save-interval", "0",
                         "--collective-timeout-s", "10", "--global-batch", "12",
                         "--nproc-per-node", str(world))
    env = {**ENV, "TESSERA_TEST_HANG_RANK": "1", "TESSERA_TEST_HANG_AT_STEP": "3"}
    code, output = _run(argv, env, bound_s=300)
    assert code != 0, output
    assert "step 3: rank 1 did not answer (last completed step 2)" in output, output
    assert f"exit code {HANG_EXIT_CODE}" in output, output
    # The ranks that waited name what they waited in: the step's gradient all-reduce.
    assert "all_reduce (from " in output, output
    # The silent rank ended itself (its watchdog), not left to the launcher's shutdown timeout.
    assert "rank 1: step 3 has run for more than 20 s" in output, output


@pytest.mark.timeout(300)
def test_the_slowest_rank_of_each_interval_is_logged(tiny, tmp_path):
    run = tmp_path / "run"
    argv = pretrain_argv(tiny, run, "--steps", "4", "--save-interval", "0",
                         "--log-interval", "2", "--nproc-per-node", "2")
    env = {**ENV, "TESSERA_TEST_SLOW_RANK": "1", "TESSERA_TEST_SLOW_S": "0.5"}
    code, output = _run(argv, env, bound_s=240)
    assert code == 0, output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in rows if "step" in r}
    # The logged steps (the first and every log_interval) and the steps of their intervals.
    for step, steps in {1: 1, 2: 1, 4: 2}.items():
        assert logged[step]["slowest_rank"] == 1
        assert logged[step]["slowest_rank_s"] >= 0.5 * steps  # the hook's sleeps at least
        assert logged[step]["fastest_rank_s"] < logged[step]["slowest_rank_s"]
    assert "slowest_rank" not in logged[3]  # not a logging step: no collective there
    assert "| slowest rank 1 (" in output, output
