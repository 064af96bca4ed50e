"""LoRA SFT on conversations matches TRL: over 20 steps on the same random-weight model (a
Tessera base and its Hugging Face export), the same conversations in the same order, the same
initial adapter, AdamW and hyperparameters, Tessera's per-step losses equal TRL `SFTTrainer`'s
(with `peft`, loss on the assistant's tokens) within 1e-4 relative, unpacked and packed."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.core import build_model, save_checkpoint
from tessera.core.config import ModelConfig
from tessera.training.loop import train_step
from tessera.tuning.config import load_config
from tessera.tuning.data import step_indices
from tessera.tuning.loop import prepare_inputs, setup, train_batch
from tests.unit.tuning.chat_fixtures import CONVERSATIONS, QWEN25, hf_tokenizer, raw_tokenizer
from tests.unit.tuning.tuning_helper import tune_argv

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

STEPS, BATCH, RANK, ALPHA, LR = 20, 4, 4, 8.0, 1e-2
# One-to-one modules only: Tessera fuses q/k/v (and gate/up) into one layer with one A, which
# trains differently from PEFT's separate q, k and v adapters.
TARGETS = {"attention.wo": "self_attn.o_proj", "feed_forward.w2": "mlp.down_proj"}
WORDS = "alpha beta gamma delta parse decode value error object string".split()


def _conversations() -> list[dict]:
    rows = list(CONVERSATIONS.values())
    rng = torch.Generator().manual_seed(3)
    for i in range(13):
        pick = [WORDS[int(k)] for k in torch.randint(len(WORDS), (6,), generator=rng)]
        turns = [{"role": "user", "content": " ".join(pick[:3])},
                 {"role": "assistant", "content": " ".join(reversed(pick[:3]))}]
        if i % 3 == 1:
            turns = [{"role": "system", "content": "Reverse the words."}, *turns]
        if i % 3 == 2:
            turns += [{"role": "user", "content": " ".join(pick[3:])},
                      {"role": "assistant", "content": " ".join(reversed(pick[3:]))}]
        rows.append({"messages": turns})
    return rows


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trl")
    raw = raw_tokenizer(QWEN25)
    (root / "tok").mkdir()
    raw.save(str(root / "tok" / "tokenizer.json"))
    config = ModelConfig.from_name("llama-tiny", vocab_size=raw.get_vocab_size(),
                                   num_layers=2, max_position_embeddings=512)
    base = save_checkpoint(root / "base", build_model(config, seed=11),
                           tokenizer=root / "tok" / "tokenizer.json")
    (base / "chat_template.jinja").write_text(QWEN25.template)
    data = root / "chat.jsonl"
    rows = _conversations()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "raw": raw, "base": base, "data": data, "rows": rows}


def _tessera(s: dict) -> tuple[list[float], dict[str, torch.Tensor], list[list[int]], list]:
    """Losses of 20 LoRA steps, the initial A factors, each step's example order, and ids."""
    cfg, _ = load_config(tune_argv(
        s["base"], s["root"] / "tessera", s["data"], None, "--method", "lora",
        "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
        "--lora-targets", ",".join(t.split(".")[-1] for t in TARGETS), "--lr", str(LR),
        "--warmup-steps", "0", "--decay", "constant", "--global-batch", str(BATCH),
        "--steps", str(STEPS), "--clip-grad", "1.0"))
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    t = setup(cfg, inputs)
    model = t.job.stages[0]
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}
    losses, order = [], []
    for step in range(STEPS):
        order.append(step_indices(step, len(inputs.train.examples), BATCH, cfg.train.seed))
        tokens, labels = train_batch(t, inputs.train, step)
        losses.append(float(train_step(t.job, step, tokens, labels)["loss"]))
    ids = [e.prompt + e.answer for e in inputs.train.examples]
    return losses, initial, order, ids


def _trl(s: dict, initial: dict[str, torch.Tensor], order: list[list[int]]
         ) -> tuple[list[float], list[list[int]]]:
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    from tessera.converters.hf_io import export_hf

    hf_dir = export_hf(s["base"], s["root"] / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = hf_tokenizer(QWEN25, s["raw"])
    tokenizer.pad_token = "<|endoftext|>"
    rows = [s["rows"][i] for batch in order for i in batch]  # Tessera's order, read in turn
    dataset = datasets.Dataset.from_list([{"messages": r["messages"], "tools": r.get("tools")}
                                          for r in rows])
    args = SFTConfig(
        output_dir=str(s["root"] / "trl"), per_device_train_batch_size=BATCH, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
        optim="adamw_torch", assistant_only_loss=True, packing=False, max_length=None,
        bf16=False, fp16=False, use_cpu=True, report_to="none", logging_steps=1,
        save_strategy="no", gradient_checkpointing=False, seed=0, dataloader_num_workers=0,
        train_sampling_strategy="sequential", dataset_num_proc=None)
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                           target_modules=[h.split(".")[-1] for h in TARGETS.values()],
                           task_type="CAUSAL_LM")
    seen: list[list[int]] = []
    losses: list[float] = []

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.extend([row[mask.bool()].tolist() for row, mask in
                         zip(inputs["input_ids"], inputs["attention_mask"])])
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((out[0] if return_outputs else out).detach()))
            return out

    trainer = Recording(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                        peft_config=lora)
    modules = dict(trainer.model.named_modules())
    for name, a in initial.items():  # layers.N.attention.wo.lora_A.weight
        layer, rest = name.split(".")[1], ".".join(name.split(".")[2:-2])
        hf = modules[f"base_model.model.model.layers.{layer}.{TARGETS[rest]}"]
        with torch.no_grad():
            hf.lora_A["default"].weight.copy_(a)
            assert not hf.lora_B["default"].weight.any()
    trainer.train()
    return losses, seen


def test_lora_sft_losses_equal_trl(setting):
    losses, initial, order, ids = _tessera(setting)
    assert len(initial) == 2 * len(TARGETS)
    want, seen = _trl(setting, initial, order)
    # The same conversations, tokenized the same, in the same order.
    assert seen == [ids[i] for batch in order for i in batch]
    assert len(want) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
    print(f"tessera {losses}\ntrl     {want}\nworst relative difference {worst:.2e}")
    assert worst <= 1e-4, (worst, losses, want)
    # 16 conversations, 4 per step: the first and the last 4 steps are epochs over all of
    # them, and the adapter has learned in between (so the updates are compared too).
    assert len(setting["rows"]) == 4 * BATCH
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05


def test_packed_lora_sft_losses_equal_trl(setting):
    """TRL packs the conversations (best fit decreasing, padding-free rows whose positions
    restart per conversation); Tessera trains on the same packs, each conversation its own
    document, and the 20 losses agree as unpacked."""
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    from tessera.converters.hf_io import export_hf
    from tessera.tuning.packing import make_packed_batch

    s, width, batch = setting, 512, 2
    cfg, _ = load_config(tune_argv(
        s["base"], s["root"] / "tessera-packed", s["data"], None, "--method", "lora",
        "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
        "--lora-targets", ",".join(t.split(".")[-1] for t in TARGETS), "--lr", str(LR),
        "--warmup-steps", "0", "--decay", "constant", "--global-batch", str(batch),
        "--steps", str(STEPS), "--pack", "true", "--seq-len", str(width)))
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    t = setup(cfg, inputs)
    initial = {n: p.detach().clone() for n, p in t.job.stages[0].named_parameters()
               if "lora_A" in n}
    ids = [e.prompt + e.answer for e in inputs.train.examples]

    hf_dir = s["root"] / "hf"
    if not hf_dir.exists():
        export_hf(s["base"], hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = hf_tokenizer(QWEN25, s["raw"])
    tokenizer.pad_token = "<|endoftext|>"
    dataset = datasets.Dataset.from_list([{"messages": r["messages"], "tools": r.get("tools")}
                                          for r in s["rows"]])
    args = SFTConfig(
        output_dir=str(s["root"] / "trl-packed"), per_device_train_batch_size=batch,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
        optim="adamw_torch", assistant_only_loss=True, packing=True, packing_strategy="bfd",
        max_length=width, bf16=False, fp16=False, use_cpu=True, report_to="none",
        logging_steps=1, save_strategy="no", gradient_checkpointing=False, seed=0,
        dataloader_num_workers=0, train_sampling_strategy="sequential")
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                           target_modules=[h.split(".")[-1] for h in TARGETS.values()],
                           task_type="CAUSAL_LM")
    losses: list[float] = []

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((out[0] if return_outputs else out).detach()))
            return out

    trainer = Recording(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                        peft_config=lora)
    # TRL's packs, as conversations of Tessera's data (each found by its tokens).
    packs = []
    for row in trainer.train_dataset:
        at, pack = 0, []
        for n in row["seq_lengths"]:
            pack.append(ids.index(row["input_ids"][at: at + n]))
            at += n
        packs.append(pack)
    assert max(len(p) for p in packs) > 1 and sorted(sum(packs, [])) == list(range(len(ids)))
    modules = dict(trainer.model.named_modules())
    for name, a in initial.items():
        layer, rest = name.split(".")[1], ".".join(name.split(".")[2:-2])
        with torch.no_grad():
            modules[f"base_model.model.model.layers.{layer}.{TARGETS[rest]}"] \
                .lora_A["default"].weight.copy_(a)
    trainer.train()

    got = []
    # TRL reads its packs in order, epoch after epoch; an epoch's last batch may be short.
    batches = [packs[i: i + batch] for i in range(0, len(packs), batch)]
    for step in range(STEPS):
        rows = [[inputs.train.examples[i] for i in pack] for pack in batches[step % len(batches)]]
        tokens, labels, documents = make_packed_batch(rows, t.task_index, t.n_virtual, width,
                                                      t.tokenizer.pad_id)
        metrics = train_step(t.job, step, tokens, labels, {"document_ids": documents})
        got.append(float(metrics["loss"]))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, losses))
    print(f"packed: tessera {got}\ntrl     {losses}\nworst relative difference {worst:.2e}")
    assert len(losses) == STEPS and worst <= 1e-4, (worst, got, losses)
