"""The one place a generation request is checked before it is queued (`LLMEngine.validate`).

Every problem is named with what is wrong and what would be accepted; the HTTP layer turns the
`RequestError` built from them into a 400 in the caller's dialect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tessera.serving.types import GenerationRequest


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context: int  # positions per sequence
    tasks: Mapping[str, int]  # task name -> virtual tokens
    max_logprobs: int
    has_tokenizer: bool
    kv_tokens: int | None = None  # tokens the whole KV pool holds, when below the context


def request_problems(request: GenerationRequest, limits: Limits) -> list[str]:
    """Everything wrong with `request` (empty when it can be served)."""
    p, ids, vocab = request.params, request.prompt_ids, limits.vocab_size
    context = limits.context
    out: list[str] = []
    if not ids:
        out.append("the prompt is empty: give at least one token (e.g. BOS)")
    elif min(ids) < 0 or max(ids) >= vocab:
        bad = next(i for i in ids if i < 0 or i >= vocab)
        out.append(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
    n_virtual = 0
    if request.task is not None:
        if request.task not in limits.tasks:
            served = ", ".join(sorted(limits.tasks)) or "none"
            out.append(f"unknown task {request.task!r} (tasks served: {served})")
        else:
            n_virtual = limits.tasks[request.task]
    total = len(ids) + n_virtual
    extra = f" + {n_virtual} virtual tokens of task {request.task!r}" if n_virtual else ""
    if total >= context:
        out.append(f"the prompt has {len(ids)} tokens{extra}, but the context is "
                   f"{context}: at most {context - 1 - n_virtual} prompt tokens "
                   "fit (one position is needed for the first new token)")
    elif limits.kv_tokens is not None and total >= limits.kv_tokens:
        out.append(f"the prompt has {len(ids)} tokens{extra}, but the whole KV cache holds "
                   f"{limits.kv_tokens}: at most {limits.kv_tokens - 1 - n_virtual} prompt "
                   "tokens fit (serve with more --kv-cache-memory)")
    if p.max_tokens < 0:
        out.append(f"max_tokens must be >= 0, got {p.max_tokens}")
    if p.min_tokens < 0 or p.min_tokens > max(p.max_tokens, 0):
        out.append(f"min_tokens must be in [0, max_tokens {p.max_tokens}], got {p.min_tokens}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        out.append(f"temperature must be >= 0 (0 = greedy), got {p.temperature}")
    if p.top_k < -1:
        out.append(f"top_k must be >= 0 (0 or -1: no cut), got {p.top_k}")
    if not 0 < p.top_p <= 1:
        out.append(f"top_p must be in (0, 1], got {p.top_p}")
    if not math.isfinite(p.repetition_penalty) or p.repetition_penalty <= 0:
        out.append(f"repetition_penalty must be > 0 (1 = off), got {p.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not -2 <= value <= 2:
            out.append(f"{name} must be in [-2, 2], got {value}")
    if p.logprobs is not None and not 0 <= p.logprobs <= limits.max_logprobs:
        out.append(f"logprobs must be in [0, {limits.max_logprobs}], got {p.logprobs}")
    bad_ids = [i for i in p.stop_token_ids if not 0 <= i < vocab]
    if bad_ids:
        out.append(f"stop_token_ids {bad_ids} are outside the vocabulary [0, {vocab})")
    if any(not isinstance(s, str) or not s for s in p.stop):
        out.append("stop strings must be non-empty strings")
    elif p.stop and not limits.has_tokenizer:
        out.append("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
    if p.structured is not None and p.ignore_eos:
        out.append("ignore_eos cannot be combined with structured outputs: a constrained "
                   "output ends with EOS once its grammar is complete")
    if request.timeout_s is not None and not request.timeout_s > 0:
        out.append(f"timeout_s must be > 0, got {request.timeout_s}")
    priority = request.priority
    if not isinstance(priority, int) or isinstance(priority, bool):
        out.append(f"priority must be an integer (lower runs first), got {priority!r}")
    salt = request.cache_salt
    if salt is not None and (not isinstance(salt, str) or not salt):
        out.append("cache_salt must be a non-empty string (or absent)")
    return out
