"""The serving engine gives each row the rotary frequencies transformers' `generate` gives that
request alone, for the variants whose frequencies depend on the sequence length: Phi-3's
longrope (short factors up to `original_max_position_embeddings`, long past it, and the whole
sequence re-encoded with the long ones the first time a generation crosses it) and Llama's
dynamic NTK (a base grown with the length past `max_position_embeddings`).

Two prompts, one within the switching length and one past it, run alone and together, with
prefill chunks smaller than the prompts: a chunk must use its whole prompt's length, and a short
row padded beside a long one its own. Tiny random HF models built from a config (nothing
downloaded); each `generate` gets a fresh model, as transformers' dynamic rope remembers the
longest sequence it has seen.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tessera.converters.hf_io import import_hf  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.serving.engine import LLMEngine  # noqa: E402
from tessera.serving.engine.executor import LocalExecutor  # noqa: E402
from tessera.serving.engine.runner import ModelRunner  # noqa: E402
from tessera.serving.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.serving_helper import collect  # noqa: E402
from tests.unit.converters import hf_family_checks as check  # noqa: E402

VOCAB, NEW = 256, 16
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
               tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS = {
    # Phi-3.5-mini's form, switching at 16: a 10-token prompt crosses it while generating.
    "phi3_longrope": (lambda: transformers.Phi3Config(
        **_COMMON, max_position_embeddings=64, original_max_position_embeddings=16,
        sliding_window=None, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.3, 1.6, 2.0],
            long_factor=[2.5, 7.0, 9.0, 12.0])), (10, 21)),
    # Dynamic NTK past max_position_embeddings 8: both generations end far past it (a small
    # theta and a large factor, so a wrong length changes the greedy tokens).
    "llama_dynamic": (lambda: transformers.LlamaConfig(
        **_COMMON, max_position_embeddings=8,
        rope_parameters=dict(rope_type="dynamic", factor=32.0, rope_theta=10.0)), (6, 27)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def imported(request, tmp_path_factory):
    name, root = request.param, tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = check.perturbed(transformers.AutoModelForCausalLM.from_config(MODELS[name][0]()))
    hf.save_pretrained(root / "hf")
    import_hf(root / "hf", root / "ckpt")
    prompts = [check.ids(VOCAB, n, seed=5 + n)[0].tolist() for n in MODELS[name][1]]
    want = []
    for prompt in prompts:  # a fresh model per generate: dynamic rope keeps state
        fresh = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").float().eval()
        want.append(check.hf_greedy(fresh, prompt, NEW))
    return name, root, prompts, want


def _serve(root, prompts: list[list[int]]) -> list[list[int]]:
    model = load_checkpoint(root / "ckpt").eval()
    runner = ModelRunner(model, 2, max_seq=64)
    # 8 tokens a step: every prompt is prefilled in chunks, beside the other's decodes.
    with LLMEngine(LocalExecutor(runner), max_step_tokens=8) as engine:
        results = collect(engine, [GenerationRequest(f"r{i}", p, SamplingParams(
            max_tokens=NEW, temperature=0, ignore_eos=True)) for i, p in enumerate(prompts)])
    return [r.token_ids for r in results]


def test_each_request_alone_equals_generate(imported):
    name, root, prompts, want = imported
    for prompt, tokens in zip(prompts, want, strict=True):
        assert _serve(root, [prompt]) == [tokens], (name, len(prompt))


def test_requests_of_different_lengths_batched_equal_generate(imported):
    name, root, prompts, want = imported
    assert _serve(root, prompts) == want, name


def test_longrope_factors_are_built_once_per_device(imported, monkeypatch):
    """A forward pass builds no factor tensor from a Python list (on a GPU, a blocking copy
    from the host every step): the first call builds them, later calls reuse them."""
    from tessera.core.rope_scaling import rotary_angles

    config = load_checkpoint(imported[1] / "ckpt").config
    if config.rope_scaling.type != "longrope":
        pytest.skip("only longrope has factor lists")
    positions = torch.arange(20).view(1, 20)
    first, _ = rotary_angles(config, positions)
    built: list[object] = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: built.append(a) or real(*a, **k))
    again, _ = rotary_angles(config, positions, torch.tensor([20]))
    assert torch.equal(first, again)
    assert len(built) == 1  # only the lengths given above
