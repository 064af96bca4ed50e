"""The tuning loop: a frozen base, trainable virtual prompts or LoRA adapters, any tp x pp x dp
layout.

It reuses the pretraining machinery: `training.loop.Job` and `train_step` (micro-batch
accumulation or the pipeline schedule, gradient syncs, global-norm clipping, AdamW with the
learning-rate schedule), the config sections, and `MetricsLogger`. What differs is set up here:
the base is built without initialization and loaded from its checkpoint, the prompts are
attached to the first stage as its embedding hook, only they require gradients and only they
are in the optimizer. Batches come from `tuning.data` (indexed by step, so resuming needs only
the step), validation from `tuning.evaluate`, checkpoints from `tuning.checkpoint`, and the
result is a prompt table (`core.prompt_table`) in the output directory.

LoRA (`--method lora`) takes the same path with the adapter in place of the prompts: the
targeted layers get their factors (`core.lora.attach_lora`, this rank's pieces), only those
train, tasks use no virtual tokens, checkpoints hold the global factors and their optimizer
state (`tuning.lora_state`), and the result is an adapter directory `OUTPUT/adapter`
(`core.lora_format.save_adapter`, global tensors put together from every tp and pp rank).

Everything that can be wrong with the inputs (base, tokenizer, data, templates, context) is
found before any rank builds a model or writes a file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.core.chat_template import ChatTemplate, ChatTemplateError, stored_chat_template
from tessera.core.checkpoint import (
    CheckpointReader,
    load_weights,
    read_manifest,
    save_checkpoint,
)
from tessera.core.config import ConfigError, ModelConfig, packed_attention_problems
from tessera.core.flops import model_flops_per_token
from tessera.core.lora import (
    attach_lora,
    mark_only_lora_as_trainable,
    resolve_targets,
    set_lora_dropout,
)
from tessera.core.lora_format import AdapterConfig, AdapterError, check_base, save_adapter
from tessera.core.parallel.zero import ShardedOptimizer
from tessera.core.prompt_table import (
    MANIFEST_FILE,
    TABLE_FILE,
    base_fingerprint,
    write_prompt_table,
)
from tessera.core.prompts import VirtualPrompts, attach_prompts
from tessera.core.tokenizer import Tokenizer, load_tokenizer
from tessera.training.bad_steps import BadStepMonitor, check_policy
from tessera.training.loop import Job, build_rank_model, make_job, memory_gb, plan_for_world
from tessera.training.loop import train_step as pretrain_step
from tessera.training.metrics import MetricsLogger, StepWindow, resolve_peak
from tessera.training.objectives import require_decoder
from tessera.training.run_dir import PRETRAIN_FILES, claim_run_dir
from tessera.training.state import (
    gathered_parameters,
    load_training_checkpoint,
    restore_fp8_state,
    save_training_checkpoint,
)
from tessera.training.stragglers import StepClock, slowest_rank
from tessera.training.watchdog import StepWatchdog
from tessera.tuning import checkpoint as ckpt
from tessera.tuning.config import TuneConfig, TuneRunConfig
from tessera.tuning.data import (
    DataError,
    TaskData,
    TaskSpec,
    discover_tasks,
    load_examples,
    longest,
    make_batch,
    step_indices,
)
from tessera.tuning.evaluate import evaluate, format_task_table, mean_metrics
from tessera.tuning.lora_state import gather_adapter, load_lora_checkpoint, save_lora_checkpoint
from tessera.tuning.packing import make_packed_batch, pack
from tessera.tuning.prompts import (
    build_prompts,
    initial_embeddings,
    mark_only_prompt_as_trainable,
)
from tessera.tuning.seq2seq import is_seq2seq, longest_seq2seq, make_seq2seq_batch


@dataclass
class Tuning:
    """What the tuning loop works with on this rank: the tuning section and the job (whose
    plan holds the rest of the run)."""

    tune: TuneConfig
    job: Job
    prompts: VirtualPrompts | None  # on ranks holding the first stage
    specs: dict[str, TaskSpec]
    n_virtual: dict[str, int]
    task_index: dict[str, int]
    tokenizer: Tokenizer
    seq_len: int
    add_eos: bool
    lora: AdapterConfig | None = None  # the adapter being tuned (LoRA), else None
    # `--eval-engine`: serving's greedy_answers(model, tokenizer, prompts, max_tokens)
    engine_answers: Callable[..., list[list[int]]] | None = None


ADAPTER_DIR = "adapter"  # where `--method lora` writes its adapter, inside the output directory
MODEL_DIR = "model"  # where `--method full` writes its checkpoint, inside the output directory


@dataclass
class Inputs:
    """The checked inputs of a run: base, tokenizer, tasks and tokenized data."""

    tokenizer: Tokenizer
    specs: dict[str, TaskSpec]
    n_virtual: dict[str, int]
    train: TaskData | None
    valid: TaskData | None
    seq_len: int
    modules: tuple[str, ...] = ()  # LoRA: the adapted modules (`--lora-targets` resolved)
    model: ModelConfig | None = None  # the base checkpoint's
    packs: list[list[int]] | None = None  # --pack: the training examples of each row


def base_tokenizer(checkpoint: str) -> Tokenizer:
    manifest = read_manifest(checkpoint)
    if not manifest.tokenizer:
        raise ConfigError(f"{checkpoint} has no tokenizer; tuning data is text, so the base "
                          "checkpoint must carry its tokenizer (pretrain with --tokenizer)")
    return load_tokenizer(Path(checkpoint) / manifest.tokenizer)


def prepare_inputs(cfg: TuneRunConfig, specs: dict[str, TaskSpec] | None = None,
                   train: str | None = None, valid: str | None = None) -> Inputs:
    """Read the base manifest and tokenizer, fix the tasks, tokenize the data; raise
    `ConfigError` / `DataError` for anything wrong. `specs` given: exactly these tasks."""
    t, layout = cfg.tune, cfg.parallel.layout()
    if cfg.parallel.train_schedule().cp_dynamic:
        raise ConfigError("--cp-dynamic spreads the packed documents of pretraining samples by "
                          "their lengths; tuning rows are single examples padded to one length, "
                          "so there is nothing to spread: use fixed --cp (drop --cp-dynamic)")
    if not t.checkpoint:
        raise ConfigError("no base model: pass --checkpoint DIR (a Tessera checkpoint)")
    model = read_manifest(t.checkpoint).model
    seq2seq = is_seq2seq(model)
    if seq2seq:
        _check_seq2seq(cfg, train, valid)
    else:
        require_decoder(model, "prompt tuning (and LoRA tuning)")  # BERT: no generation to tune
    refused = packed_attention_problems(model, "--pack", "tune without --pack") if t.pack else []
    if refused:
        raise ConfigError(refused[0])
    lora = t.method == "lora"
    no_virtual = t.method in ("lora", "full")
    modules: tuple[str, ...] = ()
    if lora:
        try:
            modules = resolve_targets(t.lora_targets, model)
        except AdapterError as exc:
            raise ConfigError(str(exc)) from exc
    tokenizer = base_tokenizer(t.checkpoint)
    if specs is None:
        if not train:
            raise ConfigError("no training data: pass --data train.jsonl")
        specs = {name: cfg.tasks.get(name, TaskSpec(name=name)) for name in discover_tasks(train)}
        unused = sorted(set(cfg.tasks) - set(specs))
        if unused:
            raise ConfigError(f"tasks {unused} are configured but have no examples in {train}")
    # LoRA and full tuning add no virtual tokens: a task's rows are its prompt and answer.
    n_virtual = {name: 0 if no_virtual else s.virtual_tokens or t.virtual_tokens
                 for name, s in specs.items()}
    context = cfg.train.seq_len or model.max_position_embeddings
    if context > model.max_position_embeddings:
        raise ConfigError(f"seq_len {context} exceeds the base model's context "
                          f"{model.max_position_embeddings}")
    for name, n in n_virtual.items():
        if n >= context:
            raise ConfigError(f"task {name!r}: {n} virtual tokens leave no room in the context "
                              f"of {context} tokens; use fewer virtual tokens")
    template = chat_template_for(t)
    train_data, valid_data = (
        load_examples(path, specs, n_virtual, tokenizer, context, t.add_eos, template,
                      t.all_tokens) if path else None
        for path in (train, valid))
    examples = [e for d in (train_data, valid_data) if d is not None for e in d.examples]
    if seq2seq and any(e.trained is not None for e in examples):
        raise ConfigError(f"{train}: conversations are not text-to-text; tune {model.family} on "
                          'rows with an input and an answer ({"input": ..., "answer": ...})')
    multiple = math.lcm(8, layout.tp)  # sequence parallelism splits it over tp
    if layout.cp > 1:  # context parallelism cuts it into 2 x cp chunks (each split over tp)
        multiple = math.lcm(multiple, 2 * layout.cp * layout.tp)
    length = longest_seq2seq(examples) if seq2seq else longest(examples, n_virtual)
    seq_len = min(-(-length // multiple) * multiple, context)
    packs = None
    if t.pack and train_data is not None:
        # Packed rows fill the context (a multiple of what the layout splits), not the longest.
        seq_len = max(context // multiple * multiple, seq_len)
        packs = pack(train_data.examples, n_virtual, seq_len)
    return Inputs(tokenizer, specs, n_virtual, train_data, valid_data, seq_len, modules, model,
                  packs)


def _check_seq2seq(cfg: TuneRunConfig, train: str | None, valid: str | None) -> None:
    """Raise `ConfigError` for what encoder-decoder (T5) tuning does not support."""
    t, layout = cfg.tune, cfg.parallel.layout()
    if t.method != "lora":
        raise ConfigError(f"--method {t.method} is not supported for a T5 base; T5 tunes with "
                          "--method lora (the encoder reads the input, the decoder learns the "
                          "answer)")
    if t.pack:
        raise ConfigError("--pack joins causal rows; T5 rows pair an encoder input with a "
                          "decoder answer: drop --pack")
    if valid:
        raise ConfigError("validation (--valid, --evaluate) is not supported for a T5 base yet; "
                          "tune without it and check the adapter with `tessera serve --lora`")
    if layout.tp * layout.pp * layout.cp > 1:
        raise ConfigError(f"T5 tuning runs data-parallel only, but the layout has tp "
                          f"{layout.tp}, pp {layout.pp}, cp {layout.cp}: use --tp 1 --pp 1 --cp 1")


def chat_template_for(t: TuneConfig) -> ChatTemplate:
    """The template conversations are rendered by: `--chat-template FILE`, else the base
    checkpoint's (as `tessera serve` picks it), else the built-in one."""
    if t.chat_template:
        path = Path(t.chat_template)
        if not path.is_file():
            raise ConfigError(f"--chat-template {path} does not exist")
        source = path.read_text()
    else:
        source = stored_chat_template(t.checkpoint)[0]
    try:
        return ChatTemplate(source)
    except ChatTemplateError as exc:
        raise ConfigError(f"{t.chat_template or t.checkpoint}: {exc}") from None


def setup(cfg: TuneRunConfig, inputs: Inputs, tables: dict[str, torch.Tensor] | None = None,
          adapter: tuple[AdapterConfig, dict[str, torch.Tensor]] | None = None) -> Tuning:
    """Groups, the frozen base stages with the prompts (or LoRA adapter) attached, optimizer
    and schedule.

    `tables` given (evaluation of a finished table): fixed prompts instead of trainable ones.
    `adapter` given (evaluation of a finished LoRA adapter): its config and global tensors,
    frozen.
    """
    from tessera.core.prompts import fixed_prompts

    plan, device = plan_for_world(cfg, model=inputs.model, seq_len=inputs.seq_len)
    groups, stages = build_rank_model(plan, device, init=False)
    load_weights(stages, cfg.tune.checkpoint)
    prompts, lora = None, None
    full = cfg.tune.method == "full"
    if full:
        for m in stages:
            m.train()  # every weight learns, as in pretraining (its dropout, if any)
    elif cfg.tune.method == "lora":
        lora = adapter[0] if adapter else lora_config(cfg.tune, inputs.modules)
        attach_lora(stages, lora, tensors=adapter[1] if adapter else None, seed=plan.run.seed)
    elif any(m.is_first for m in stages):
        if tables is not None:
            prompts = fixed_prompts(tables, rows_from_ids=True)
        else:
            prompts = _initial_prompts(cfg.tune, inputs, plan.run.seed)
        attach_prompts(next(m for m in stages if m.is_first), prompts)
    for m in stages if not full else ():
        (mark_only_lora_as_trainable if lora else mark_only_prompt_as_trainable)(m)
        m.eval()  # the base is frozen: no dropout, no recomputation
        if adapter:
            m.requires_grad_(False)
    if lora:
        set_lora_dropout(stages, True)  # the adapter's own dropout, while training
    job = make_job(plan, device, groups, stages)
    return Tuning(cfg.tune, job, prompts, inputs.specs, inputs.n_virtual,
                  {name: k for k, name in enumerate(inputs.specs)}, inputs.tokenizer,
                  inputs.seq_len, cfg.tune.add_eos, lora)


def lora_config(t: TuneConfig, modules: tuple[str, ...], fingerprint: str = ""
                ) -> AdapterConfig:
    """The adapter `--method lora` tunes, from the tuning section and the resolved target
    modules."""
    return AdapterConfig(rank=t.lora_rank, alpha=t.lora_alpha, modules=modules,
                         targets=tuple(x.strip() for x in t.lora_targets.split(",") if x.strip()),
                         dropout=t.lora_dropout,
                         base_checkpoint=str(Path(t.checkpoint).resolve()),
                         base_fingerprint=fingerprint)


def _initial_prompts(t: TuneConfig, inputs: Inputs, seed: int) -> VirtualPrompts:
    embedding = CheckpointReader(t.checkpoint).global_tensor("tok_embeddings.weight").float()
    text_ids = inputs.tokenizer.encode(t.init_text) if t.init == "text" else None
    inits = initial_embeddings(embedding, inputs.n_virtual, init=t.init, text_ids=text_ids,
                               seed=seed)
    return build_prompts(t.method, inits, encoder=t.encoder, encoder_hidden=t.encoder_hidden,
                         seed=seed)


def train_batch(t: Tuning, data: TaskData, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's share of global batch `step`, one example per row (a decoder
    base; an encoder-decoder also needs the keyword inputs of `train_inputs`)."""
    tokens, labels, _ = train_inputs(t, data, step)
    return tokens, labels


def train_inputs(t: Tuning, data: TaskData, step: int, packs: list[list[int]] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None]:
    """This data-parallel rank's share of global batch `step`: tokens, labels, and with
    `packs` (rows of example indices, `tuning.packing`) the rows' `document_ids`."""
    g, plan = t.job.groups, t.job.plan
    gb = plan.data.global_batch
    idx = step_indices(step, len(packs) if packs else len(data.examples), gb, plan.run.seed)
    per_dp = plan.data.per_dp_batch
    mine = idx[g.dp_rank * per_dp: (g.dp_rank + 1) * per_dp]
    device = t.job.device
    if is_seq2seq(plan.model):
        encoder_ids, labels, extra = make_seq2seq_batch(
            [data.examples[i] for i in mine], t.seq_len, t.tokenizer.pad_id,
            plan.model.options.decoder_start_token_id)
        return (encoder_ids.to(device), labels.to(device),
                {k: v.to(device) for k, v in extra.items()})
    if packs:
        rows = [[data.examples[i] for i in packs[r]] for r in mine]
        tokens, labels, documents = make_packed_batch(rows, t.task_index, t.n_virtual, t.seq_len,
                                                      t.tokenizer.pad_id)
        return tokens.to(device), labels.to(device), {"document_ids": documents.to(device)}
    tokens, labels = make_batch([data.examples[i] for i in mine], t.task_index, t.n_virtual,
                                t.seq_len, t.tokenizer.pad_id)
    return tokens.to(device), labels.to(device), None


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _shared_fingerprint(checkpoint: str) -> str:
    """The base fingerprint, read by rank 0 only and sent to the others."""
    value = [base_fingerprint(checkpoint) if _rank0() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(value, src=0)
    return value[0]


def tune(cfg: TuneRunConfig, *, export_peft: bool = False,
         engine_answers: Callable[..., list[list[int]]] | None = None) -> dict[str, Any]:
    """Run (or resume) prompt tuning or LoRA as configured; returns the run summary on every
    rank. `engine_answers` (serving's `greedy_answers`, handed down by the root command)
    generates the validation answers with `--eval-engine`."""
    check_policy(cfg.loop.bad_step_policy, rollback=False)  # rollback: pretraining only
    inputs = prepare_inputs(cfg, train=cfg.tune.data, valid=cfg.tune.valid)
    # The run directory is claimed after the inputs are checked (a bad input must not cost the
    # old run) and before any write; the barrier after it keeps rank 0 from writing until every
    # rank has looked.
    t = setup(cfg, inputs)
    if cfg.tune.eval_engine:
        if engine_answers is None:
            raise ConfigError("--eval-engine needs the serving engine: run `tessera tune` "
                              "(the root command hands it over)")
        t.engine_answers = engine_answers
    plan = t.job.plan
    loop = plan.loop
    meta = {"base_checkpoint": str(Path(cfg.tune.checkpoint).resolve()),
            "base_fingerprint": _shared_fingerprint(cfg.tune.checkpoint),
            "method": cfg.tune.method, "n_virtual": inputs.n_virtual,
            "config": dict(plan.record)}
    if t.job.fp8 is not None:
        meta["fp8"] = t.job.fp8.record()
    if t.lora is not None:
        t.lora = dataclasses.replace(t.lora, base_fingerprint=meta["base_fingerprint"])
        meta["lora"] = {"rank": t.lora.rank, "alpha": t.lora.alpha, "dropout": t.lora.dropout,
                        "modules": list(t.lora.modules)}
    latest = ckpt.latest_tuning_checkpoint(loop.output)
    resumed = claim_run_dir(
        loop.output, resume=loop.resume, overwrite=loop.overwrite,
        files=(*PRETRAIN_FILES, TABLE_FILE, MANIFEST_FILE, "peft", ADAPTER_DIR, MODEL_DIR),
        latest=latest,
        saved_config=ckpt.read_tuning_meta(latest).get("config") if latest else None,
        config=meta["config"])
    if dist.is_initialized():
        dist.barrier()
    start = 0
    if resumed is not None:
        ckpt.check_resumable(ckpt.read_tuning_meta(resumed), resumed, meta)
        if t.lora is not None:
            start = load_lora_checkpoint(resumed, t.job.stages, t.job.optimizer)
        elif cfg.tune.method == "full":
            start = load_training_checkpoint(resumed, t.job.stages, t.job.optimizer)["step"]
        else:
            start = ckpt.load_tuning_checkpoint(resumed, t.prompts, t.job.optimizer)
        if t.job.fp8 is not None:
            restore_fp8_state(t.job.fp8, ckpt.read_tuning_meta(resumed).get("fp8"),
                              [resumed / ckpt.FP8_FILE], str(resumed))
    if _rank0():
        Path(loop.output).mkdir(parents=True, exist_ok=True)
        for task, n in sorted(inputs.train.truncated.items()):
            if n:
                print(f"tune: truncated {n} training examples of task {task!r} (field "
                      f"{inputs.specs[task].truncate_field!r}) to fit {inputs.seq_len} tokens")
    peak, peak_source = resolve_peak(plan.run.peak_tflops, t.job.device,
                                     plan.precision.matmul_dtype)
    log = MetricsLogger(loop, enabled=_rank0(), total=plan.run.steps, initial=start,
                        resumed_from=resumed, desc="tune")
    before = evaluate(t, inputs.valid, loop.eval_batches) if inputs.valid and start == 0 else None
    # A step whose collective times out raises RankHang naming the ranks that did not answer.
    with StepWatchdog(plan.loop.collective_timeout_s, completed=start) as watchdog:
        losses = _train(t, inputs, log, start, meta, peak, watchdog)
    after = evaluate(t, inputs.valid, loop.eval_batches) if inputs.valid else None
    return _finish(t, inputs, log, losses, before, after, (peak, peak_source), export_peft)


def _train(t: Tuning, inputs: Inputs, log: MetricsLogger, start: int, meta: dict[str, Any],
           peak: float | None, watchdog: StepWatchdog) -> list[float]:
    """Steps `start..steps`: one optimizer step each (watched by `watchdog`), periodic
    validation and checkpoints."""
    plan = t.job.plan
    run, loop, out = plan.run, plan.loop, Path(plan.loop.output)
    # Frozen weights need no weight gradients: about 4N FLOPs per token instead of 6N.
    flops = model_flops_per_token(plan.model, t.seq_len) * (1 if t.tune.method == "full"
                                                            else 2 / 3)
    world = dist.get_world_size() if dist.is_initialized() else 1
    losses: list[float] = []
    monitor = BadStepMonitor(loop.bad_step_policy, loop.max_bad_steps, loop.loss_spike_factor,
                             loop.loss_spike_window)
    window = StepWindow()  # the steps since the last logging step, read there at once
    t.job.step_clock = StepClock()
    for step in range(start, run.steps):
        with t.job.step_clock.step(), watchdog.step(step + 1):
            tokens, labels, extra = train_inputs(t, inputs.train, step, inputs.packs)
            window.add(step + 1, pretrain_step(t.job, step, tokens, labels, extra))
        done = step + 1 == run.steps
        evaluate_now = bool(inputs.valid and loop.eval_interval
                            and (step + 1) % loop.eval_interval == 0 and not done)
        save_due = done or bool(loop.save_interval and (step + 1) % loop.save_interval == 0)
        if not (log.due(step + 1) or evaluate_now or save_due):
            continue
        rows, elapsed = window.resolve()
        if log.due(step + 1) and dist.is_initialized():  # every rank logs at the same steps
            rows[-1].update(slowest_rank(t.job.step_clock.take(), t.job.device))
        verdict = monitor.check(rows)  # `stop`: raises, naming the step
        if verdict is not None:
            log.write(f"bad steps at step {verdict.step}: {verdict.reason}")
        losses.extend(row["loss"] for row in rows)
        tokens_per_s = len(rows) * plan.data.global_batch * t.seq_len / elapsed
        tflops = flops * tokens_per_s / world / 1e12
        for row in rows:  # the window's mean rate on each of its steps
            row.update(tokens_per_s=tokens_per_s, tflops=tflops,
                       mfu=tflops / peak if peak else float("nan"),
                       memory_gb=memory_gb(t.job.device))
        results = None
        if evaluate_now:
            results = evaluate(t, inputs.valid, loop.eval_batches)
            rows[-1].update({f"valid_{k}": v for k, v in mean_metrics(results).items()})
        for row in rows:
            log.step(row)
        if results:
            log.write("  valid exact match: " + ", ".join(
                f"{task} {100 * r['accuracy']:.1f}%" for task, r in results.items()))
        if save_due:
            fp8_state = _gathered_fp8_state(t)  # collective: every rank, every save
            if t.tune.method == "full":  # collective: pretraining's resumable checkpoint
                path = _save_full_checkpoint(t, out, step + 1, meta)
                if _rank0():
                    log.saved(path, step + 1)
            elif t.lora is not None:  # collective: rank 0 writes the gathered factors
                path = save_lora_checkpoint(out, t.job.stages, t.job.optimizer, step=step + 1,
                                            meta=meta, keep_last=loop.keep_last,
                                            fp8_state=fp8_state)
                if _rank0():
                    log.saved(path, step + 1)
            # A sharded optimizer (zero1 / fsdp) saves collectively; otherwise rank 0 alone.
            elif _rank0() or isinstance(t.job.optimizer, ShardedOptimizer):
                path = ckpt.save_tuning_checkpoint(out, t.prompts, t.job.optimizer,
                                                   step=step + 1, meta=meta,
                                                   keep_last=loop.keep_last, groups=t.job.groups,
                                                   fp8_state=fp8_state)
                if _rank0():
                    log.saved(path, step + 1)
            if dist.is_initialized():
                dist.barrier()
        window.restart()
    return losses


def _save_full_checkpoint(t: Tuning, out: Path, step: int, meta: dict[str, Any]) -> Path:
    """Every weight and its optimizer state at `step` (pretraining's training checkpoint, any
    layout resumes it), then `state.json` with the run's tuning record, which completes it as
    a tuning checkpoint. Collective."""
    plan = t.job.plan
    path = save_training_checkpoint(out, t.job.stages, t.job.optimizer, step=step,
                                    consumed_samples=step * plan.data.global_batch,
                                    config=meta["config"], tokenizer=None,
                                    keep_last=plan.loop.keep_last)
    if _rank0():
        (path / ckpt.META_FILE).write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return path


def _gathered_fp8_state(t: Tuning) -> dict[str, torch.Tensor] | None:
    """The FP8 state of every rank's base layers, on global rank 0 (None elsewhere, and
    without FP8). Names are global: pipeline stages contribute their own layers."""
    if t.job.fp8 is None:
        return None
    mine = t.job.fp8.state_tensors()
    if not dist.is_initialized():
        return mine
    parts: list[Any] | None = [None] * dist.get_world_size() if _rank0() else None
    dist.gather_object(mine, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else None


def _finish(t: Tuning, inputs: Inputs, log: MetricsLogger, losses: list[float],
            before: dict | None, after: dict | None, peak: tuple[float | None, str],
            export: bool) -> dict[str, Any]:
    """Write the prompt table or LoRA adapter (rank 0), print the per-task table, return the
    summary."""
    out = Path(t.job.plan.loop.output)
    tables = t.prompts.tables() if t.prompts is not None else {}
    result = out
    if t.tune.method == "full":
        result = _save_model(t, out / MODEL_DIR)  # collective
    elif t.lora is not None:
        result = out / ADAPTER_DIR
        tensors = gather_adapter(t.job.stages)  # collective
        if _rank0():
            save_adapter(result, t.lora, tensors, overwrite=True)
    elif _rank0():
        write_prompt_table(out, tables, base_checkpoint=t.tune.checkpoint,
                           tasks={n: s.to_dict() for n, s in inputs.specs.items()},
                           method=t.tune.method, extra={"add_eos": t.tune.add_eos})
        if export:
            from tessera.tuning.peft_format import export_peft

            export_peft(out, out / "peft", overwrite=True)
    if dist.is_initialized():
        dist.barrier()
    counts = {name: len(v) for name, v in inputs.train.by_task().items()}
    valid_counts = {name: len(v) for name, v in inputs.valid.by_task().items()} \
        if inputs.valid else {}
    rows = []
    for name in inputs.specs:
        row = {"task": name, "n_virtual": inputs.n_virtual[name],
               "train_examples": counts.get(name, 0), "valid_examples": valid_counts.get(name, 0),
               "truncated": inputs.train.truncated[name]}
        if after and name in after:
            row.update(loss=after[name]["loss"], accuracy=after[name]["accuracy"])
        if before and name in before:
            row.update(loss_before=before[name]["loss"],
                       accuracy_before=before[name]["accuracy"])
        rows.append(row)
    valid = mean_metrics(after)["loss"] if after else float("nan")
    summary = log.finish(losses=losses, valid_loss=valid, stopped=False,
                         checkpoint=ckpt.latest_tuning_checkpoint(out), peak_tflops=peak[0],
                         peak_source=peak[1],
                         extra={"tasks": _finite(rows), _RESULT[t.tune.method][0]: str(result)})
    if _rank0():
        what = _RESULT[t.tune.method][1]
        print("\n" + format_task_table(rows) + f"\n\n{what}: {result}", flush=True)
    return {**summary, "losses": losses, "before": before, "after": after}


# What each method writes: the summary's key for it, and its name in words.
_RESULT = {"lora": ("adapter", "LoRA adapter"), "full": ("model", "checkpoint"),
           "prompt-tuning": ("prompts", "prompt table"), "p-tuning": ("prompts", "prompt table")}


def _save_model(t: Tuning, path: Path) -> Path:
    """The tuned weights as a checkpoint `tessera serve` loads, with the base's tokenizer, chat
    template and generation config. Collective."""
    base = Path(t.tune.checkpoint)
    tokenizer = read_manifest(base).tokenizer
    with gathered_parameters(t.job.stages):  # FSDP: whole tp shards, as files hold
        save_checkpoint(path, t.job.stages, step=t.job.plan.run.steps,
                        tokenizer=base / tokenizer if tokenizer else None)
    if _rank0():
        for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json",
                     "generation_config.json"):
            if (base / name).is_file():
                shutil.copyfile(base / name, path / name)
    if dist.is_initialized():
        dist.barrier()
    return path


def _finite(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON-safe rows: NaN becomes None."""
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in r.items()} for r in rows]


def evaluate_table(cfg: TuneRunConfig, prompts_dir: str) -> dict[str, dict[str, Any]]:
    """`tessera tune --evaluate`: metrics of a finished prompt table on `cfg.tune.data`."""
    from tessera.core.prompt_table import check_base, read_prompt_table

    manifest, tables = read_prompt_table(prompts_dir)
    if not cfg.tune.data:
        raise ConfigError("--evaluate needs --data examples.jsonl")
    # The base defaults to the table's, and answers end as they did when it was tuned.
    cfg = dataclasses.replace(cfg, tune=dataclasses.replace(
        cfg.tune, checkpoint=cfg.tune.checkpoint or manifest["base_checkpoint"],
        add_eos=manifest.get("add_eos", cfg.tune.add_eos)))
    specs = {name: TaskSpec(**{k: v for k, v in body.items() if k != "n_virtual"})
             for name, body in manifest["tasks"].items()}
    for name, spec in specs.items():
        spec.virtual_tokens = manifest["tasks"][name]["n_virtual"]
    check_base(manifest, prompts_dir, cfg.tune.checkpoint)
    try:
        inputs = prepare_inputs(cfg, specs=specs, valid=cfg.tune.data)
    except DataError as exc:
        raise DataError(f"{exc} (the prompt table {prompts_dir})") from exc
    t = setup(cfg, inputs, tables=tables)
    results = evaluate(t, inputs.valid, cfg.loop.eval_batches)
    if _rank0():
        rows = [{"task": name, "n_virtual": inputs.n_virtual[name], "valid_examples": r["examples"],
                 "loss": r["loss"], "accuracy": r["accuracy"]} for name, r in results.items()]
        print(format_task_table(rows), flush=True)
    return results


def evaluate_adapter(cfg: TuneRunConfig, adapter_dir: str) -> dict[str, dict[str, Any]]:
    """`tessera tune --evaluate --adapter DIR`: metrics of a finished LoRA adapter on
    `cfg.tune.data` (task templates from `--config`, as when it was tuned)."""
    from tessera.core.lora_format import load_adapter

    config, tensors = load_adapter(adapter_dir)
    if not cfg.tune.data:
        raise ConfigError("--evaluate needs --data examples.jsonl")
    cfg = dataclasses.replace(cfg, tune=dataclasses.replace(
        cfg.tune, checkpoint=cfg.tune.checkpoint or config.base_checkpoint, method="lora"))
    check_base(config, base_fingerprint(cfg.tune.checkpoint), cfg.tune.checkpoint)
    specs = {name: cfg.tasks.get(name, TaskSpec(name=name))
             for name in discover_tasks(cfg.tune.data)}
    inputs = prepare_inputs(cfg, specs=specs, valid=cfg.tune.data)
    t = setup(cfg, inputs, adapter=(config, tensors))
    results = evaluate(t, inputs.valid, cfg.loop.eval_batches)
    if _rank0():
        rows = [{"task": name, "n_virtual": 0, "valid_examples": r["examples"],
                 "loss": r["loss"], "accuracy": r["accuracy"]} for name, r in results.items()]
        print(format_task_table(rows), flush=True)
    return results
