"""A model's `generation_config.json`: kept by `tessera convert --from hf` and written back on
export, its eos id list ending generations in the engine, its sampling filling the fields an
OpenAI, Triton or Megatron request leaves out (`core.generation_defaults`)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tessera.core.errors import ConfigError
from tessera.core.generation_defaults import GenerationDefaults, read_generation_defaults
from tessera.serving.engine import LLMEngine
from tessera.serving.engine.executor import LocalExecutor
from tessera.serving.engine.runner import ModelRunner
from tessera.serving.types import GenerationRequest, SamplingParams
from tests.serving_helper import collect

# Llama-3.x-Instruct's generation_config.json (its ids shrunk into a 256-token vocabulary).
LLAMA3_GENERATION = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [201, 208, 209],
                     "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0"}


def _write(directory, data) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("data, want", [
    (LLAMA3_GENERATION, GenerationDefaults((201, 208, 209), 0.6, 0.9, None)),
    ({"eos_token_id": 2, "top_k": 20, "temperature": 0.7}, GenerationDefaults((2,), 0.7, None, 20)),
    ({"eos_token_id": [5, 5, 6], "do_sample": False, "temperature": 0.6},
     GenerationDefaults((5, 6), 0.0, None, None)),  # greedy, as transformers' generate
    ({}, GenerationDefaults()),
])
def test_generation_config_is_read_as_transformers_reads_it(tmp_path, data, want):
    _write(tmp_path, data)
    assert read_generation_defaults(tmp_path) == want
    assert read_generation_defaults(tmp_path / "nothing-here") == GenerationDefaults()


@pytest.mark.parametrize("data, message", [
    ({"eos_token_id": "</s>"}, "eos_token_id='</s>' must be a token id or a list of them"),
    ({"eos_token_id": [1, -2]}, "eos_token_id=[1, -2] must be a token id or a list"),
    ({"temperature": "hot"}, "temperature='hot' must be a number"),
])
def test_a_malformed_generation_config_is_refused_by_field(tmp_path, data, message):
    _write(tmp_path, data)
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_generation_defaults(tmp_path)


def test_convert_keeps_the_generation_config_both_ways(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tessera.converters.hf_io import export_hf, import_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    _write(tmp_path / "hf", LLAMA3_GENERATION)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert read_generation_defaults(tmp_path / "ckpt").eos_token_ids == (201, 208, 209)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert written == LLAMA3_GENERATION
    loaded = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (loaded.eos_token_id, loaded.temperature) == ([201, 208, 209], 0.6)


def _greedy(model, eos_id, ignore_eos: bool = False):
    with LLMEngine(LocalExecutor(ModelRunner(model, 1)), eos_id=eos_id) as engine:
        result = collect(engine, [GenerationRequest("r", [3, 4, 5], SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=ignore_eos))])[0]
    return result.token_ids, result.finish_reason


def test_every_eos_id_of_the_list_ends_a_generation():
    from tessera.core.config import ModelConfig
    from tessera.core.models.decoder.model import GPTModel

    torch.manual_seed(0)
    model = GPTModel(ModelConfig.from_name("llama-tiny", vocab_size=64, num_layers=1)).eval()
    free, reason = _greedy(model, None)
    assert (len(free), reason) == (12, "length")
    later = free[5]  # stops at its first occurrence: an eos id after the first in the list
    stop = free.index(later) + 1
    tokens, reason = _greedy(model, [63 if 63 not in free else 62, later])
    assert (tokens, reason) == (free[:stop], "stop")
    assert _greedy(model, [62, later], ignore_eos=True) == (free, "length")


def test_openai_requests_take_the_models_sampling_for_fields_they_leave_out(make_client, engine):
    client = make_client(sampling_defaults={"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    body = {"model": "fake", "prompt": "abc", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={**body, "temperature": 0.0,
                                                "top_k": 0}).status_code == 200
    first, second = (r.params for r in engine.started)
    assert (first.temperature, first.top_p, first.top_k) == (0.6, 0.9, 20)
    assert (second.temperature, second.top_p, second.top_k) == (0.0, 0.9, 0)


def test_triton_and_megatron_requests_take_the_models_sampling_for_fields_they_leave_out(
        make_client, engine):
    """The same rule on the other protocols: a field the request gives wins, one it leaves out
    is the model's, and the protocol's own default only where the model sets none."""
    client = make_client(sampling_defaults={"temperature": 0.6, "top_p": 0.9})
    sent = [
        client.post("/v2/models/fake/generate", json={"text_input": "ab", "max_tokens": 2}),
        client.post("/v2/models/fake/generate", json={"text_input": "ab", "max_tokens": 2,
                                                      "temperature": 0.0, "top_p": 0.5}),
        client.put("/api", json={"prompts": ["ab"], "tokens_to_generate": 2}),
        client.put("/api", json={"prompts": ["ab"], "tokens_to_generate": 2,
                                 "temperature": 0.0, "top_k": 3}),
    ]
    assert [r.status_code for r in sent] == [200] * 4
    got = [(p.temperature, p.top_p, p.top_k) for p in (r.params for r in engine.started)]
    assert got == [(0.6, 0.9, 0), (0.0, 0.5, 0), (0.6, 0.9, 0), (0.0, 0.9, 3)]
