"""The engine's counters and observations: what `LLMEngine.stats()` and its observers report."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("tessera.serving")

# What observers receive: name -> meaning (all in seconds or tokens).
OBSERVATIONS = {
    "queue_time_seconds": "from submission to admission into the running batch",
    "time_to_first_token_seconds": "from submission to the first sampled token",
    "inter_token_latency_seconds": "between consecutive sampled tokens of a request",
    "e2e_request_latency_seconds": "from submission to the end of the request",
    "request_prompt_tokens": "prompt length of a finished request",
    "request_generation_tokens": "tokens sampled for a finished request",
}
FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")
Observer = Callable[[str, float], None]


class EngineStats:
    """Monotonic counters (`counters`, reported by name), the KV tokens held by running requests
    (`kv_tokens`, for the slot cache's usage), and observers called once per observation.

    Written by the engine thread only; `add_observer` is meant for set-up time."""

    def __init__(self):
        self.counters: dict[str, int] = {
            "prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_total": 0,
            "requests_rejected_total": 0, "steps_total": 0, "computed_tokens_total": 0,
            **{f"requests_finished_{r}_total": 0 for r in FINISH_REASONS},
            "spec_draft_tokens_total": 0, "spec_accepted_tokens_total": 0,
            "spec_verify_steps_total": 0}
        self.kv_tokens = 0
        self._observers: list[Observer] = []

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def add_observer(self, fn: Observer) -> None:
        self._observers.append(fn)

    def observe(self, name: str, value: float) -> None:
        """Call every observer with `(name, value)`; a failing observer is logged, not raised."""
        for fn in self._observers:
            try:
                fn(name, float(value))
            except Exception:
                log.exception("metrics observer failed on %s", name)
