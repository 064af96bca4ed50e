"""The contract between the HTTP layer and the generation engine.

The HTTP dialects (OpenAI, KServe v2 / Triton, Megatron `/api`) translate their requests into
`GenerationRequest`s and submit them to an `Engine`; the engine streams `GenerationOutput`s
back, one per decode step that produced tokens for the request, the last one with
`finished=True` and a `finish_reason`. Token ids are the source of truth; `text` is the decoded
delta with stop strings already cut (a stop string or stop token never reaches the client).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "abort", "error", "timeout"]


class RequestError(ValueError):
    """A request the engine refuses before doing any work (bad parameter, too long, unknown
    task); the HTTP layer answers it with a 4xx in the caller's dialect."""


class Overloaded(RuntimeError):
    """The engine's queue is full; the HTTP layer answers 429 (or 503) with Retry-After."""


StructuredKind = Literal["json", "json_schema", "regex", "choice", "grammar"]


@dataclass
class StructuredOutput:
    """A constraint on the generated text, enforced token by token (`serving.engine.grammar`).

    kind "json": any JSON value (`spec` unused); "json_schema": `spec` is a JSON schema (dict),
    `strict` forbids properties the schema does not name; "regex": `spec` is a regular
    expression; "choice": `spec` is a list of strings, one of which is the whole output;
    "grammar": `spec` is an EBNF (GBNF) grammar with a `root` rule. A "json_schema" output may
    be wrapped in fixed text, `prefix` + JSON + `suffix` (a tool call's tags)."""

    kind: StructuredKind
    spec: Any = None
    strict: bool = True
    prefix: str = ""
    suffix: str = ""


@dataclass
class SamplingParams:
    """Per-request decoding settings. `temperature == 0` is greedy."""

    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop strings are ignored until this many tokens exist
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None  # same seed, same prompt, same settings -> same tokens
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # subtracted once from logits of tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated text
    stop: list[str] = field(default_factory=list)  # cut before the first occurrence
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: chosen token's logprob + top-k
    prompt_logprobs: bool = False  # also score the prompt tokens (echo for evaluation)
    structured: StructuredOutput | None = None  # constrain the output (JSON, regex, grammar)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    task: str | None = None  # a prompt-tuned task served by this engine, or None
    timeout_s: float | None = None  # finish with reason "timeout" past this wall time
    # Scheduling and prefix caching (serving.engine.scheduler, serving.engine.block_manager)
    priority: int = 0  # lower runs first; equal priorities: first come, first served
    cache_salt: str | None = None  # KV blocks are shared only between requests with equal salts
    # Per-request LoRA (serving.engine.adapters): a loaded adapter's name, or None for the base model.
    adapter: str | None = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # top-k alternatives at this position


@dataclass
class GenerationOutput:
    request_id: str
    token_ids: list[int]  # new tokens in this event (stop tokens / stop-string tokens excluded)
    text: str  # decoded delta of those tokens, stop strings cut
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first event only; [0] is None
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # cumulative
    error: str | None = None  # with finish_reason "error": what went wrong (this request only)


class Engine(Protocol):
    """What the HTTP layer needs from an engine (`serving.engine.LLMEngine` implements it)."""

    model_name: str

    def tasks(self) -> list[str]:
        """Names of the prompt-tuned tasks this engine serves."""
        ...

    def max_context(self) -> int:
        ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ...

    def decode(self, ids: list[int]) -> str:
        ...

    def validate(self, request: GenerationRequest) -> None:
        """Raise `RequestError` for anything the engine would refuse (before queueing)."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Queue `request` (raising `Overloaded` when full) and stream its outputs.

        Closing the iterator early (client went away) aborts the request.
        """
        ...

    def stats(self) -> dict[str, float]:
        """running, waiting, kv_cache_usage (0..1), and counters for /metrics."""
        ...
