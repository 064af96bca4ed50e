"""Tuning on a Mixture-of-Experts base (a random-weight mixtral-tiny): prompt tuning and LoRA on
the attention run, only the prompts / adapters get gradients, the base (router and experts
included) stays bit-identical, the loss decreases, and the tuned prompts are served by the
engine on the MoE model with greedy equal to the full forward pass with the prompts applied.

The router's load-balancing and z losses are not part of the tuning loss: tuning runs the
frozen base in eval mode (`tuning.loop.setup`), where the MoE layers compute no router loss
(`core.moe.layer`). Their only trainable path would be the prompt (or the attention adapter),
which they would push toward balancing the frozen experts' load instead of toward the task;
Hugging Face likewise adds no router loss unless `output_router_logits` is set, which Mixtral's
config leaves off.
"""

from __future__ import annotations

import pytest
import torch

from tessera.core import build_model, save_checkpoint
from tessera.core.checkpoint import CheckpointReader, load_checkpoint
from tessera.core.config import ModelConfig
from tessera.core.lora import resolve_targets
from tessera.core.lora_format import AdapterError
from tessera.core.moe.layer import MoEFeedForward
from tessera.core.prompts import FixedPrompt, VirtualPrompts, attach_prompts
from tessera.core.tokenizer import train_tokenizer
from tessera.serving.engine import LLMEngine
from tessera.serving.types import GenerationRequest, SamplingParams
from tessera.training.loop import train_step
from tessera.tuning.config import load_config
from tessera.tuning.loop import prepare_inputs, setup, train_batch
from tests.serving_helper import collect, full_forward_greedy
from tests.unit.tuning.tuning_helper import corpus, task_examples, tune_argv, write_jsonl

STEPS = 12


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-base")
    tok = root / "tok.model"
    train_tokenizer([], 384, tok, "bpe", texts=corpus(300), num_threads=1)
    config = ModelConfig.from_name("mixtral-tiny", vocab_size=384, max_position_embeddings=64,
                                   moe={"z_loss_coef": 0.01})
    base = save_checkpoint(root / "base", build_model(config, seed=5), tokenizer=tok)
    train = write_jsonl(root / "train.jsonl", task_examples("kind", "train", 64))
    return base, train


def _tune(moe_base, run, *extra):
    """`STEPS` tuning steps in memory, checking that only the tuned parameters get gradients,
    the rest stays bit-identical to the base checkpoint and the loss decreases; returns the
    tuning state, its inputs, the model and the tuned parameters' names."""
    base, train = moe_base
    cfg, _ = load_config(tune_argv(base, run, train, None, "--steps", str(STEPS), *extra))
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    t = setup(cfg, inputs)
    model = t.job.stages[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tuned = [n for n, p in model.named_parameters() if p.requires_grad]
    assert tuned and not any(".router." in n or ".experts." in n for n in tuned)
    losses = []
    for step in range(STEPS):
        tokens, labels = train_batch(t, inputs.train, step)
        metrics = train_step(t.job, step, tokens, labels)
        assert not any(k.startswith("moe_") for k in metrics)  # no router loss, no statistics
        losses.append(metrics["loss"])
        for name, p in model.named_parameters():
            assert (p.grad is not None) == (name in tuned), name
    reader = CheckpointReader(base)
    for name, p in model.named_parameters():
        if name not in tuned:  # router, experts, attention, embeddings: bit for bit
            assert torch.equal(p, before[name]) and torch.equal(p, reader.global_tensor(name))
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.05, losses
    return t, inputs, model, tuned


def test_prompt_tuning_on_moe_base_is_served_by_the_engine(moe_base, tmp_path):
    t, inputs, model, tuned = _tune(moe_base, tmp_path / "run", "--method", "prompt-tuning",
                                    "--lr", "0.1")
    assert all(n.startswith("embedding_hook.") for n in tuned)
    # No router loss reaches the prompt: its gradient is the same with coefficients 0 and 100.
    tokens, labels = train_batch(t, inputs.train, 0)
    grads = []
    for coef in (0.0, 100.0):
        for m in model.modules():
            if isinstance(m, MoEFeedForward):
                m.aux_coef = m.z_coef = coef
        model.zero_grad()
        model(tokens, labels=labels).backward()
        grads.append([p.grad.clone() for n, p in model.named_parameters() if n in tuned])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))

    tables = t.prompts.tables()
    served = load_checkpoint(moe_base[0]).eval()
    prompt = [1, 40, 41, 42]
    with LLMEngine(served, tasks=tables, max_batch=2) as engine:
        result, = collect(engine, [GenerationRequest("r", prompt, SamplingParams(
            max_tokens=6, temperature=0), task="kind")])
    hook = attach_prompts(served, VirtualPrompts({"kind": FixedPrompt(tables["kind"])},
                                                 rows_from_ids=False))
    hook.set_rows(torch.tensor([0]))
    n_virtual = tables["kind"].shape[0]
    with torch.no_grad():
        assert result.token_ids == full_forward_greedy(served, [0] * n_virtual + prompt, 6)[0]


def test_lora_on_the_attention_of_an_moe_base(moe_base, tmp_path):
    *_, tuned = _tune(moe_base, tmp_path / "run", "--method", "lora", "--lora-targets",
                      "attention", "--lr", "1e-2")
    assert all(".attention." in n and ".lora_" in n for n in tuned)


def test_lora_mlp_targets_skip_moe_layers():
    """MoE layers' experts are grouped weights, not linear layers: `mlp` adapts only the dense
    layers, and on a model without any it fails naming why (it used to attach nothing and
    fail in backward)."""
    with pytest.raises(AdapterError, match="Mixture-of-Experts layers have no w1 / w2"):
        resolve_targets("mlp", ModelConfig.from_name("mixtral-tiny"))
    qwen = ModelConfig.from_name("qwen-moe-tiny", num_layers=4, moe={"layer_freq": 2})
    assert resolve_targets("mlp", qwen) == ("layers.0.feed_forward.w1", "layers.0.feed_forward.w2",
                                            "layers.2.feed_forward.w1", "layers.2.feed_forward.w2")
