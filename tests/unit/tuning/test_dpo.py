"""DPO: on one batch of conversational preference pairs the loss, the rewards, the reward
accuracy and the adapter's gradients equal TRL `DPOTrainer`'s (peft, reference = adapter off)
within 1e-5 for the sigmoid, IPO and robust (label-smoothed) losses; 30 DPO steps raise the
share of held-out pairs whose chosen answer the model prefers."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.core import build_model, save_checkpoint
from tessera.core.checkpoint import load_weights
from tessera.core.config import ConfigError, ModelConfig
from tessera.core.lora import lora_parameters
from tessera.core.lora_format import load_adapter
from tessera.tuning.config import load_config
from tessera.tuning.dpo import adapters_off, dpo_loss, sequence_logps
from tessera.tuning.dpo_loop import prepare_dpo, tune_dpo
from tests.unit.tuning.chat_fixtures import QWEN25, hf_tokenizer, raw_tokenizer
from tests.unit.tuning.test_trl_parity import TARGETS
from tests.unit.tuning.tuning_helper import tune_argv

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

WORDS = "red green blue small large box ball cube one two three".split()


def _pairs(n: int, seed: int) -> list[dict]:
    """Conversational pairs: the chosen answer agrees and reverses the user's words, the
    rejected one refuses and repeats them."""
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        words = [WORDS[int(k)] for k in torch.randint(len(WORDS), (3,), generator=rng)]
        prompt = [{"role": "user", "content": " ".join(words)}]
        if i % 2:
            prompt = [{"role": "system", "content": "Reverse the words."}, *prompt]
        rows.append({"prompt": prompt,
                     "chosen": [{"role": "assistant",
                                 "content": "sure: " + " ".join(reversed(words))}],
                     "rejected": [{"role": "assistant", "content": "no: " + " ".join(words)}]})
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dpo")
    raw = raw_tokenizer(QWEN25)
    (root / "tok").mkdir()
    raw.save(str(root / "tok" / "tokenizer.json"))
    config = ModelConfig.from_name("llama-tiny", vocab_size=raw.get_vocab_size(),
                                   num_layers=2, max_position_embeddings=256)
    base = save_checkpoint(root / "base", build_model(config, seed=13),
                           tokenizer=root / "tok" / "tokenizer.json")
    (base / "chat_template.jinja").write_text(QWEN25.template)
    rows = _pairs(4, seed=0)
    return {"root": root, "raw": raw, "base": base, "rows": rows,
            "data": _write(root / "pairs.jsonl", rows)}


def _argv(s, *extra):
    return tune_argv(s["base"], s["root"] / "out", s["data"], None, "--method", "dpo",
                     "--lora-targets", ",".join(t.split(".")[-1] for t in TARGETS),
                     "--lora-rank", "4", "--lora-alpha", "8", "--global-batch", "4", *extra)


def _trl_trainer(s, loss: str, beta: float, smoothing: float):
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    from tessera.converters.hf_io import export_hf

    hf_dir = s["root"] / "hf"
    if not hf_dir.exists():
        export_hf(s["base"], hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = hf_tokenizer(QWEN25, s["raw"])
    tokenizer.pad_token = "<|endoftext|>"
    args = DPOConfig(output_dir=str(s["root"] / "trl"), beta=beta, loss_type=[loss],
                     label_smoothing=smoothing, per_device_train_batch_size=4, max_length=None,
                     use_cpu=True, bf16=False, fp16=False, report_to="none",
                     gradient_checkpointing=False, precompute_ref_log_probs=False)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none",
                           target_modules=[h.split(".")[-1] for h in TARGETS.values()],
                           task_type="CAUSAL_LM")
    return DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(s["rows"]),
                      processing_class=tokenizer, peft_config=lora)


def _hf_module(modules, name):  # layers.N.attention.wo.lora_A.weight -> the peft layer
    layer, rest = name.split(".")[1], ".".join(name.split(".")[2:-2])
    return modules[f"base_model.model.model.layers.{layer}.{TARGETS[rest]}"]


@pytest.mark.parametrize("loss, smoothing", [("sigmoid", 0.0), ("ipo", 0.0), ("robust", 0.1)])
def test_a_batch_equals_trl(setting, loss, smoothing):
    beta = 0.5
    run = prepare_dpo(load_config(_argv(setting, "--dpo-loss", loss, "--dpo-beta", str(beta),
                                        "--dpo-label-smoothing", str(smoothing)))[0])
    factors = lora_parameters(run.tuning.job.stages)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained-looking adapter, so policy and reference differ
        for name, p in factors.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    got, metrics = run.loss(run.pairs)
    got.backward()

    trainer = _trl_trainer(setting, loss, beta, smoothing)
    ds = trainer.train_dataset
    for i, pair in enumerate(run.pairs):  # the same tokens
        assert ds[i]["prompt_ids"] == pair.prompt
        assert (ds[i]["chosen_ids"], ds[i]["rejected_ids"]) == (pair.chosen, pair.rejected)
    modules = dict(trainer.model.named_modules())
    for name, p in factors.items():
        part = "lora_A" if "lora_A" in name else "lora_B"
        with torch.no_grad():
            getattr(_hf_module(modules, name), part)["default"].weight.copy_(p)
    trainer.model.train()
    batch = trainer.data_collator([ds[i] for i in range(len(run.pairs))])
    want = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    want.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for ours, theirs in (("rewards_chosen", "rewards/chosen"),
                         ("rewards_rejected", "rewards/rejected"),
                         ("rewards_accuracy", "rewards/accuracies"),
                         ("rewards_margin", "rewards/margins")):
        assert abs(float(metrics[ours]) - logged[theirs]) <= 1e-5 * max(1.0, abs(logged[theirs]))
    assert 0 < float(metrics["rewards_accuracy"]) < 1 or loss != "sigmoid"
    for name, p in factors.items():
        part = "lora_A" if "lora_A" in name else "lora_B"
        theirs = getattr(_hf_module(modules, name), part)["default"].weight.grad
        assert p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, theirs, rtol=1e-5, atol=1e-7)


def test_the_lora_reference_is_the_base_with_the_adapter_off(setting):
    run = prepare_dpo(load_config(_argv(setting))[0])
    model = run.tuning.job.stages[0]
    with torch.no_grad():
        for name, p in lora_parameters([model]).items():
            if "lora_B" in name:
                p.fill_(0.3)
        tokens, labels = run.batch(run.pairs)
        with adapters_off([model]):
            off = sequence_logps(model(tokens), labels)
        on = sequence_logps(model(tokens), labels)
    base = build_model(ModelConfig.from_name("llama-tiny", vocab_size=setting["raw"]
                                             .get_vocab_size(), num_layers=2,
                                             max_position_embeddings=256), seed=13)
    with torch.no_grad():
        torch.testing.assert_close(sequence_logps(base(tokens), labels), off)
    torch.testing.assert_close(run.reference.logps(tokens, labels), off)
    assert not torch.allclose(on, off)


def test_label_smoothing_mixes_both_directions():
    policy, reference = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.0])
    plain, _ = dpo_loss(policy, reference, torch.tensor([2, 2]), beta=1.0)
    flipped, _ = dpo_loss(reference * 2 - policy, reference, torch.tensor([2, 2]), beta=1.0)
    mixed, _ = dpo_loss(policy, reference, torch.tensor([2, 2]), beta=1.0, label_smoothing=0.25)
    torch.testing.assert_close(mixed, 0.75 * plain + 0.25 * flipped)


@pytest.mark.parametrize("weights", ["lora", "full"])
def test_thirty_steps_raise_the_preference_for_chosen_answers(setting, tmp_path, weights, capsys):
    """The share of the toy set's pairs whose chosen answer the model finds likelier, before
    and after 30 steps (8 pairs a step over 32 pairs), on those pairs and on held-out ones."""
    train = _write(tmp_path / "train.jsonl", _pairs(32, seed=1))
    held_out = _write(tmp_path / "held_out.jsonl", _pairs(32, seed=2))
    extra = ("--dpo-weights", weights, "--steps", "30", "--global-batch", "8", "--lr",
             "2e-2" if weights == "lora" else "2e-3", "--warmup-steps", "0",
             "--dpo-beta", "0.1", "--output", str(tmp_path / weights))
    cfg = load_config(_argv(setting, *extra) + ["--data", str(train)])[0]
    before = prepare_dpo(cfg)
    unseen = prepare_dpo(cfg, str(held_out)).pairs
    accuracy = [before.preference_accuracy(before.pairs), before.preference_accuracy(unseen)]
    summary = tune_dpo(cfg)
    assert len(summary["losses"]) == 30
    after = prepare_dpo(cfg)
    model = after.tuning.job.stages[0]
    if weights == "lora":
        _, tensors = load_adapter(summary["result"])
        with torch.no_grad():
            for name, p in lora_parameters([model]).items():
                p.copy_(tensors[name])
    else:
        load_weights([model], summary["result"])
    accuracy += [after.preference_accuracy(after.pairs), after.preference_accuracy(unseen)]
    with torch.no_grad():  # reward accuracy over the whole set, against the untouched base
        _, metrics = after.loss(after.pairs)
    first, last = summary["history"][0], summary["history"][-1]
    with capsys.disabled():
        print(f"\nDPO {weights}: chosen preferred on the 32 training pairs {accuracy[0]:.3f} -> "
              f"{accuracy[2]:.3f} (held out {accuracy[1]:.3f} -> {accuracy[3]:.3f}); reward "
              f"accuracy {first['rewards_accuracy']:.3f} -> {float(metrics['rewards_accuracy']):.3f};"
              f" loss {first['loss']:.4f} -> {last['loss']:.4f}")
    assert accuracy[2] >= accuracy[0] + 0.2 and accuracy[3] >= accuracy[1] + 0.2
    assert float(metrics["rewards_accuracy"]) >= 0.75
    assert last["loss"] < first["loss"]


def test_dpo_refuses_a_parallel_layout(setting):
    with pytest.raises(ConfigError, match="one process"):
        prepare_dpo(load_config(_argv(setting, "--tp", "2"))[0])


def test_the_command_line_runs_dpo_and_names_bad_pairs(setting, tmp_path, capsys):
    from tessera.tuning import cli

    out = tmp_path / "cli"
    assert cli.main(_argv(setting, "--steps", "2", "--output", str(out))) == 0
    config, tensors = load_adapter(out / "adapter")
    assert config.modules and any(t.any() for n, t in tensors.items() if "lora_B" in n)
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "hi", "chosen": "yes"}])
    assert cli.main(_argv(setting, "--data", str(bad), "--output", str(tmp_path / "x"))) == 2
    assert f"{bad}:1" in capsys.readouterr().err
