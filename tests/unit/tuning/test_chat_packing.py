"""Packed conversations: each conversation is its own document (positions restart, attention
never crosses), so its logits in a pack equal its logits alone and a packed batch's loss equals
the unpacked one; `tessera tune --pack` trains LoRA on chat data."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tessera.tuning.config import load_config
from tessera.tuning.data import make_batch
from tessera.tuning.loop import prepare_inputs, setup, train_inputs, tune
from tessera.tuning.packing import make_packed_batch, pack
from tests.unit.tuning.tuning_helper import tune_argv

LORA = ("--method", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all",
        "--lr", "1e-2")
WORDS = "red green blue small large box ball cube one two three".split()


def _conversations(n: int, seed: int = 0) -> list[dict]:
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        pick = [WORDS[int(k)] for k in torch.randint(len(WORDS), (6,), generator=rng)]
        turns = [{"role": "user", "content": " ".join(pick[:3])},
                 {"role": "assistant", "content": " ".join(reversed(pick[:3]))}]
        if i % 2:
            turns = [{"role": "system", "content": "reverse the words"}, *turns,
                     {"role": "user", "content": " ".join(pick[3:])},
                     {"role": "assistant", "content": " ".join(reversed(pick[3:]))}]
        rows.append({"messages": turns})
    return rows


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _conversations(24)))
    return path


@pytest.fixture(scope="module")
def tuned(base, chat_file, tmp_path_factory):
    """The LoRA setup over chat data with --pack at a 96-token context."""
    out = tmp_path_factory.mktemp("packed")
    cfg, _ = load_config(tune_argv(base, out, chat_file, None, *LORA, "--pack", "true",
                                   "--seq-len", "96", "--global-batch", "2"))
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    return setup(cfg, inputs), inputs


def test_packs_hold_several_conversations_in_order_and_fit(tuned):
    t, inputs = tuned
    assert t.seq_len == 96 and inputs.packs
    assert sorted(i for row in inputs.packs for i in row) == list(range(24))
    assert max(len(row) for row in inputs.packs) > 2
    for row in inputs.packs:
        assert row == sorted(row)
        assert sum(len(inputs.train.examples[i].prompt) + len(inputs.train.examples[i].answer) - 1
                   for i in row) <= 96


@torch.no_grad()
def test_a_conversation_in_a_pack_sees_only_itself(tuned):
    t, inputs = tuned
    model = t.job.stages[0]
    row = [inputs.train.examples[i] for i in inputs.packs[0]]
    tokens, labels, documents = make_packed_batch([row], t.task_index, t.n_virtual, t.seq_len,
                                                  t.tokenizer.pad_id)
    packed = model(tokens, document_ids=documents)
    crossed = model(tokens)  # without the documents, later conversations see earlier ones
    at = 0
    for ex in row:
        alone, _ = make_batch([ex], t.task_index, t.n_virtual, t.seq_len, t.tokenizer.pad_id)
        n = len(ex.prompt) + len(ex.answer) - 1
        own = model(alone)[0, :n]
        torch.testing.assert_close(packed[0, at: at + n], own, rtol=1e-5, atol=1e-5)
        if at:
            assert not torch.allclose(crossed[0, at: at + n], own, atol=1e-3)
        at += n
    assert (labels[0, at:] == -100).all() and (documents[0, at:] == len(row)).all()


@torch.no_grad()
def test_the_packed_loss_equals_the_unpacked_loss(tuned):
    t, inputs = tuned
    model = t.job.stages[0]
    examples = [inputs.train.examples[i] for row in inputs.packs[:2] for i in row]
    tokens, labels = make_batch(examples, t.task_index, t.n_virtual, t.seq_len,
                                t.tokenizer.pad_id)
    logits = model(tokens)
    unpacked = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    rows = [[inputs.train.examples[i] for i in row] for row in inputs.packs[:2]]
    p_tokens, p_labels, documents = make_packed_batch(rows, t.task_index, t.n_virtual,
                                                      t.seq_len, t.tokenizer.pad_id)
    assert (p_labels != -100).sum() == (labels != -100).sum()
    packed = model(p_tokens, labels=p_labels, document_ids=documents)
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-6)


def test_batches_come_from_the_packs(tuned):
    t, inputs = tuned
    tokens, labels, extra = train_inputs(t, inputs.train, 0, inputs.packs)
    assert tokens.shape == (2, 96) and extra["document_ids"].shape == (2, 96)
    assert extra["document_ids"].amax() >= 2  # several conversations in some row


def test_pack_refuses_an_example_longer_than_the_row(tuned):
    t, inputs = tuned
    with pytest.raises(ValueError, match="do not fit a row of 8"):
        pack(inputs.train.examples, t.n_virtual, 8)


def test_tune_pack_trains_lora_on_conversations(base, chat_file, tmp_path):
    cfg, _ = load_config(tune_argv(base, tmp_path / "run", chat_file, chat_file, *LORA,
                                   "--pack", "true", "--seq-len", "96", "--global-batch", "2",
                                   "--steps", "12", "--eval-batches", "1"))
    summary = tune(cfg)
    losses = summary["losses"]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert summary["after"]["chat"]["loss"] < summary["before"]["chat"]["loss"]
    assert (tmp_path / "run" / "adapter").is_dir()


def test_pack_needs_lora(base, chat_file, tmp_path):
    from tessera.core.config import ConfigError

    with pytest.raises(ConfigError, match="--pack needs --method lora"):
        load_config(tune_argv(base, tmp_path / "run", chat_file, None, "--pack", "true"))
