"""The output processor: from a step's logits to each request's next output event.

`update_from_output` takes what the model runner returned for a step's scheduled rows and
1. records the KV positions the passes computed (and publishes full blocks to the prefix cache);
2. scores prompt positions (prompt logprobs);
3. samples one token for every row that wants one, in one batched `core.sampling` call, each row
   with its own settings and generator; if the batched call fails, rows are retried one by one
   and only the failing request ends;
4. verifies speculative drafts (`serving.engine.speculative`) and rolls the KV cache back to the
   accepted tokens;
5. per token: stop tokens, stop strings, lengths, incremental text, and an output event. A stop
   token or EOS ends the request without text, but its id and logprob are still released.

`finish` ends a request for any reason (also the engine's aborts, timeouts and failures): it
frees its KV, counts it and sends the final event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tessera.core.sampling import choose_tokens, uniforms_from
from tessera.serving.engine.kv_space import KVSpace
from tessera.serving.engine.request import EngineRequest
from tessera.serving.engine.runner import RunnerOutput
from tessera.serving.engine.sampler import Sampler
from tessera.serving.engine.scheduler import Scheduler
from tessera.serving.engine.speculative import Speculator
from tessera.serving.engine.stats import EngineStats
from tessera.serving.types import FinishReason, GenerationOutput, TokenLogprob

log = logging.getLogger("tessera.serving")


class OutputProcessor:
    """Sampling, speculative verification, stops, detokenization, finishing and metrics.

    Args:
        abort: asks the engine to drop a request whose client stopped listening.
    """

    def __init__(self, scheduler: Scheduler, sampler: Sampler, speculator: Speculator | None,
                 stats: EngineStats, eos_id: int | None,
                 abort: Callable[[EngineRequest], None]):
        self.scheduler, self.sampler, self.speculator = scheduler, sampler, speculator
        self.stats, self.eos_id, self._abort = stats, eos_id, abort

    @property
    def space(self) -> KVSpace:
        return self.scheduler.space

    def update_from_output(self, output: RunnerOutput) -> None:
        """Advance every request of a step's passes (module docstring)."""
        to_sample: list[tuple[EngineRequest, torch.Tensor]] = []
        to_verify: list[tuple[EngineRequest, list[int], torch.Tensor]] = []
        done_prefill: list[EngineRequest] = []
        for seq, message in output.failed:
            self.finish(seq, "error", f"forward pass failed: {message}")
        for ran in output.passes:
            for seq, n in ran.rows:
                seq.cached += n
                if not seq.draft:  # a speculative row publishes blocks once verified
                    self.space.computed(seq)
                self.stats.count("computed_tokens_total", n)
            for seq, logits in ran.drafts:
                draft, seq.draft = seq.draft, []
                if not seq.finished:
                    to_verify.append((seq, draft, logits))
            self.sampler.score_prompts(ran.wanted, ran.logits)
            for i, (seq, t) in enumerate(ran.wanted):
                if t is None and not seq.finished:
                    if seq.max_new == 0:  # max_tokens 0: prompt scored, nothing to sample
                        done_prefill.append(seq)
                    else:
                        to_sample.append((seq, ran.logits[i]))
        for seq in done_prefill:
            self.finish(seq, "length")
        if to_sample:
            self._sample_and_advance(to_sample)
        if to_verify:
            self._verify_and_advance(to_verify)
        self.stats.kv_tokens = sum(s.cached for s in self.scheduler.running)

    def _sample_and_advance(self, rows: list[tuple[EngineRequest, torch.Tensor]]) -> None:
        seqs = [s for s, _ in rows]
        logits = torch.stack([row for _, row in rows])
        uniforms = uniforms_from([s.generator for s in seqs])
        lps: list[TokenLogprob | None] | None = None
        try:
            chosen = self.sampler.choose(seqs, logits, uniforms, choose_tokens)
            tokens, lps = self.sampler.read_back(seqs, logits, chosen)  # the step's one read
        except Exception:
            tokens = []
            for i, seq in enumerate(seqs):  # find the request at fault; the others go on
                try:
                    tokens.append(int(self.sampler.choose([seq], logits[i:i + 1],
                                                          uniforms[i:i + 1], choose_tokens)[0]))
                except Exception as exc:
                    log.exception("sampling failed for request %s", seq.request.request_id)
                    tokens.append(None)
                    self.finish(seq, "error", f"sampling failed: {exc}")
        if lps is None:
            lps = self.sampler.sampled_logprobs(seqs, logits, tokens)
        now = time.monotonic()
        for seq, token, lp in zip(seqs, tokens, lps):
            if token is None or seq.finished:
                continue
            try:
                self._advance(seq, token, lp, now)
            except Exception as exc:
                log.exception("request %s failed", seq.request.request_id)
                self.finish(seq, "error", f"{type(exc).__name__}: {exc}")

    def _verify_and_advance(self, rows: list[tuple[EngineRequest, list[int], torch.Tensor]]
                            ) -> None:
        """Speculative rows: verify each request's drafts against the target's logits, cut its
        KV cache back to the accepted tokens, then advance it token by token (stops and
        lengths cut exactly where plain decoding would)."""
        assert self.speculator is not None
        now = time.monotonic()
        for seq, draft, logits in rows:
            if seq.finished:
                continue
            n_before = len(seq.tokens)
            try:
                tokens = self.speculator.verify(seq, draft, logits)
            except Exception as exc:
                log.exception("speculative verification failed for %s", seq.request.request_id)
                self.finish(seq, "error", f"sampling failed: {exc}")
                continue
            accepted = len(tokens) - 1
            # Keys and values of the last token and the accepted drafts stay; rejected go.
            self.space.rollback(seq, n_before + accepted)
            self.speculator.accepted(seq, n_before, accepted)
            self.stats.count("spec_verify_steps_total")
            self.stats.count("spec_draft_tokens_total", len(draft))
            self.stats.count("spec_accepted_tokens_total", accepted)
            try:
                # Row j's logits predicted emitted token j: its logprobs, as plain decoding's.
                lps = self.sampler.sampled_logprobs([seq] * len(tokens), logits[:len(tokens)],
                                                    tokens)
                for token, lp in zip(tokens, lps):
                    self._advance(seq, token, lp, now)
                    if seq.finished:
                        break
                else:
                    self.space.computed(seq)  # now only verified tokens: publish full blocks
            except Exception as exc:
                log.exception("request %s failed", seq.request.request_id)
                self.finish(seq, "error", f"{type(exc).__name__}: {exc}")

    def _advance(self, seq: EngineRequest, token: int, lp: TokenLogprob | None,
                 now: float) -> None:
        p = seq.params
        seq.tokens.append(token)
        seq.n_generated += 1
        self.stats.count("generation_tokens_total")
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.stats.count("prompt_tokens_total", seq.prompt_len)
            self.stats.observe("time_to_first_token_seconds", now - seq.arrival)
        else:
            self.stats.observe("inter_token_latency_seconds", now - seq.last_token_at)
        seq.last_token_at = now
        self.sampler.track(seq, token)
        if (token == self.eos_id and not p.ignore_eos) or token in seq.stop_ids:
            seq.text.add_silent(token, lp)  # no text, but its id and logprob are released
            self.finish(seq, "stop")
            return
        if seq.text.add(token, lp, check_stop=seq.n_generated >= p.min_tokens):
            self.finish(seq, "stop")
        elif seq.n_generated >= seq.max_new:
            self.finish(seq, "length")
        else:
            self._emit(seq)

    def _emit(self, seq: EngineRequest, reason: FinishReason | None = None,
              error: str | None = None) -> None:
        final = reason is not None
        ids, text, lps = seq.text.take(final=final)
        if not final and not ids and not text:
            return
        prompt_lps = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_lps, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        out = GenerationOutput(
            request_id=seq.request.request_id, token_ids=ids, text=text,
            logprobs=lps if seq.params.logprobs is not None else None,
            prompt_logprobs=prompt_lps, finished=final, finish_reason=reason,
            prompt_tokens=seq.prompt_len, completion_tokens=seq.n_generated, error=error)
        if not seq.sink.deliver(out) and not final:
            self._abort(seq)  # nobody is listening any more

    def finish(self, seq: EngineRequest, reason: FinishReason, error: str | None = None) -> None:
        """End `seq` (once): free its KV, count it, and send its final event unless aborted."""
        if seq.finished:
            return
        seq.finished = True
        self.scheduler.finish(seq)
        self.stats.count(f"requests_finished_{reason}_total")
        self.stats.kv_tokens = sum(s.cached for s in self.scheduler.running)
        if seq.first_token_at is None:
            self.stats.count("prompt_tokens_total", seq.prompt_len)
        self.stats.observe("e2e_request_latency_seconds", time.monotonic() - seq.arrival)
        self.stats.observe("request_prompt_tokens", seq.prompt_len)
        self.stats.observe("request_generation_tokens", seq.n_generated)
        if seq.aborted:
            return  # the client is gone
        if reason == "error" and error is None:
            error = "internal error"
        try:
            self._emit(seq, reason, error)
        except Exception as exc:  # never leave a client without its final event
            log.exception("could not build the final output of %s", seq.request.request_id)
            seq.sink.deliver(GenerationOutput(
                seq.request.request_id, [], "", finished=True, finish_reason="error",
                prompt_tokens=seq.prompt_len, completion_tokens=seq.n_generated,
                error=f"{type(exc).__name__}: {exc}"))
