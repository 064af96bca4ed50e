"""Which requests run in a step, and how many of their tokens: the engine's scheduler.

Policy (one call of `schedule` per engine step, under a token budget `max_step_tokens`):
1. Running sequences, decodes first (one token each, plus its `draft` tokens under speculative
   decoding), then the next prompt chunk of those still prefilling (chunked prefill: a long
   prompt takes several steps and never stalls decodes beyond one step's budget); within each,
   by priority, then first come, first served.
2. A sequence that needs room the KV space cannot give (`KVSpace.grow` fails) preempts the
   newest running sequence (lowest priority, latest arrival; possibly itself): its KV is freed
   and it goes back to the head of the queue (its arrival number keeps its place), to be
   recomputed from its tokens later (the prefix cache usually holds most of them). Requests
   are never failed for lack of KV memory.
3. In a step with no preemption, waiting requests are admitted in order (priority, arrival)
   while the budget, the running limit `max_running` and the KV space allow; the first that
   does not fit stops admission (no overtaking).

Thread safety: `add` is called from the HTTP side; everything else runs on the engine thread.
The waiting queue is guarded by `lock`.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tessera.serving.engine.kv_space import KVSpace, SeqState


@dataclass
class StepPlan:
    """The scheduler's output for one step: what the model runner runs, and what changed."""

    rows: list[tuple[SeqState, int]] = field(default_factory=list)  # (sequence, tokens to run)
    admitted: list[SeqState] = field(default_factory=list)
    preempted: list[SeqState] = field(default_factory=list)
    # Each row's place in the KV cache: `KVSpace.rows(seqs, length)` of the scheduler's space.
    kv_rows: Callable[[list[SeqState], int], torch.Tensor] | None = None


def _rank(seq: SeqState) -> tuple[int, int]:
    return seq.priority, seq.order


class Scheduler:
    def __init__(self, space: KVSpace, max_running: int, max_step_tokens: int):
        if max_step_tokens < 1 or max_running < 1:
            raise ValueError(f"max_step_tokens ({max_step_tokens}) and max_running "
                             f"({max_running}) must be >= 1")
        self.space, self.max_running, self.max_step_tokens = space, max_running, max_step_tokens
        self.lock = threading.Lock()
        self.running: list[SeqState] = []
        self._waiting: list[tuple[tuple[int, int], SeqState]] = []  # sorted by (priority, order)
        self._arrivals = itertools.count()
        self.preemptions = 0
        self.prefix_queried_tokens = 0  # tokens of admitted sequences that looked up the cache
        self.prefix_hit_tokens = 0  # of those, found cached
        # A decoding sequence whose cached tokens reach this count is re-encoded whole, once
        # (`core.rope_scaling.recompute_at`: transformers' Phi-3 longrope); None: never.
        self.recompute_at: int | None = None

    # ----------------------------------------------------------------- the queue

    def add(self, seq: SeqState) -> None:
        with self.lock:
            seq.order = next(self._arrivals)
            bisect.insort(self._waiting, (_rank(seq), seq), key=lambda e: e[0])

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[SeqState]:
        with self.lock:
            return [s for _, s in self._waiting]

    def remove_waiting(self, which: Callable[[SeqState], bool]) -> list[SeqState]:
        """Take the waiting sequences for which `which(seq)` is true out of the queue."""
        with self.lock:
            out = [s for _, s in self._waiting if which(s)]
            self._waiting = [e for e in self._waiting if not which(e[1])]
        return out

    def finish(self, seq: SeqState) -> None:
        """`seq` is done (or dropped): release its KV and forget it."""
        self.space.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.remove_waiting(lambda s: s is seq)

    def drain(self) -> list[SeqState]:
        """Every sequence, running then waiting, all released (shutdown)."""
        waiting = self.remove_waiting(lambda s: True)
        running, self.running = self.running, []
        for seq in running:
            self.space.release(seq)
        return running + waiting

    # ----------------------------------------------------------------- a step

    def schedule(self) -> StepPlan:
        plan = StepPlan(kv_rows=self.space.rows)
        rows: dict[SeqState, int] = {}
        gone: set[SeqState] = set()
        budget = self.max_step_tokens
        for seq in sorted(self.running, key=lambda s: (s.n_generated == 0, *_rank(s))):
            if seq in gone:
                continue
            if (seq.cached == self.recompute_at and len(seq.tokens) == seq.cached + 1
                    and not seq.draft and not seq.rope_recomputed):
                seq.cached, seq.rope_recomputed = 0, True  # its blocks are kept and rewritten
            n = min(len(seq.tokens) + len(seq.draft) - seq.cached, budget)  # drafts: speculation
            if n <= 0:
                continue
            while not self.space.grow(seq, seq.cached + n):
                victim = max((s for s in self.running if s not in gone), key=_rank)
                self._preempt(victim)
                gone.add(victim)
                plan.preempted.append(victim)
                budget += rows.pop(victim, 0)
                if victim is seq:
                    break
            else:
                rows[seq] = n
                budget -= n
        if not plan.preempted:
            self._admit(plan, rows, budget)
        plan.rows = list(rows.items())
        return plan

    def _admit(self, plan: StepPlan, rows: dict[SeqState, int], budget: int) -> None:
        while budget > 0 and len(self.running) < self.max_running and self.space.can_admit():
            with self.lock:
                seq = self._waiting[0][1] if self._waiting else None
            if seq is None:
                return
            self.space.admit(seq)
            n = min(len(seq.tokens) - seq.cached, budget)
            if not self.space.grow(seq, seq.cached + n):
                self.space.release(seq)  # stays first in line
                seq.cached = 0
                return
            with self.lock:
                self._waiting = [e for e in self._waiting if e[1] is not seq]
            if seq.hasher is not None and seq.reuse_prefix:
                self.prefix_queried_tokens += len(seq.tokens)
                self.prefix_hit_tokens += seq.cached
            self.running.append(seq)
            plan.admitted.append(seq)
            rows[seq] = n
            budget -= n

    def _preempt(self, seq: SeqState) -> None:
        self.space.release(seq)
        seq.cached = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        with self.lock:
            bisect.insort(self._waiting, (_rank(seq), seq), key=lambda e: e[0])
