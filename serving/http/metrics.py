"""Prometheus metrics of one app, in its own `CollectorRegistry` (two apps never share counts).

Names follow vLLM's (`tessera:` instead of `vllm:`), so its dashboards carry over:

| metric | kind | source |
|---|---|---|
| `tessera:num_requests_running`, `..._waiting` | gauge | `engine.stats()` at scrape time |
| `tessera:kv_cache_usage_perc` | gauge | `engine.stats()["kv_cache_usage"]` (0..1) |
| `tessera:engine_<name>` | gauge | any other number in `engine.stats()` |
| `tessera:num_requests_admitted` | gauge | requests holding an admission slot of the HTTP layer |
| `tessera:time_to_first_token_seconds` | histogram | submit -> first token |
| `tessera:inter_token_latency_seconds` | histogram | between token events of a request |
| `tessera:e2e_request_latency_seconds` | histogram | submit -> last event |
| `tessera:prompt_tokens_total`, `tessera:generation_tokens_total` | counter | per finished request |
| `tessera:requests_total{dialect,status}` | counter | every generation request, by outcome |
| `tessera:kv_cache_blocks_used`, `..._free`, `..._total` | gauge | paged KV cache blocks |
| `tessera:prefix_cache_queries_total`, `..._hits_total` | counter | prompt tokens looked up, found |
| `tessera:num_preemptions_total` | counter | requests preempted for lack of KV blocks |
| `tessera:spec_decode_num_draft_tokens_total`, `..._accepted_...` | counter | drafts verified, accepted |
| `tessera:spec_decode_num_drafts_total` | counter | speculative rows verified |
| `tessera:model_requests_total{served_model}` | counter | finished, per BASE, BASE:TASK, BASE:ADAPTER |
| `tessera:lora_adapters_loaded` | gauge | LoRA adapters loaded now (engines serving adapters) |

`status` is the finish reason (`stop`, `length`, `abort`, `error`, `timeout`) for requests that
reached the engine, else `rejected` (429/503) or `invalid` (4xx); a refused HTTP request counts
once, however many generations (prompts x n) it asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tessera.serving.types import Engine

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)
_ENGINE_GAUGES = {"running": ("num_requests_running", "requests the engine is decoding"),
                  "waiting": ("num_requests_waiting", "requests queued in the engine"),
                  "kv_cache_usage": ("kv_cache_usage_perc", "fraction of KV cache in use (0..1)"),
                  # the paged KV cache (serving.engine.block_manager); absent with slots
                  "kv_blocks_used": ("kv_cache_blocks_used", "KV blocks held by requests"),
                  "kv_blocks_free": ("kv_cache_blocks_free",
                                     "KV blocks held by no request (cached ones included)"),
                  "kv_blocks_total": ("kv_cache_blocks_total", "usable KV blocks in the pool")}
# engine stat -> (counter name without _total, help); vLLM's names
_ENGINE_COUNTERS = {
    "prefix_cache_queries_tokens_total": ("prefix_cache_queries",
                                          "prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits_tokens_total": ("prefix_cache_hits",
                                       "prompt tokens found in the prefix cache"),
    "preemptions_total": ("num_preemptions", "requests preempted for lack of KV blocks"),
    # speculative decoding (serving.engine.speculative): acceptance rate = accepted / draft tokens
    "spec_draft_tokens_total": ("spec_decode_num_draft_tokens", "draft tokens verified"),
    "spec_accepted_tokens_total": ("spec_decode_num_accepted_tokens",
                                   "draft tokens accepted by verification"),
    "spec_verify_steps_total": ("spec_decode_num_drafts", "speculative rows verified")}
_OPTIONAL = {"kv_blocks_used", "kv_blocks_free", "kv_blocks_total"}


class _EngineStats(Collector):
    """Reads `engine.stats()` at scrape time, so the gauges are never stale."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine, self.model = engine, model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            stats = dict(self.engine.stats())
        except Exception:  # a scrape must not fail because the engine is busy or broken
            stats = {}
        for key, (name, help_) in _ENGINE_GAUGES.items():
            if key in _OPTIONAL and key not in stats:
                continue
            family = GaugeMetricFamily(f"tessera:{name}", help_, labels=["model_name"])
            family.add_metric([self.model], float(stats.pop(key, 0.0)))
            yield family
        for key, (name, help_) in _ENGINE_COUNTERS.items():
            if key in stats:
                counter = CounterMetricFamily(f"tessera:{name}", help_, labels=["model_name"])
                counter.add_metric([self.model], float(stats.pop(key)))
                yield counter
        for key, value in sorted(stats.items()):
            if isinstance(value, int | float) and key.replace("_", "").isalnum():
                family = GaugeMetricFamily(f"tessera:engine_{key}", f"engine stat {key!r}",
                                           labels=["model_name"])
                family.add_metric([self.model], float(value))
                yield family


class ServingMetrics:
    def __init__(self, engine: Engine, model: str, admitted: Callable[[], float]) -> None:
        self.registry = registry = CollectorRegistry()
        registry.register(_EngineStats(engine, model))
        labels = {"model_name": model}
        Gauge("tessera:num_requests_admitted", "requests holding an HTTP admission slot",
              registry=registry).set_function(admitted)

        def hist(name: str, help_: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"tessera:{name}", help_, ["model_name"], buckets=buckets,
                             registry=registry).labels(**labels)

        def count(name: str, help_: str) -> Counter:
            return Counter(f"tessera:{name}", help_, ["model_name"], registry=registry).labels(**labels)

        self.ttft = hist("time_to_first_token_seconds", "time to first token", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "time between token events", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "request latency, submit to finish", _E2E_BUCKETS)
        self.prompt_tokens = count("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = count("generation_tokens", "tokens generated")
        self._requests = Counter("tessera:requests", "generation requests by outcome",
                                 ["model_name", "dialect", "status"], registry=registry)
        self._by_model = Counter("tessera:model_requests", "finished generation requests by the "
                                 "model name that selected them (BASE, BASE:TASK, BASE:ADAPTER)",
                                 ["model_name", "served_model"], registry=registry)
        self.model = model
        # Per-request LoRA: adapters loaded now (engines without adapters: no such series).
        names = getattr(engine, "adapter_names", None)
        if names is not None:
            Gauge("tessera:lora_adapters_loaded", "LoRA adapters loaded now",
                  registry=registry).set_function(lambda: len(names()))

    def request(self, dialect: str, status: str, count: int = 1) -> None:
        self._requests.labels(self.model, dialect, status).inc(count)

    def finished(self, adapter: str | None) -> None:
        """One finished request of the base model (None) or of a task / LoRA adapter."""
        self._by_model.labels(self.model, self.model if adapter is None else
                              f"{self.model}:{adapter}").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
