"""`tessera tune --method dpo`: preference tuning of a LoRA adapter (`--dpo-weights lora`) or of
every weight (`full`), in one process.

The model is set up as `--method lora` / `full` sets it up (`tuning.loop.setup`); each step
takes global batch `step` of the pairs (seeded epochs, as every tuning run), computes the
reference's and the policy's completion log-probabilities, the DPO loss (`tuning.dpo`), and one
AdamW step with pretraining's learning-rate schedule and clipping. The result is
`OUTPUT/adapter` or `OUTPUT/model`, as for supervised tuning.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from tessera.core.checkpoint import read_manifest
from tessera.core.config import ConfigError
from tessera.core.lora import resolve_targets
from tessera.core.lora_format import save_adapter
from tessera.training.loop import compute_context
from tessera.training.objectives import require_decoder
from tessera.training.optim import clip_gradients, learning_rate
from tessera.tuning.config import TuneRunConfig
from tessera.tuning.data import step_indices
from tessera.tuning.dpo import PreferencePair, Reference, dpo_loss, load_pairs, pair_batch, sequence_logps
from tessera.tuning.loop import (
    ADAPTER_DIR,
    MODEL_DIR,
    Inputs,
    Tuning,
    _save_model,
    base_tokenizer,
    chat_template_for,
    setup,
)
from tessera.tuning.lora_state import gather_adapter


@dataclasses.dataclass
class DpoRun:
    """A set-up DPO run: the tuning state, its reference, and the tokenized pairs."""

    tuning: Tuning
    reference: Reference
    pairs: list[PreferencePair]
    cfg: TuneRunConfig

    def batch(self, pairs: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
        """`pair_batch` at the run's row length, or wider for longer pairs (other data)."""
        width = max(self.tuning.seq_len, -(-_longest(pairs) // 8) * 8)
        tokens, labels = pair_batch(pairs, width, self.tuning.tokenizer.pad_id)
        return tokens.to(self.tuning.job.device), labels.to(self.tuning.job.device)

    def loss(self, pairs: list[PreferencePair]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The DPO loss of `pairs` (with gradients) and its metrics."""
        t = self.cfg.tune
        tokens, labels = self.batch(pairs)
        reference = self.reference.logps(tokens, labels)
        with compute_context(self.tuning.job):
            logits = self.tuning.job.stages[0](tokens)
        policy = sequence_logps(logits, labels)
        return dpo_loss(policy, reference, (labels != -100).sum(-1), beta=t.dpo_beta,
                        loss=t.dpo_loss, label_smoothing=t.dpo_label_smoothing)

    @torch.no_grad()
    def preference_accuracy(self, pairs: list[PreferencePair]) -> float:
        """The share of `pairs` whose chosen completion the policy finds likelier."""
        tokens, labels = self.batch(pairs)
        logps = sequence_logps(self.tuning.job.stages[0](tokens), labels)
        chosen, rejected = logps.chunk(2)
        return float((chosen > rejected).float().mean())


def prepare_dpo(cfg: TuneRunConfig, data: str | None = None) -> DpoRun:
    """Check the inputs, tokenize the pairs of `data` (default `--data`) and set the model up."""
    t, layout = cfg.tune, cfg.parallel.layout()
    if layout.world_size != 1:
        raise ConfigError("--method dpo runs in one process for now (tp, pp, cp and dp 1)")
    if not t.checkpoint:
        raise ConfigError("no base model: pass --checkpoint DIR (a Tessera checkpoint)")
    data = data or t.data
    if not data:
        raise ConfigError("no preference pairs: pass --data pairs.jsonl")
    model = read_manifest(t.checkpoint).model
    require_decoder(model, "--method dpo")  # its log-probabilities are a decoder's
    lora = t.dpo_weights == "lora"
    modules = resolve_targets(t.lora_targets, model) if lora else ()
    tokenizer = base_tokenizer(t.checkpoint)
    context = cfg.train.seq_len or model.max_position_embeddings
    pairs = load_pairs(data, chat_template_for(t), tokenizer, context)
    seq_len = min(-(-_longest(pairs) // 8) * 8, context)
    inputs = Inputs(tokenizer, {}, {}, None, None, seq_len, modules, model)
    weights = dataclasses.replace(cfg, tune=dataclasses.replace(t, method=t.dpo_weights))
    tuning = setup(weights, inputs)
    return DpoRun(tuning, Reference(tuning.job.stages[0], lora), pairs, cfg)


def _longest(pairs: list[PreferencePair]) -> int:
    """The longest input row of `pairs` (a sequence minus its last token)."""
    return max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) - 1 for p in pairs)


def tune_dpo(cfg: TuneRunConfig) -> dict[str, Any]:
    """Run DPO as configured; returns the per-step losses and metrics and the result's path."""
    run = prepare_dpo(cfg)
    job, plan = run.tuning.job, run.tuning.job.plan
    gb, seed = plan.data.global_batch, plan.run.seed
    history: list[dict[str, float]] = []
    for step in range(plan.run.steps):
        pairs = [run.pairs[i] for i in step_indices(step, len(run.pairs), gb, seed)]
        lr = learning_rate(step, plan.optimizer)
        for group in job.optimizer.param_groups:
            group["lr"] = lr
        job.optimizer.zero_grad(set_to_none=True)
        loss, metrics = run.loss(pairs)
        loss.backward()
        norm = clip_gradients(job.stages, plan.optimizer.clip_grad)
        job.optimizer.step()
        row = {"step": step + 1, "loss": float(loss.detach()), "lr": lr, "grad_norm": float(norm),
               **{k: float(v) for k, v in metrics.items()}}
        history.append(row)
        if (step + 1) % plan.loop.log_interval == 0 or step + 1 == plan.run.steps:
            print("dpo step {step} | loss {loss:.4f} | reward accuracy {rewards_accuracy:.2f} | "
                  "margin {rewards_margin:.4f}".format(**row), flush=True)
        if not math.isfinite(row["loss"]):
            raise FloatingPointError(f"DPO loss is not finite at step {step + 1}")
    out = Path(plan.loop.output)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.tune.dpo_weights == "lora":
        result = out / ADAPTER_DIR
        save_adapter(result, run.tuning.lora, gather_adapter(job.stages), overwrite=True)
    else:
        result = _save_model(run.tuning, out / MODEL_DIR)
    return {"losses": [r["loss"] for r in history], "history": history, "result": str(result)}
