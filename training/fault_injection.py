"""A test hook that kills one rank mid-run, for the tests of restarts under the launcher.

Set `TESSERA_TEST_KILL_AT_STEP=K` (and optionally `TESSERA_TEST_KILL_RANK=R`, default 0): the
rank whose global RANK is R SIGKILLs itself right after step K, on the launcher's first attempt
only (`TORCHELASTIC_RESTART_COUNT` 0 or unset), so the restarted group runs through. Unset, it
does nothing. Not a user feature: nothing outside the tests sets these variables.
"""

from __future__ import annotations

import os
import signal
import sys


def kill_if_asked(step: int) -> None:
    """SIGKILL this process after `step` when the variables above ask for it (see module)."""
    at = os.environ.get("TESSERA_TEST_KILL_AT_STEP")
    if at is None or int(at) != step:
        return
    if os.environ.get("RANK", "0") != os.environ.get("TESSERA_TEST_KILL_RANK", "0"):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        print(f"test hook: SIGKILL rank {os.environ.get('RANK', '0')} after step {step}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
