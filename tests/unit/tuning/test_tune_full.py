"""Full-parameter tuning (`--method full`) on conversations: every weight learns, the result is a
checkpoint the serving engine loads (with the base's chat template), and a run resumed from its
step-4 checkpoint ends where the uninterrupted run ends."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tessera.core.chat_template import ChatTemplate, stored_chat_template
from tessera.core.checkpoint import CheckpointReader, load_checkpoint
from tessera.core.tokenizer import load_tokenizer
from tessera.serving.generate import generate_text
from tessera.training.loop import train_step
from tessera.tuning.config import load_config
from tessera.tuning.loop import prepare_inputs, setup, train_batch, tune
from tests.unit.tuning.test_chat_packing import _conversations
from tests.unit.tuning.tuning_helper import tune_argv

FULL = ("--method", "full", "--lr", "1e-3", "--global-batch", "4")
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module")
def chat_base(base, tmp_path_factory):
    """The session base with a chat template of its own, and a chat data file."""
    root = tmp_path_factory.mktemp("full")
    copy = root / "base"
    shutil.copytree(base, copy)
    (copy / "chat_template.jinja").write_text(TEMPLATE)
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _conversations(16, seed=1)))
    return copy, data


def test_every_weight_learns(chat_base, tmp_path):
    base, data = chat_base
    cfg, _ = load_config(tune_argv(base, tmp_path / "run", data, None, *FULL))
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    assert inputs.n_virtual == {"chat": 0}
    t = setup(cfg, inputs)
    model = t.job.stages[0]
    tokens, labels = train_batch(t, inputs.train, 0)
    train_step(t.job, 0, tokens, labels)
    reader = CheckpointReader(base)
    optimized = {id(p) for group in t.job.optimizer.param_groups for p in group["params"]}
    for name, p in model.named_parameters():
        assert p.grad is not None and id(p) in optimized, name
        assert not torch.equal(p, reader.global_tensor(name)), name


@pytest.fixture(scope="module")
def whole(chat_base, tmp_path_factory):
    base, data = chat_base
    out = tmp_path_factory.mktemp("full-run") / "whole"
    extra = (*FULL, "--steps", "8", "--save-interval", "4", "--keep-last", "3")
    return out, tune(load_config(tune_argv(base, out, data, None, *extra))[0]), extra


def test_the_result_is_a_checkpoint_the_server_loads(chat_base, whole):
    base, _ = chat_base
    out, summary, _ = whole
    assert summary["model"] == str(out / "model")
    assert summary["losses"][-1] < summary["losses"][0]
    assert stored_chat_template(out / "model")[0] == TEMPLATE
    model = load_checkpoint(out / "model")
    state = out / "checkpoints" / "step-00000008"
    trained = CheckpointReader(state)
    for name, p in model.named_parameters():
        assert torch.equal(p, trained.global_tensor(name)), name
    # Served through the checkpoint's chat template: the greedy reply of the tuned weights.
    reply = generate_text(str(out / "model"), "red green blue", max_tokens=6, chat=True)
    tokenizer = load_tokenizer(out / "model")
    prompt = ChatTemplate(TEMPLATE).render([{"role": "user", "content": "red green blue"}])
    ids = tokenizer.encode(prompt, bos=True)
    new = []
    with torch.no_grad():
        for _ in range(6):
            token = int(model(torch.tensor([ids + new]))[0, -1].argmax())
            if token == tokenizer.eos_id:
                break
            new.append(token)
    assert reply == tokenizer.decode(new)


def test_a_resumed_run_ends_as_the_whole_run(chat_base, whole, tmp_path):
    base, data = chat_base
    out, summary, extra = whole
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    step4 = out / "checkpoints" / "step-00000004"
    shutil.copytree(step4, part / "checkpoints" / step4.name)
    resumed = tune(load_config(tune_argv(base, part, data, None, *extra, "--resume"))[0])
    assert resumed["losses"] == summary["losses"][4:]
    a, b = CheckpointReader(out / "model"), CheckpointReader(part / "model")
    for name in a.manifest.weight_map:
        assert torch.equal(a.global_tensor(name), b.global_tensor(name)), name
