"""`tessera pretrain --nproc-per-node 4 --max-restarts 2`: one rank SIGKILLed at a random step
(the test hook in `training/fault_injection.py`), the launcher restarts the group, the run
continues from its latest checkpoint by itself (`--resume auto`, no flag changed), and ends with
the final weights and the loss curve of an uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.pretrain_helper import pretrain_argv, read_losses, tessera_command

STEPS = 12
# tp2 x dp2 on 4 CPU ranks; a checkpoint every 3 steps, all kept.
FLAGS = ("--steps", str(STEPS), "--save-interval", "3", "--keep-last", "0", "--tp", "2",
         "--nproc-per-node", "4", "--max-restarts", "2")
# The launcher waits this long for the surviving ranks of a failed attempt before killing them.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30"}


def _launch(tiny, run: Path, **env: str) -> str:
    done = subprocess.run(tessera_command("pretrain", *pretrain_argv(tiny, run, *FLAGS)),
                          capture_output=True, text=True, timeout=420, env={**ENV, **env})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def _final_tensors(run: Path) -> dict[str, dict]:
    """Every tensor of every safetensors file in the run's final checkpoint, by file."""
    final = run / "checkpoints" / f"step-{STEPS:08d}"
    return {str(f.relative_to(final)): load_file(str(f)) for f in sorted(final.rglob("*.safetensors"))}


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    _launch(tiny, run)
    return run


@pytest.mark.timeout(900)
# Every seed runs under `make test-slow` (50 s each on 2 cores); the launcher's restart
# decisions are unit-tested in tests/unit/core/test_launch.py in the default run.
@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow),
                                  pytest.param(2, marks=pytest.mark.slow)])
def test_a_killed_rank_restarts_and_ends_as_an_uninterrupted_run(tiny, uninterrupted, tmp_path,
                                                                 seed):
    rng = random.Random(seed)
    step, rank = rng.randint(1, STEPS - 1), rng.randrange(4)
    run = tmp_path / "run"
    output = _launch(tiny, run, TESSERA_TEST_KILL_AT_STEP=str(step),
                     TESSERA_TEST_KILL_RANK=str(rank))
    assert f"test hook: SIGKILL rank {rank} after step {step}" in output, output

    # Each step logged once: the dead attempt's rows past the checkpoint were dropped.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == list(range(1, STEPS + 1)), output
    assert read_losses(run) == read_losses(uninterrupted)

    got, want = _final_tensors(run), _final_tensors(uninterrupted)
    assert sorted(got) == sorted(want) and got, (sorted(got), sorted(want))
    for name, tensors in want.items():
        assert sorted(got[name]) == sorted(tensors), name
        for key, tensor in tensors.items():
            assert got[name][key].dtype == tensor.dtype and got[name][key].equal(tensor), (name, key)
