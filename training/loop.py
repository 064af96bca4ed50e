"""The pretraining loop: one process or many (torchrun), any tp x pp x dp layout of the core.

Per step: each data-parallel rank takes its slice of the global batch (samples are indexed by
step, so resuming only needs the step), runs forward/backward (micro-batch accumulation, or the
pipeline schedule when pp > 1), gradients are synced (sequence-parallel norms, tied embedding
copies, data-parallel average), clipped by the global norm, and AdamW steps. Losses are the mean
over the global batch on every rank.

A step does not wait for the device: its loss and gradient norm stay device tensors until the
next logging step (every `log_interval` steps, an evaluation or a save), which reads the window's
in one copy, checks them (`bad_steps`: a non-finite step has already skipped its update on the
device; persisting trouble stops or rolls back the run), and reports every step of it. Step i
trains on batch i unless batches are skipped (`bad_steps.DataWindows`, kept in checkpoints).
SIGTERM / Ctrl-C finish the current step (under torch.distributed: the steps up to the next
logging step), save, and exit. A step whose collective times out (`--collective-timeout-s`)
ends the job naming the ranks that did not answer (`training.watchdog`); each logged line
carries the interval's slowest rank (`training.stragglers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.core.config import ConfigError, ModelConfig
from tessera.core.flops import model_flops_per_token
from tessera.core.fp8_training import Fp8Training, enable_fp8_training
from tessera.core.init import build_model
from tessera.core.parallel import pipeline
from tessera.core.parallel.context_parallel import document_ids
from tessera.core.parallel.data_parallel import allreduce_gradients, wrap_data_parallel
from tessera.core.parallel.dynamic_cp_runtime import DynamicCP
from tessera.core.parallel.groups import ParallelGroups, init_groups, resolve_device
from tessera.core.parallel.launch import init_distributed
from tessera.core.parallel.pipeline_forward import pipeline_forward
from tessera.core.parallel.random import tracker
from tessera.core.parallel.sharding import kv_replicas
from tessera.core.regional_compile import compile_blocks
from tessera.training import bad_steps
from tessera.training.banner import run_banner
from tessera.training.checkpoint_saver import CheckpointSaver, SaveReport
from tessera.training.config import PretrainConfig
from tessera.training.fault_injection import kill_if_asked
from tessera.training.metrics import MetricsLogger, StepWindow, resolve_peak
from tessera.training.moe_step import begin_moe_step, end_moe_step
from tessera.training.objectives import CAUSAL_LM, Objective, check_objective, objective_for
from tessera.training.optim import build_optimizer, clip_gradients, learning_rate
from tessera.training.run_dir import claim_run_dir
from tessera.training.run_plan import DataPlan, RunPlan, resolve_plan
from tessera.training.state import (
    latest_checkpoint,
    load_training_checkpoint,
    read_training_record,
)
from tessera.training.stragglers import StepClock, slowest_rank
from tessera.training.watchdog import StepWatchdog


@dataclass
class Job:
    """What the loop works with on this rank: the run plan and what was built from it."""

    plan: RunPlan
    groups: ParallelGroups
    stages: list[nn.Module]
    optimizer: torch.optim.Optimizer
    schedule: Any  # the runnable pipeline schedule (`plan.schedule` built), or None when pp == 1
    device: torch.device
    scaler: Any  # torch.amp.GradScaler for fp16, else None
    fp8: Fp8Training | None = None  # --precision fp8: the FP8 layers, scales and their state
    eod_id: int | None = None  # set: packed documents are isolated (--isolate-documents)
    objective: Objective = CAUSAL_LM  # the family's batches and losses (training.objectives)
    dynamic_cp: DynamicCP | None = None  # --cp-dynamic: the cp sub-groups and their layout
    # T5: sums the embedding copies' gradients, in place of the tied-embedding sync
    embedding_sync: Callable[[], None] | None = None
    # Set: times this rank's work before each step's gradient sync (training.stragglers)
    step_clock: StepClock | None = None


def join_world(device: str, collective_timeout_s: float = 600.0) -> tuple[torch.device, int]:
    """The device `device` names (`auto`: CUDA when present), this process joined to the
    torchrun world if it was launched into one (each collective bounded by
    `collective_timeout_s`), and the world's size."""
    dev = resolve_device(device)
    init_distributed(dev, timeout=timedelta(seconds=collective_timeout_s))
    return dev, dist.get_world_size() if dist.is_initialized() else 1


def plan_for_world(cfg: Any, **options: Any) -> tuple[RunPlan, torch.device]:
    """`cfg` (a written pretraining or tuning config) resolved for the world this process
    joins (torchrun's, or itself alone; `resolve_plan`, with `options`), and its device."""
    device, world = join_world(cfg.train.device, cfg.loop.collective_timeout_s)
    return resolve_plan(cfg, world, **options), device


def build_rank_model(plan: RunPlan, device: torch.device, *, init: bool = True
                     ) -> tuple[ParallelGroups, list[nn.Module]]:
    """The process groups of `plan.layout` and this rank's model chunks, seeded (`init=False`
    leaves the weights for a checkpoint to fill). The world must be joined (`join_world`)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != plan.layout.world_size:
        raise ConfigError(f"the plan is for {plan.layout.world_size} ranks but this world has "
                          f"{world}; resolve it for this world (`resolve_plan`)")
    fp8 = plan.precision.fp8_recipe_on(device)
    # FP8 under Transformer Engine needs TE's layers; the other FP8 backends need plain ones.
    backend = "auto" if fp8 is None else "te" if fp8.backend == "te" else "torch"
    layout, schedule, seed = plan.layout, plan.schedule, plan.run.seed
    groups = init_groups(layout, kv_replicas=kv_replicas(plan.model, layout.tp))
    torch.manual_seed(seed)
    if groups.cp_size > 1:
        # cp ranks hold different tokens: their dropout masks must differ (the default
        # generator stays shared over tp, which holds the same activations outside SP regions).
        torch.manual_seed(seed + 7_919 * groups.cp_rank)
    tracker.seed(seed, groups.tp_rank + groups.tp_size * groups.cp_rank)
    dtype = plan.precision.weight_dtype
    if layout.pp > 1:
        stages = pipeline.build_stages(plan.model, layout, groups, schedule=schedule,
                                       device=device, dtype=dtype, seed=seed,
                                       init=init, backend=backend)
    else:
        stages = [build_model(plan.model, layout, groups, schedule=schedule, device=device,
                              dtype=dtype, seed=seed, init=init, backend=backend)]
    return groups, stages


def make_job(plan: RunPlan, device: torch.device, groups: ParallelGroups,
             stages: list[nn.Module], eod_id: int | None = None) -> Job:
    """The optimizer (over parameters that require grad), pipeline schedule and precision;
    under `--data-parallel fsdp` the stages are wrapped by FSDP2 first. `eod_id` set: packed
    documents are isolated at that token (pretraining's `--isolate-documents`)."""
    recipe = plan.precision.fp8_recipe_on(device)
    fp8 = None if recipe is None else enable_fp8_training(stages, recipe, groups)
    if plan.schedule.data_parallel == "fsdp":
        stages = wrap_data_parallel(stages, plan.schedule, groups)  # in place: same names
    objective = objective_for(plan.model)
    schedule = None
    if plan.layout.pp > 1:
        schedule = pipeline.build_schedule(stages, plan.layout, plan.schedule, groups,
                                           objective.pipeline_loss(plan.model, groups))
    scaler = torch.amp.GradScaler(device.type) if plan.precision.loss_scaling else None
    # zero1 and fsdp: each dp rank keeps the optimizer state of its rows (core.parallel.zero).
    optimizer = build_optimizer(stages, plan.optimizer, groups if plan.optimizer.sharded else None)
    return Job(plan, groups, stages, optimizer, schedule, device, scaler, fp8, eod_id, objective)


def setup(plan: RunPlan, device: torch.device) -> Job:
    """Build the groups, model chunks and optimizer of `plan` on this rank."""
    groups, stages = build_rank_model(plan, device)
    for m in stages:
        m.train()
        if plan.run.compile:  # in place: parameter names (checkpoints, optimizer) stay the same
            compile_blocks(m)
    eod_id = None
    if plan.data.isolate_documents:
        from tessera.core.tokenizer import load_tokenizer

        eod_id = load_tokenizer(plan.data.tokenizer).eod_id
    job = make_job(plan, device, groups, stages, eod_id)
    if job.objective.embedding_sync is not None:  # collective: every rank, once
        job.embedding_sync = job.objective.embedding_sync(plan, groups, job.stages)
    if plan.schedule.cp_dynamic:
        job.dynamic_cp = DynamicCP.create(plan.model, plan.layout, groups, plan.schedule.cp_comm)
    return job


def local_batch(dataset, step: int, data: DataPlan, groups: ParallelGroups,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's share of global batch `step` (samples indexed by step)."""
    rows = local_rows(dataset, step, data, groups, device)
    return rows["tokens"], rows["labels"]


def local_rows(dataset, step: int, data: DataPlan, groups: ParallelGroups,
               device: torch.device) -> dict[str, torch.Tensor]:
    """This data-parallel rank's share of global batch `step` (samples indexed by step), for
    any objective: every tensor of the items, stacked (rows first); `Objective.split_batch`
    says what each is."""
    per_dp = data.per_dp_batch
    start = step * data.global_batch + groups.dp_rank * per_dp
    items = [dataset[i] for i in range(start, start + per_dp)]
    rows = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    if device.type == "cuda":  # from pinned memory the copy is queued, not waited for
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in rows.items()}
    return {k: v.to(device) for k, v in rows.items()}


@contextlib.contextmanager
def compute_context(job: Job) -> Iterator[None]:
    """What a training forward runs under: autocast to the compute dtype (bf16 for fp8 too),
    and for fp8 the backend's own context (Transformer Engine's `fp8_autocast`)."""
    with contextlib.ExitStack() as stack:
        dtype = job.plan.precision.autocast_dtype
        if dtype:
            stack.enter_context(torch.autocast(job.device.type, dtype=dtype))
        if job.fp8 is not None:
            stack.enter_context(job.fp8.autocast())
        yield


def forward_backward(job: Job, tokens: torch.Tensor, labels: torch.Tensor,
                     extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Accumulate this rank's gradients for one global batch; return the global mean loss.
    `extra`: the objective's per-row keyword inputs for every stage (`Objective.split_batch`)."""
    g = job.groups
    docs = document_ids(tokens, job.eod_id) if job.eod_id is not None else None
    begin_moe_step(job)  # Mixture-of-Experts: router-loss gradient scale, statistics
    if job.schedule is not None:
        with compute_context(job):
            loss = pipeline.pipeline_step(job.schedule, job.stages, g, tokens, labels,
                                          document_ids=docs, extra=extra)
        loss = pipeline.broadcast_loss(loss, job.plan.layout, g)
    else:
        model, n_mb = job.stages[0], job.plan.schedule.micro_batches
        loss = torch.zeros((), device=job.device)
        doc_chunks = [None] * n_mb if docs is None else docs.chunk(n_mb)
        extra_chunks = _chunk_rows(extra, n_mb)
        for mb_tokens, mb_labels, mb_docs, mb_extra in zip(tokens.chunk(n_mb), labels.chunk(n_mb),
                                                           doc_chunks, extra_chunks):
            kw = {} if mb_docs is None else {"document_ids": mb_docs}
            kw.update(mb_extra)
            if job.dynamic_cp is not None:  # this rank's sequences of the micro-batch
                mb_tokens, mb_labels, kw = job.dynamic_cp.model_inputs(mb_tokens, mb_labels,
                                                                       mb_docs)
            with compute_context(job):
                mb_loss = model(mb_tokens, labels=mb_labels, **kw) / n_mb
            (job.scaler.scale(mb_loss) if job.scaler else mb_loss).backward()
            loss += mb_loss.detach().float()
    if job.step_clock is not None:
        job.step_clock.synced()
    pipeline.sync_sequence_parallel_grads(job.stages, g)
    pipeline.sync_kv_replica_grads(job.stages, g)
    if job.embedding_sync is not None:
        job.embedding_sync()
    else:
        pipeline.sync_tied_embedding_grads(job.stages, g)
    allreduce_gradients(job.stages, g)
    if g.dp_group is not None:
        loss = loss.clone()
        dist.all_reduce(loss, group=g.dp_group)
        loss /= g.dp_size
    return loss


def _chunk_rows(extra: dict[str, torch.Tensor] | None, n: int) -> list[dict[str, torch.Tensor]]:
    """`n` micro-batches of the per-row tensors `extra` (n empty dicts without them)."""
    if not extra:
        return [{} for _ in range(n)]
    parts = {k: v.chunk(n) for k, v in extra.items()}
    return [{k: parts[k][i] for k in extra} for i in range(n)]


def train_step(job: Job, step: int, tokens: torch.Tensor, labels: torch.Tensor,
               extra: dict[str, torch.Tensor] | None = None, *, batch: int | None = None
               ) -> dict:
    """One optimizer step; returns the metrics of the step. `batch`: the global batch index
    the inputs are (default `step`; only the NaN test hook of `bad_steps` looks at it).

    `loss` and `grad_norm` are 0-d float32 tensors on the job's device, so a dense step never
    waits for the device: read them at logging steps (`metrics.StepWindow` reads a whole
    window's at once). A step whose loss or gradient norm is not finite applies no update
    (`bad_steps.step_unless_bad`); `bad_step` is that verdict, a 0-d bool device tensor.
    `lr` is a float; a Mixture-of-Experts model's router metrics are floats read after a
    collective, so an MoE step does wait. Under fp16 the GradScaler's inf check
    (`scaler.step`, which skips overflowing steps itself; only a non-finite loss counts as
    bad) reads a device flag each step."""
    lr = learning_rate(step, job.plan.optimizer)
    for group in job.optimizer.param_groups:
        group["lr"] = lr
    job.optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(job, tokens, labels, extra)
    if bad_steps.TEST_NAN_BATCH is not None and bad_steps.TEST_NAN_BATCH == (
            step if batch is None else batch):
        bad_steps.poison_gradients(job.stages)
    if job.fp8 is not None:
        job.fp8.step_end()  # delayed scaling: this step's amaxes set the next step's scales
    if job.scaler is not None:
        job.scaler.unscale_(job.optimizer)
    grad_norm = clip_gradients(job.stages, job.plan.optimizer.clip_grad)
    # Under fp16 an infinite norm is the loss scaler's overflow, which it skips and counts.
    ok = bad_steps.step_finite(loss, loss if job.scaler is not None else grad_norm)
    if job.scaler is not None:
        job.scaler.step(job.optimizer)
        job.scaler.update()
    else:
        bad_steps.step_unless_bad(job.optimizer, ok)
    return {"loss": loss.detach(), "lr": lr, "grad_norm": grad_norm, "bad_step": ~ok,
            **end_moe_step(job)}


@torch.no_grad()
def evaluate_loss(job: Job, dataset, batches: int) -> float:
    """Mean validation loss over `batches` global batches (every rank gets the same number)."""
    if dataset is None or batches <= 0:
        return float("nan")
    for m in job.stages:
        m.eval()
    total = 0.0
    for b in range(batches):
        tokens, labels, extra = job.objective.split_batch(
            local_rows(dataset, b, job.plan.data, job.groups, job.device))
        total += float(_eval_batch(job, tokens, labels, extra))
    for m in job.stages:
        m.train()
    return total / batches


def _eval_batch(job: Job, tokens: torch.Tensor, labels: torch.Tensor,
                extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    g, layout = job.groups, job.plan.layout
    kw = {} if job.eod_id is None else {"document_ids": document_ids(tokens, job.eod_id)}
    kw.update(extra or {})
    if job.schedule is not None and job.objective.pipeline_eval_loss is not None:
        loss = job.objective.pipeline_eval_loss(job.schedule, job.stages, tokens, labels, kw)
        loss = pipeline.broadcast_loss(loss, layout, g)
    elif job.schedule is not None:
        loss = pipeline_forward(job.stages, g, tokens, labels=labels, **kw)
        loss = pipeline.broadcast_loss(loss, layout, g)
    else:
        loss = job.stages[0](tokens, labels=labels, **kw).float()
    if g.dp_group is not None:
        loss = loss.clone()
        dist.all_reduce(loss, group=g.dp_group)
        loss /= g.dp_size
    return loss


class _StopFlag:
    """SIGTERM / SIGINT set a flag; the loop saves and exits at the next step that asks."""

    def __init__(self) -> None:
        self.raised = False
        self.signum = 0  # the last signal received (0: none)
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.raised, self.signum = True, signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def agreed(self, device: torch.device) -> int:
        """The signal number on every rank if any rank was signalled (so all ranks stop at the
        same step; the highest number if ranks got different ones), else 0."""
        if not dist.is_initialized():
            return self.signum
        flag = torch.tensor(float(self.signum), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)


def pretrain(cfg: PretrainConfig, *, fill_pipeline: bool = False) -> dict[str, Any]:
    """Run (or resume) pretraining as configured; returns the run summary on every rank.
    `fill_pipeline`: the user wrote no micro-batches (`run_plan.resolve_micro_batches`)."""
    # Inputs and output first: a bad path fails in a second, not after the model is built.
    plan, device = plan_for_world(
        cfg, fill_pipeline=fill_pipeline,
        prepare=lambda plan: plan.with_model(_data_model(plan, cfg.model_fields_set)))
    check_output(plan.loop.output)
    loop = plan.loop
    monitor = bad_steps.BadStepMonitor(loop.bad_step_policy, loop.max_bad_steps,
                                       loop.loss_spike_factor, loop.loss_spike_window)
    skipped = bad_steps.DataWindows.parse(cfg.data.skip_data_steps)
    latest = latest_checkpoint(plan.loop.output)
    resume_from = claim_run_dir(
        plan.loop.output, resume=plan.loop.resume, overwrite=plan.loop.overwrite, latest=latest,
        saved_config=read_training_record(latest).get("config") if latest else None,
        config=plan.record)
    job = setup(plan, device)
    if dist.is_initialized():
        dist.barrier()  # every rank has looked at the output directory before rank 0 writes there
    run, data = plan.run, plan.data
    train_ds, valid_ds = _datasets(plan)
    start = 0
    if resume_from is not None:
        record = load_training_checkpoint(resume_from, job.stages, job.optimizer, fp8=job.fp8,
                                          verify=False)  # `latest` verified it
        start = record["step"]
        skipped.merge(bad_steps.DataWindows.from_record(record.get("skipped_batches")))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    flops = model_flops_per_token(plan.model, data.seq_len)
    peak, peak_source = resolve_peak(run.peak_tflops, job.device, plan.precision.matmul_dtype)
    if rank0:
        precision = plan.precision.name if job.fp8 is None else job.fp8.describe()
        print(run_banner(plan, job.groups, train_ds, job.device, precision, peak, peak_source,
                         start_step=start), flush=True)
    log = MetricsLogger(loop, enabled=rank0, total=run.steps, initial=start,
                        resumed_from=resume_from)
    losses: list[float] = []
    step, stopped, rollbacks = start, 0, []
    tokenizer = data.tokenizer or None
    window = StepWindow()  # the steps since the last logging step, read there at once
    saver = CheckpointSaver(loop.output, keep_last=loop.keep_last, asynchronous=loop.async_save,
                            device=job.device)
    job.step_clock = StepClock()
    # A step whose collective times out raises RankHang naming the ranks that did not answer.
    with _StopFlag() as stop, StepWatchdog(loop.collective_timeout_s, completed=start) as watchdog:
        while step < run.steps:
            with job.step_clock.step(), watchdog.step(step + 1):
                # The dataset holds `steps` batches: a run that skipped some wraps to its first.
                batch = skipped.batch(step) % run.steps
                tokens, labels, extra = job.objective.split_batch(
                    local_rows(train_ds, batch, data, job.groups, job.device))
                window.add(step + 1, train_step(job, step, tokens, labels, extra, batch=batch))
            step += 1
            kill_if_asked(step)
            evaluate = bool(loop.eval_interval and step % loop.eval_interval == 0
                            and step < run.steps)
            save_due = step == run.steps or bool(loop.save_interval
                                                 and step % loop.save_interval == 0)
            boundary = log.due(step) or evaluate or save_due
            # The stop flag is a collective under torch.distributed: every rank asks at the
            # same steps, the window's ends; alone it costs nothing and is asked every step.
            if boundary or not dist.is_initialized():
                stopped = stop.agreed(job.device)
            if not (boundary or stopped):
                continue
            rows, elapsed = window.resolve()
            if log.due(step) and dist.is_initialized():  # every rank logs at the same steps
                rows[-1].update(slowest_rank(job.step_clock.take(), job.device))
            verdict = monitor.check(rows)  # `stop`: raises, naming the step
            losses.extend(row["loss"] for row in rows)
            tokens_per_s = len(rows) * data.global_batch * data.seq_len / elapsed
            tflops = flops * tokens_per_s / plan.layout.world_size / 1e12
            for row in rows:  # the window's mean rate on each of its steps
                row.update(tokens_per_s=tokens_per_s, tflops=tflops,
                           mfu=tflops / peak if peak else float("nan"),
                           memory_gb=memory_gb(job.device))
            if evaluate:
                rows[-1]["valid_loss"] = evaluate_loss(job, valid_ds, loop.eval_batches)
            for row in rows:
                log.step(row)
                if row["bad_step"]:
                    log.write(f"step {row['step']}: loss {row['loss']}, grad norm "
                              f"{row['grad_norm']}; its update was skipped")
            published = saver.poll()  # an asynchronous save that every rank has written
            if verdict is not None:
                log.write(f"bad steps at step {verdict.step}: {verdict.reason}")
            if verdict is not None and loop.bad_step_policy == "rollback":
                _log_saves(log, published + saver.finish())  # roll back to the newest save
                back = _roll_back(job, loop.output, skipped, step, verdict, rollbacks, log)
                del losses[back - start:]
                step = back
                monitor.reset()
                window.restart()
                continue  # nothing of the abandoned steps is evaluated or saved
            if save_due or stopped:
                published += saver.save(
                    job.stages, job.optimizer, step=step,
                    consumed_samples=step * data.global_batch, config=dict(plan.record),
                    tokenizer=tokenizer, fp8=job.fp8, skipped_batches=skipped.record())
            _log_saves(log, published)
            if stopped:
                break
            window.restart()
    _log_saves(log, saver.finish())  # the last save is in place before the run ends
    valid = evaluate_loss(job, valid_ds, loop.eval_batches) if not stopped else float("nan")
    summary = log.finish(losses=losses, valid_loss=valid, stopped=bool(stopped),
                         checkpoint=latest_checkpoint(loop.output, verify=False),
                         peak_tflops=peak, peak_source=peak_source,
                         extra={"skipped_steps": monitor.skipped, "rollbacks": len(rollbacks),
                                "skipped_batches": skipped.record()})
    summary["stop_signal"] = stopped  # the CLI exits 128 + it, as shells and schedulers expect
    return summary


# Rolling back to one checkpoint more often than this means the trouble is not in the data.
MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 3


def _roll_back(job: Job, output: str, skipped: bad_steps.DataWindows, step: int,
               verdict: bad_steps.Verdict, rollbacks: list[int], log: MetricsLogger) -> int:
    """Reload the run's latest checkpoint into `job` (weights, optimizer, RNG, FP8 state) and
    add the batches of the steps since it, up to `step`, to `skipped`; return the checkpoint's
    step. `rollbacks` (the steps rolled back to so far) gains it."""
    path = latest_checkpoint(output)
    if path is None:
        raise FloatingPointError(
            f"step {verdict.step}: {verdict.reason}; --bad-step-policy rollback found no "
            f"checkpoint in {output} to roll back to: save earlier (--save-interval)")
    back = read_training_record(path)["step"]
    if rollbacks.count(back) >= MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
        raise FloatingPointError(
            f"step {verdict.step}: {verdict.reason}; the run already rolled back to step {back} "
            f"{MAX_ROLLBACKS_TO_ONE_CHECKPOINT} times, so skipping data does not help: lower "
            "--lr or use --precision fp32")
    load_training_checkpoint(path, job.stages, job.optimizer, fp8=job.fp8,
                             verify=False)  # `latest` verified it
    first, last = skipped.batch(back), skipped.batch(step - 1)
    skipped.skip(first, last + 1)
    rollbacks.append(back)
    log.write(f"rolled back to {path} (step {back}); the batches of steps {first + 1}-{last + 1}"
              " (numbered as in a run that skips nothing) are skipped from now on, as "
              f"--skip-data-steps {first + 1}-{last + 1} would skip them")
    return back


def _log_saves(log: MetricsLogger, reports: list[SaveReport]) -> None:
    for report in reports:
        log.saved(report.path, report.step)
        log.write(f"  {report.describe()}")


def check_output(output: str) -> None:
    """The run directory must exist or be creatable, and be writable (checkpoints go there)."""
    path = Path(output)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write to the output directory {path} ({exc.strerror or exc}); "
                          "choose another --output") from exc


def _data_model(plan: RunPlan, fields_set: frozenset[str]) -> ModelConfig:
    """The plan's model with the vocabulary the data decides, after checking that the data
    opens and matches the tokenizer if one is given: the vocabulary follows the tokenizer
    (or, without one, the vocabulary the data was made with) unless the user set `vocab_size`
    (`fields_set`), and then the two must agree."""
    from tessera.core.tokenizer import load_tokenizer
    from tessera.training.gpt_dataset import parse_data_args
    from tessera.training.indexed_dataset import IndexedDataset

    data, model = plan.data, plan.model
    if not data.data:
        raise ConfigError("no training data: pass --data PREFIX (made by `tessera preprocess`) "
                          "or run `tessera pretrain` with no arguments for the demo")
    check_objective(plan)  # what the model's family cannot do, before anything is read
    if data.isolate_documents and not data.tokenizer:
        raise ConfigError("--isolate-documents finds document ends by the EOD id, which comes "
                          "from the tokenizer: pass --tokenizer (the one the data was made with)")
    with _as_config_error():
        tokenizer = load_tokenizer(data.tokenizer) if data.tokenizer else None
        sizes = {}
        for _, prefix in parse_data_args(list(data.data)):
            indexed = IndexedDataset(prefix)
            if tokenizer is not None:
                indexed.check_vocab(tokenizer)
            sizes[prefix] = indexed.vocab_size
    if tokenizer is not None:
        vocab, source = tokenizer.vocab_size, f"the tokenizer {data.tokenizer}"
    else:
        source, vocab = max(sizes.items(), key=lambda item: item[1])
        source = f"the data {source}"
    with _as_config_error():  # BERT appends its special tokens after the data's vocabulary
        set_vocab = model.vocab_size if "vocab_size" in fields_set else None
        vocab = objective_for(model).model_vocab(vocab, set_vocab)
    if "vocab_size" not in fields_set:
        return dataclasses.replace(model, vocab_size=vocab)
    # Without a tokenizer a larger vocabulary than the data's stays allowed (as it always was).
    if model.vocab_size < vocab or (tokenizer is not None and model.vocab_size != vocab):
        raise ConfigError(f"the model's vocab_size is set to {model.vocab_size} but {source} "
                          f"has a vocabulary of {vocab}: set vocab_size={vocab}, or leave "
                          "vocab_size out of --model-overrides and the YAML model section so "
                          "that it follows")
    return model


def _datasets(plan: RunPlan) -> tuple[Any, Any]:
    """The train and validation datasets, sized for the whole run, as the objective makes
    them (GPT: `gpt_dataset.build_datasets`)."""
    with _as_config_error():
        return objective_for(plan.model).datasets(plan)


@contextlib.contextmanager
def _as_config_error() -> Iterator[None]:
    """The data readers' ValueError / OSError (missing, corrupt or foreign files) as a
    ConfigError with the same message, so the CLI reports it without a traceback."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from exc


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
