"""The generation engine: continuous batching over a paged (or slot) KV cache.

One step reads `scheduler.schedule()` (which requests run, and how many of their tokens) ->
the executor runs the model (`runner.ModelRunner` prepares the inputs and returns the logits of
each scheduled request) -> the output processor (`outputs`) samples, verifies speculative
drafts, applies stops, detokenizes, finishes requests and counts metrics. `LLMEngine`
(`core`) owns the loop and the request lifecycle; the rest are composed parts.
"""

from tessera.serving.engine.bridge import run_beside
from tessera.serving.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine", "run_beside"]
