"""The embedding hook and the prompt modules, on small random models (no base needed)."""

from __future__ import annotations

import pytest
import torch

from tessera.core import ModelConfig, build_model
from tessera.core.prompts import FixedPrompt, attach_prompts, fixed_prompts
from tessera.tuning.prompts import (
    PromptEncoder,
    build_prompts,
    initial_embeddings,
    mark_only_prompt_as_trainable,
    prompt_filter,
)

LLAMA = ModelConfig.from_name("llama-tiny", vocab_size=97, num_layers=2)
GPT2 = ModelConfig.from_name("gpt2-tiny", vocab_size=97, num_layers=2)


def _embed(model, ids):
    with torch.no_grad():
        return model.embed(ids)


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["rope", "learned-positions"])
def test_hook_replaces_only_the_virtual_positions_of_each_tasks_rows(config):
    model = build_model(config, seed=1)
    plain = build_model(config, seed=1)
    tables = {"a": torch.randn(3, 64), "b": torch.randn(5, 64)}
    hook = attach_prompts(model, fixed_prompts(tables, rows_from_ids=True))
    ids = torch.randint(4, 97, (3, 9))
    ids[0, :3], ids[1, :5], ids[2, 0] = 0, 1, 50  # rows: task a, task b, none (id 50)
    got, want = _embed(model, ids), _embed(plain, ids)
    positions = torch.arange(9)
    pos = plain.pos_embeddings(positions) if config.position == "learned" else 0
    expected = want.clone()
    expected[0, :3] = (tables["a"] + (pos[:3] if config.position == "learned" else 0))
    expected[1, :5] = (tables["b"] + (pos[:5] if config.position == "learned" else 0))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

    hook.set_rows(["b", None, "a"])  # the engine names rows explicitly
    got = _embed(model, ids)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2, 3:], want[2, 3:])
    torch.testing.assert_close(got[0, :5] - (pos[:5] if config.position == "learned" else 0),
                               tables["b"])
    with pytest.raises(ValueError, match="rows"):
        _embed(model, ids[:2])
    with pytest.raises(KeyError, match="unknown task 'c'"):
        hook.set_rows(["c", None, None])


def test_positions_past_the_prompt_are_untouched_under_a_kv_cache():
    """A decode step (absolute positions >= n_virtual) keeps its own embedding."""
    model = build_model(LLAMA, seed=0)
    hook = attach_prompts(model, fixed_prompts({"a": torch.randn(4, 64)}))
    hook.set_rows(["a"])
    ids = torch.tensor([[7, 8]])
    with torch.no_grad():
        h = model.embed(ids, torch.tensor([[3, 4]]))
        plain = model.tok_embeddings(ids)
    assert not torch.equal(h[0, 0], plain[0, 0]) and torch.equal(h[0, 1], plain[0, 1])


def test_inference_prompts_leave_unnamed_rows_alone():
    model = build_model(LLAMA, seed=0)
    attach_prompts(model, fixed_prompts({"a": torch.randn(4, 64)}))
    ids = torch.zeros(2, 6, dtype=torch.long)  # position-0 ids equal task a's index
    with torch.no_grad():
        assert torch.equal(model.embed(ids), model.tok_embeddings(ids))


def test_only_prompt_parameters_train_and_filter_names_them():
    model = build_model(LLAMA, seed=0)
    inits = initial_embeddings(model.tok_embeddings.weight.detach(), {"a": 4}, init="vocab")
    attach_prompts(model, build_prompts("p-tuning", inits, encoder="lstm"))
    mark_only_prompt_as_trainable(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("embedding_hook.prompts.a.") for n in trainable)
    assert all(prompt_filter(n) == p.requires_grad for n, p in model.named_parameters())
    ids = torch.zeros(2, 10, dtype=torch.long)
    model(ids, torch.randint(0, 97, (2, 10))).backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == prompt_filter(name), name


def test_encoders_are_seeded_and_bake_to_a_table():
    inits = {"a": torch.randn(6, 64), "b": torch.randn(2, 64)}
    for kind in ("mlp", "lstm"):
        one = build_prompts("p-tuning", inits, encoder=kind, seed=3)
        two = build_prompts("p-tuning", inits, encoder=kind, seed=3)
        tables = one.tables()
        assert {k: v.shape for k, v in tables.items()} == {"a": (6, 64), "b": (2, 64)}
        for k in tables:
            assert torch.equal(tables[k], two.tables()[k])
        assert isinstance(one.prompts["a"], PromptEncoder)
    baked = fixed_prompts(tables)
    assert isinstance(baked.prompts["a"], FixedPrompt) and not list(baked.parameters())


def test_initial_embeddings_from_text_tile_the_text():
    emb = torch.arange(20.0).reshape(10, 2)
    out = initial_embeddings(emb, {"a": 5}, init="text", text_ids=[3, 4])
    assert out["a"][:, 0].tolist() == [6.0, 8.0, 6.0, 8.0, 6.0]
