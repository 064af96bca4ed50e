"""A request's state inside the engine, and how it is built from a `GenerationRequest`."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tessera.core.tokenizer import Tokenizer
from tessera.serving.engine.adapter_ops import AdapterOps
from tessera.serving.engine.block_manager import BlockHasher, BlockManager
from tessera.serving.engine.bridge import Sink
from tessera.serving.engine.detokenize import OutputText
from tessera.serving.engine.grammar import RequestGrammar
from tessera.serving.engine.kv_space import SeqState
from tessera.serving.types import GenerationRequest, SamplingParams, TokenLogprob


@dataclass(eq=False, kw_only=True)
class EngineRequest(SeqState):
    """A request's state inside the engine (owned by the engine thread once queued).

    `tokens` (from `SeqState`): virtual placeholders + prompt + sampled tokens."""

    request: GenerationRequest
    sink: Sink
    n_input: int  # virtual placeholders + prompt
    n_virtual: int
    task: int  # task index, -1 for none
    max_new: int  # tokens it may sample (max_tokens, capped at the context)
    text: OutputText
    generator: torch.Generator | None
    arrival: float
    deadline: float | None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    counts: torch.Tensor | None = None  # (V,) occurrences in the output (presence/frequency)
    seen: torch.Tensor | None = None  # (V,) bool: in prompt or output (repetition penalty)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    finished: bool = False
    aborted: bool = False
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    adapter: int = -1  # per-request LoRA: the adapter's slot (serving.engine.adapters), -1 for none
    grammar: RequestGrammar | None = None  # structured outputs: the allowed continuations

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_len(self) -> int:
        return self.n_input - self.n_virtual


class RequestBuilder:
    """Builds the `EngineRequest` of a validated request: its task's virtual placeholders, its
    own generator (seeded by the request, else by `seed`'s stream), its length cap, its text
    decoder, its adapter slot and its prefix-cache namespace.

    Args:
        task_len: prompt-tuned task name -> its number of virtual tokens.
        task_index: task name -> the index the runner's prompt hook knows it by.
        kv_limit: the most tokens a request may hold (the context, or a smaller KV pool).
        blocks: the paged cache's bookkeeping (prefix caching namespaces), None for slots.
        eos_stop_ids: end-of-sequence ids besides the engine's EOS: stop ids of every request
            that does not ignore EOS.
    """

    def __init__(self, tokenizer: Tokenizer | None, pad_id: int, *, task_len: Mapping[str, int],
                 task_index: Mapping[str, int], kv_limit: int, blocks: BlockManager | None,
                 adapters: AdapterOps, seed: int | None, eos_stop_ids: Sequence[int] = ()):
        self.tokenizer, self.pad_id = tokenizer, pad_id
        self.task_len, self.task_index = task_len, task_index
        self.kv_limit, self.blocks, self.adapters = kv_limit, blocks, adapters
        self._seeds = random.Random(seed)
        self.eos_stop_ids = frozenset(eos_stop_ids)

    def build(self, request: GenerationRequest, sink: Sink) -> EngineRequest:
        """The request's state; raises `RequestError` for an adapter that is not loaded."""
        p = request.params
        n_virtual = self.task_len.get(request.task, 0) if request.task else 0
        tokens = [self.pad_id] * n_virtual + list(request.prompt_ids)
        generator = None
        if p.temperature > 0:
            seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
            generator = torch.Generator().manual_seed(seed % (1 << 64))
        now = time.monotonic()
        seq = EngineRequest(
            request=request, sink=sink, tokens=tokens, n_input=len(tokens),
            priority=request.priority, hasher=None, reuse_prefix=not p.prompt_logprobs,
            n_virtual=n_virtual, task=self.task_index.get(request.task, -1) if request.task else -1,
            max_new=min(p.max_tokens, self.kv_limit - len(tokens)),
            text=OutputText(self.tokenizer, list(request.prompt_ids), p.stop),
            generator=generator, arrival=now,
            deadline=now + request.timeout_s if request.timeout_s else None,
            stop_ids=frozenset(p.stop_token_ids) | (
                frozenset() if p.ignore_eos else self.eos_stop_ids))
        if p.prompt_logprobs:
            seq.prompt_logprobs = [None] * len(request.prompt_ids)
        adapter_id = self.adapters.bind(seq) if request.adapter is not None else None
        if self.blocks is not None and self.blocks.prefix_caching:
            # The namespace keeps tasks, adapters and tenants apart: equal tokens, different KV.
            # An adapter counts by the ident of its load (its weights), not its name.
            seq.hasher = BlockHasher(self.blocks.block_size,
                                     (request.task, adapter_id, request.cache_salt))
        return seq
