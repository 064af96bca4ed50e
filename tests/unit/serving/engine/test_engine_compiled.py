"""The engine with a compiled (static-shape, bucketed) decode step generates what Hugging Face
`generate` does, and never compiles again once it has started.

Reference: the same weights exported to Hugging Face format and run by `transformers` (greedy
`generate`, its scores for the logprobs). Requests outnumber the rows and stop at different
lengths, so decode passes see one row, several rows, and rows in scattered slots or blocks; one
runs to the context's last position.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.converters.hf_io import export_hf  # noqa: E402
from tessera.core import ModelConfig, build_model, save_checkpoint  # noqa: E402
from tessera.core.kv_cache import KVCache  # noqa: E402
from tessera.core.parallel.groups import ParallelGroups  # noqa: E402
from tessera.core.quantize import quantize  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.engine.compiled import CompiledDecode  # noqa: E402
from tessera.serving.engine.distributed import start_rank  # noqa: E402
from tessera.serving.engine.executor import LocalExecutor  # noqa: E402
from tessera.serving.engine.kv_config import KVCacheConfig  # noqa: E402
from tessera.serving.engine.runner import ModelRunner  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.serving_helper import collect  # noqa: E402


def _compiles() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module", params=[("llama-tiny", "paged"), ("gpt2-tiny", "slots")],
                ids=["llama-paged", "gpt2-slots"])
def served(request, tmp_path_factory):
    """(engine with compile_decode, HF model of the same weights, graphs compiled at start)."""
    name, kind = request.param
    root = tmp_path_factory.mktemp(name)
    config = ModelConfig.from_name(name, init_std=0.1, max_position_embeddings=32)
    path = save_checkpoint(root / "ckpt", build_model(config, seed=0))
    export_hf(path, root / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    # Dynamo caches graphs per code object, and every engine shares the block's code: forget
    # earlier tests' graphs so the count below is this engine's own.
    torch._dynamo.reset()
    before = _compiles()
    engine = LLMEngine.from_checkpoint(path, max_batch=2, compile_decode=True,
                                       kv=KVCacheConfig(kind=kind, block_size=4))
    yield engine, hf, _compiles() - before
    engine.shutdown()


def _hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                      output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def test_compiled_engine_matches_hf_generate_without_recompiling(served):
    engine, hf, compiled_at_start = served
    assert engine.executor.runner.decode.buckets == [1, 2]
    # One graph per bucket, for any rows and cached length.
    assert compiled_at_start == len(engine.executor.runner.decode.buckets)
    gen = torch.Generator().manual_seed(0)
    # Six requests on two rows, of different prompt and output lengths (one prompt of a
    # single token, one that fills the 32-token context): slots free up out of order and are
    # reused.
    shapes = [(1, 9), (7, 3), (12, 14), (5, 6), (20, 10), (4, 28)]
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n, _ in shapes]
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=new, temperature=0.0,
                                                               ignore_eos=True, logprobs=0))
                for i, (p, (_, new)) in enumerate(zip(prompts, shapes))]
    before = _compiles()
    results = collect(engine, requests)
    assert _compiles() == before, "a decode pass compiled a new graph while serving"
    with torch.no_grad():
        for prompt, (_, new), result in zip(prompts, shapes, results):
            tokens, logprobs = _hf_greedy(hf, prompt, new)
            assert result.token_ids == tokens
            torch.testing.assert_close([lp.logprob for lp in result.logprobs], logprobs,
                                       atol=1e-4, rtol=0)


def test_prompt_tuned_tasks_decode_compiled_as_they_do_eagerly():
    # The embedding hook that places a task's virtual tokens runs eagerly, before the graph.
    model = build_model(ModelConfig.from_name("llama-tiny", init_std=0.1), seed=2)
    g = torch.Generator().manual_seed(0)
    tables = {"alpha": torch.randn(3, 64, generator=g), "beta": torch.randn(5, 64, generator=g)}
    p, q = [1, 40, 41, 42], [1, 90, 7]

    def requests():
        return [GenerationRequest(rid, ids, SamplingParams(max_tokens=8, ignore_eos=True, **kw),
                                  task=task)
                for rid, ids, task, kw in (("a", p, "alpha", {"temperature": 0.0}),
                                           ("b", p, "beta", {"temperature": 0.0}),
                                           ("plain", p, None, {"temperature": 0.0}),
                                           ("a2", q, "alpha", {"temperature": 0.9, "seed": 4}))]

    with LLMEngine(model, tasks=tables, max_batch=4) as eager:
        expected = [r.token_ids for r in collect(eager, requests())]
    with LLMEngine(model, tasks=tables, max_batch=4, compile_decode="eager") as compiled:
        assert compiled.executor.runner.decode is not None  # else eager passes below
        assert [r.token_ids for r in collect(compiled, requests())] == expected
    assert len({tuple(t) for t in expected[:3]}) == 3  # each task changes the output


@pytest.mark.slow  # two bf16 graphs: over a minute of compiling on a 2-core CPU
def test_bf16_decode_logits_match_the_eager_model():
    # bf16 is what the benchmark's headline runs: rounding differs between the compiled and the
    # eager kernels, so logits are compared, not greedy tokens.
    model = build_model(ModelConfig.from_name("llama-tiny", init_std=0.1), seed=5)
    model = model.to(torch.bfloat16).eval()
    cache = KVCache(model.layer_ids, 3, 40, model.config.num_kv_heads, model.config.head_dim,
                    torch.bfloat16)
    decode = CompiledDecode(model, cache, max_batch=2)
    decode.warm_up()
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([1, 0])  # scattered
    x = decode.inputs[2]
    before = _compiles()
    with torch.no_grad():
        full = model(ids).float()
        model(ids[:, :16], positions=torch.arange(16).expand(2, 16), cache=cache, slots=slots)
        for t in range(16, 24):
            x.ids.copy_(ids[:, t:t + 1])
            x.positions.fill_(t)
            x.rows.copy_(slots)
            out = decode(x).float()
            torch.testing.assert_close(out[:, 0], full[:, t], atol=0.05 * full.abs().max(),
                                       rtol=0)
        # The cache's last position (a full-length read) and a padded row: no new graph.
        x.positions.fill_(39)
        decode(x)
        decode.fill_padding(decode.inputs[1])
        decode(decode.inputs[1])
    assert _compiles() == before


def test_compiled_decode_refuses_what_it_cannot_run():
    config = ModelConfig.from_name("llama-tiny")
    stage = build_model(config, None, ParallelGroups(), stage_id=0, num_stages=2).eval()
    cache = KVCache([0, 1], 2, 8, config.num_kv_heads, config.head_dim)
    with pytest.raises(ValueError, match="whole model in one process"):
        CompiledDecode(stage, cache, 1)
    with pytest.raises(ValueError, match="call model.eval"):
        CompiledDecode(build_model(config), cache, 1)
    quantized = quantize(build_model(config).to(torch.bfloat16).eval(), "int8")
    with pytest.raises(ValueError, match="--quantize int8 or --compile"):
        CompiledDecode(quantized, cache, 1)
    with pytest.raises(ValueError, match="a scratch slot for padding rows: 3 slots"):
        CompiledDecode(build_model(config).eval(), cache, 2)
    with pytest.raises(ValueError, match="tp 2 x pp 1 serves eagerly"):
        start_rank("unused", tp=2, compile_decode=True)
    executor = LocalExecutor(ModelRunner(build_model(config), max_batch=1))
    with pytest.raises(ValueError, match="compile_decode to its ModelRunner"):
        LLMEngine(executor, compile_decode=True, background=False)
