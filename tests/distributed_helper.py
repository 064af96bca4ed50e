"""The tests' name for the rank-spawning helper, which lives in the package so that `bench/`
can use it too: see `tessera.core.parallel.spawn`."""

from tessera.core.parallel.spawn import GLOO_TIMEOUT, run_ranks

__all__ = ["GLOO_TIMEOUT", "run_ranks"]
