"""The static-shape decode step (`serving.engine.compiled`) against the eager engine.

- Greedy outputs are identical with the bucketed step on and off, over the paged cache with
  prefix caching and per-request LoRA adapters: uncompiled (the code path a CPU runs without
  graphs) and, with the slow tests (about 2 minutes of compiling here), compiled by Inductor
  (`--compile`; test_engine_compiled.py compiles it in the default run, without adapters).
- FlexAttention over the paged cache decodes what the gathering path does.
- A thousand decode steps of varying batch size and cached length compile nothing after
  start-up (Dynamo's counters; its recompile decisions do not depend on the backend, so the
  fast "eager" backend stands in for Inductor there).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.checkpoint import save_checkpoint
from tessera.core.fingerprint import base_fingerprint
from tessera.core.lora_format import AdapterConfig, lora_names, save_adapter
from tessera.core.models.decoder.gemma_options import Gemma2Options
from tessera.core.parallel.sharding import global_param_shapes
from tessera.serving.engine import LLMEngine
from tessera.serving.engine.adapters import LoRAServing
from tessera.serving.engine.compiled import batch_buckets, bucket_for
from tessera.serving.engine.executor import LocalExecutor
from tessera.serving.engine.kv_config import KVCacheConfig
from tessera.serving.engine.runner import ModelRunner
from tessera.serving.types import GenerationRequest, SamplingParams
from tests.serving_helper import collect

CONFIG = ModelConfig.from_name("llama-tiny", init_std=0.1, max_position_embeddings=48)
KV = KVCacheConfig(kind="paged", block_size=4)


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert [bucket_for(batch_buckets(6), n) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    with pytest.raises(ValueError, match="largest bucket 6"):
        bucket_for(batch_buckets(6), 7)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A checkpoint of a tiny Llama and a Tessera LoRA adapter of it (nonzero B)."""
    root = tmp_path_factory.mktemp("static")
    ckpt = save_checkpoint(root / "ckpt", build_model(CONFIG, seed=0))
    shapes, g = global_param_shapes(CONFIG), torch.Generator().manual_seed(1)
    modules, tensors = [], {}
    for i in range(CONFIG.num_layers):
        for leaf in ("attention.wqkv", "feed_forward.w2"):
            module = f"layers.{i}.{leaf}"
            out_f, in_f = shapes[f"{module}.weight"]
            a, b = lora_names(module)
            tensors[a] = torch.randn(4, in_f, generator=g) / in_f ** 0.5
            tensors[b] = torch.randn(out_f, 4, generator=g) * 0.5
            modules.append(module)
    config = AdapterConfig(rank=4, alpha=8.0, modules=tuple(modules),
                           base_fingerprint=base_fingerprint(ckpt))
    return ckpt, save_adapter(root / "lora", config, tensors)


def _requests() -> list[GenerationRequest]:
    """Seven requests over four rows: mixed prompt and output lengths, two sharing a prompt
    prefix with another (prefix-cache hits), some with the adapter; one runs to the context's
    last position."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 9, 14, 5, 21, 3)]
    prompts.append(prompts[2] + [7, 8])
    news = [9, 6, 12, 7, 27, 15, 8]
    adapters = ["a", None, "a", None, None, "a", "a"]  # the last shares r2's cache namespace
    return [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0,
                                                           ignore_eos=True), adapter=a)
            for i, (p, n, a) in enumerate(zip(prompts, news, adapters))]


def _greedy(world, compile_decode: bool | str, kv: KVCacheConfig = KV) -> list[list[int]]:
    ckpt, adapter = world
    model = build_model(CONFIG, seed=0).eval()
    runner = ModelRunner(model, 4, kv=kv, compile_decode=compile_decode,
                         lora=LoRAServing(checkpoint=str(ckpt), preload=(("a", str(adapter)),)))
    with LLMEngine(LocalExecutor(runner), kv=kv) as engine:
        blocks = engine.blocks
        assert blocks is not None and blocks.prefix_caching
        hits, lookup = [], blocks.lookup
        blocks.lookup = lambda digests: hits.extend(lookup(digests)) or lookup(digests)
        results = collect(engine, _requests())
    assert hits, "no request started on cached prefix blocks"
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def eager_outputs(world):
    outputs = _greedy(world, False)
    assert outputs[0] != outputs[1] and len({tuple(o) for o in outputs}) == len(outputs)
    return outputs


@pytest.mark.parametrize("compile_decode", [
    "static", pytest.param(True, marks=pytest.mark.slow)], ids=["uncompiled", "inductor"])
def test_bucketed_decode_is_greedy_identical_with_paged_prefix_cache_and_lora(
        world, eager_outputs, compile_decode):
    assert _greedy(world, compile_decode) == eager_outputs


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_paged_attention_decodes_what_the_gather_does(world, eager_outputs):
    # FlexAttention reading the blocks in place (uncompiled here: torch's reference kernel of
    # the same block mask), in the bucketed step.
    flex = KVCacheConfig(kind="paged", block_size=4, decode_attention="flex")
    assert _greedy(world, "static", flex) == eager_outputs


def test_adapters_change_the_static_step_output(world, eager_outputs):
    # The adapter's rows must differ from the base's on the same prompt: else the LoRA path
    # of the bucketed step would not be tested by the equality above.
    ckpt, adapter = world
    model = build_model(CONFIG, seed=0).eval()
    runner = ModelRunner(model, 2, kv=KV, compile_decode="static",
                         lora=LoRAServing(checkpoint=str(ckpt), preload=(("a", str(adapter)),)))
    prompt = _requests()[1].prompt_ids
    with LLMEngine(LocalExecutor(runner), kv=KV) as engine:
        base, tuned = collect(engine, [
            GenerationRequest(name, prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                           ignore_eos=True), adapter=a)
            for name, a in (("base", None), ("tuned", "a"))])
    assert base.token_ids != tuned.token_ids


def test_the_static_step_soft_caps_the_logits_as_the_eager_step():
    """Gemma 2's final logit soft cap applies in the static step too: sampled tokens' logprobs
    equal the eager engine's (greedy tokens alone would not show a missing cap: tanh keeps the
    order)."""
    config = dataclasses.replace(
        ModelConfig.from_name("gemma2-2b"), hidden_size=32, ffn_hidden_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=32,
        sliding_window=None, sliding_window_layers=None, init_std=0.3,
        options=Gemma2Options(query_pre_attn_scalar=12, final_logit_softcapping=3.0))
    request = GenerationRequest("r", [5, 9, 17, 3], SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))

    def logprobs(compile_decode: bool | str) -> list[float]:
        runner = ModelRunner(build_model(config, seed=0).eval(), 1, compile_decode=compile_decode)
        with LLMEngine(LocalExecutor(runner)) as engine:
            (result,) = collect(engine, [request])
        return [entry.logprob for entry in result.logprobs]

    eager = logprobs(False)
    assert max(abs(v) for v in eager) > 0.01  # the cap leaves real probability elsewhere
    assert logprobs("static") == pytest.approx(eager, abs=1e-5)


def test_a_thousand_decode_steps_of_varying_batch_and_length_compile_nothing_new():
    model = build_model(CONFIG, seed=0).eval()
    before = _graphs()
    with LLMEngine(model, max_batch=8, kv=KV, compile_decode="eager") as engine:
        runner = engine.executor.runner
        assert runner.decode is not None and runner.decode.buckets == [1, 2, 4, 8]
        compiled_at_start = _graphs() - before
        assert 1 <= compiled_at_start <= 4  # a graph per bucket (fewer: reused from a test)
        g = torch.Generator().manual_seed(3)

        def draw(low: int, high: int) -> int:
            return int(torch.randint(low, high, (1,), generator=g))

        # Rounds of 1 to 8 requests of different lengths: the batch shrinks as they finish.
        rounds = [[GenerationRequest(
            f"r{k}-{i}", torch.randint(3, 512, (draw(1, 10),), generator=g).tolist(),
            SamplingParams(max_tokens=draw(20, 38), temperature=0.0, ignore_eos=True))
            for i in range(1 + k % 8)] for k in range(36)]
        runner.decode = counting = CountingDecode(runner.decode)
        for requests in rounds:
            results = collect(engine, requests)
            assert [len(r.token_ids) for r in results] == [q.params.max_tokens
                                                           for q in requests]
    assert len(counting.sizes) >= 1000, len(counting.sizes)
    assert set(counting.sizes) == {1, 2, 4, 8}
    assert len(set(counting.lengths)) > 30  # cached lengths vary too
    assert _graphs() - before == compiled_at_start, "a decode step compiled a new graph"


class CountingDecode:
    """A `CompiledDecode` that records each pass's bucket and largest position."""

    def __init__(self, decode):
        self.decode, self.sizes, self.lengths = decode, [], []

    def __getattr__(self, name):
        return getattr(self.decode, name)

    def __call__(self, x):
        self.sizes.append(x.ids.shape[0])
        self.lengths.append(int(x.positions.max()))
        return self.decode(x)
