"""A thin T5 engine: text-to-text greedy generation behind the `serving.types.Engine` protocol,
so the OpenAI completions route (and the other dialects) can answer with a T5.

What it does: each request's prompt is the encoder input (`encode` ends it with EOS, as T5's
tokenizer does; `<extra_id_k>` in the text is sentinel k), and `core.models.t5.generate.t5_greedy`
decodes it, one request at a time on a worker thread, the whole completion delivered as one
output. What it does not (refused with a clear `RequestError`): sampling (temperature > 0),
logprobs and echo, stop strings, prompt-tuned tasks; nor does it batch requests or stream token
by token. LoRA adapters are fixed at start (`adapters`): each is a copy of the model sharing its
base weights with the adapter attached unmerged, and a request names one by `adapter`.
`LLMEngine` cannot serve T5 as it is: its runner, KV-cache slots and prefill/decode
schedule assume one decoder-only stack, where a T5 request needs an encoder pass whose output
(and cross-attention keys/values) must live beside its slot for the request's lifetime.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path

import torch

from tessera.core.lora import attach_lora
from tessera.core.lora_format import AdapterConfig
from tessera.core.models.t5.generate import t5_greedy
from tessera.core.models.t5.model import T5Model
from tessera.core.models.t5.tokens import SentinelTokenizer
from tessera.serving.engine.bridge import RequestStream, Sink
from tessera.serving.types import GenerationOutput, GenerationRequest, RequestError


class T5Engine:
    """Greedy T5 generation for the HTTP layer (see the module docstring)."""

    def __init__(self, model: T5Model, tokenizer: SentinelTokenizer | None = None, *,
                 model_name: str = "tessera-t5", eos_id: int | None = None,
                 adapters: dict[str, tuple[AdapterConfig, dict[str, torch.Tensor]]] | None = None):
        if model.num_stages != 1:
            raise ValueError("the T5 engine serves a single pipeline stage (pp 1)")
        self.model, self.tokenizer, self.model_name = model.eval(), tokenizer, model_name
        self._adapted = {name: adapted_copy(model, *adapter)
                         for name, adapter in (adapters or {}).items()}
        self.eos_id = eos_id if eos_id is not None else (tokenizer.eos_id if tokenizer else None)
        self.pad_id = tokenizer.pad_id if tokenizer is not None else 0
        self.max_len = model.config.max_position_embeddings
        self._lock = threading.Lock()  # one generation at a time
        self._counters = {"requests_total": 0, "generation_tokens_total": 0}

    @classmethod
    def from_checkpoint(cls, path: str | Path, *, num_sentinels: int = 100,
                        model_name: str | None = None, **kwargs) -> T5Engine:
        """The engine for the T5 checkpoint at `path`, its tokenizer given `num_sentinels`."""
        from tessera.core.checkpoint import read_manifest
        from tessera.core.models.t5.init import load_t5_checkpoint
        from tessera.core.tokenizer import load_tokenizer

        tok = None
        if read_manifest(path).tokenizer:
            tok = SentinelTokenizer(load_tokenizer(path), num_sentinels)
        return cls(load_t5_checkpoint(str(path)), tok, model_name=model_name or Path(path).name,
                   **kwargs)

    # ---------------------------------------------------------------------- Engine protocol

    def tasks(self) -> list[str]:
        return []

    def adapter_names(self) -> list[str]:
        """The LoRA adapters a request may name."""
        return list(self._adapted)

    def max_context(self) -> int:
        """Prompt (encoder) plus completion (decoder) tokens, each at most the model's length."""
        return 2 * self.max_len

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("this engine has no tokenizer: send token ids")
        return self.tokenizer.encode(text, eos=True)

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def validate(self, request: GenerationRequest) -> None:
        p, problems = request.params, []
        if p.temperature != 0:
            problems.append("the T5 engine decodes greedily: set temperature 0")
        if p.logprobs is not None or p.prompt_logprobs:
            problems.append("the T5 engine returns no logprobs (and no echo)")
        if p.stop or p.stop_token_ids or p.min_tokens or p.ignore_eos:
            problems.append("the T5 engine stops at EOS or max_tokens only (no stop, "
                            "stop_token_ids, min_tokens or ignore_eos)")
        if request.task is not None:
            problems.append("the T5 engine serves no prompt-tuned tasks")
        if request.adapter is not None and request.adapter not in self._adapted:
            problems.append(f"no LoRA adapter named {request.adapter!r}; this engine serves "
                            f"{self.adapter_names() or 'none'}")
        if len(request.prompt_ids) > self.max_len or p.max_tokens > self.max_len:
            problems.append(f"the prompt ({len(request.prompt_ids)} tokens) and max_tokens "
                            f"({p.max_tokens}) must each be at most {self.max_len}")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            problems.append(f"prompt token ids must lie in [0, {vocab})")
        if problems:
            raise RequestError("; ".join(problems))

    def generate(self, request: GenerationRequest) -> RequestStream:
        self.validate(request)
        sink = Sink(asyncio.get_running_loop())
        aborted = threading.Event()
        self._counters["requests_total"] += 1
        threading.Thread(target=self._run, args=(request, sink, aborted), daemon=True,
                         name=f"tessera-t5-{request.request_id}").start()
        return RequestStream(request.request_id, sink, aborted.set)

    def stats(self) -> dict[str, float]:
        return {"running": float(self._lock.locked()), "waiting": 0.0, "kv_cache_usage": 0.0,
                **self._counters}

    # ---------------------------------------------------------------------------- worker

    def _run(self, request: GenerationRequest, sink: Sink, aborted: threading.Event) -> None:
        prompt = len(request.prompt_ids)
        try:
            with self._lock:
                if aborted.is_set():
                    return
                ids = torch.tensor([request.prompt_ids])
                model = self._adapted.get(request.adapter, self.model)  # None: the base
                out = t5_greedy(model, ids, max_new_tokens=request.params.max_tokens,
                                eos_id=self.eos_id, pad_id=self.pad_id)[0].tolist()
        except Exception as exc:  # this request fails, the engine goes on
            sink.deliver(GenerationOutput(request.request_id, [], "", finished=True,
                                          finish_reason="error", prompt_tokens=prompt,
                                          error=f"{type(exc).__name__}: {exc}"))
            return
        stopped = self.eos_id is not None and self.eos_id in out
        if stopped:
            out = out[: out.index(self.eos_id)]
        self._counters["generation_tokens_total"] += len(out)
        sink.deliver(GenerationOutput(request.request_id, out, self.decode(out), finished=True,
                                      finish_reason="stop" if stopped else "length",
                                      prompt_tokens=prompt, completion_tokens=len(out)))


def adapted_copy(model: T5Model, config: AdapterConfig, tensors: dict[str, torch.Tensor]
                 ) -> T5Model:
    """`model` with the adapter (`config`, global `tensors`) attached unmerged; the copy shares
    every base parameter with `model`, so an adapter costs only its factors."""
    shared = {id(p): p for p in model.parameters()}
    adapted = copy.deepcopy(model, memo=shared)
    attach_lora([adapted], config, tensors=tensors)
    return adapted.eval()
