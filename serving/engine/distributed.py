"""Tensor- and pipeline-parallel serving: rank 0 schedules and samples, every rank computes.

Rank 0 runs the engine (and the HTTP server); every other rank runs `worker_loop`. Each forward
pass of a step goes, over the default process group:

1. Header: an int64 tensor `[command, stop_vote, B, T, N, W, 0, 0]`, all-reduced with MAX
   (W: the width of the block tables of a paged cache, 0 for slots).
   Rank 0 fills the command and the sizes, every rank its stop vote, so one collective both
   announces the step and tells every rank whether any rank wants to stop. Commands: `STEP`,
   `IDLE` (a heartbeat about once a second while nothing runs, so workers wake up to notice
   signals and never wait long enough to hit the collective timeout) and `STOP`.
2. Body (`STEP` only): token ids, positions, slots (or block tables), task indices and kept
   positions, broadcast from rank 0 as one int64 tensor.
3. Every rank runs its stages (`pipeline_forward` with point-to-point sends when pp > 1); the
   last stage gathers the logits over tp inside the model, and its tp rank 0 sends the kept
   rows `(N, vocab)` fp32 to rank 0, which samples.

LoRA adapters (`serving.engine.adapters`): each rank holds its pieces of every adapter in the same
slot. A load or unload asked for while serving (`DistributedExecutor.change_adapters`, from any
thread) is applied by the engine thread before its next step or heartbeat: header `ADAPTERS`,
then the operation broadcast as an object, applied so that every rank ends in the same state
(a load: the workers first, then rank 0, rolled back everywhere if any rank fails; an unload:
rank 0 first, where the requests that use the adapter are known, then the workers).

SIGTERM or SIGINT on a worker sets its stop vote; on rank 0 uvicorn turns them into a shutdown
that ends in `LLMEngine.shutdown()`, which sends `STOP`. Either way every rank leaves cleanly.

Any checkpoint serves under any layout: the stages are built empty for the serving layout
(`build_stages(init=False)`) and filled by `load_weights`, which re-slices whatever was saved.
"""

from __future__ import annotations

import queue
import signal
import sys
from collections.abc import Mapping
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.core.checkpoint import dtype_from_name, load_weights, read_manifest
from tessera.core.config import ConfigError, Layout
from tessera.core.lora_format import AdapterError
from tessera.core.models.decoder.model import GPTModel
from tessera.core.parallel.groups import ParallelGroups, init_groups, rank_of
from tessera.core.parallel.launch import init_distributed
from tessera.core.parallel.pipeline import build_stages
from tessera.core.parallel.sharding import last_stage_pp_rank
from tessera.serving.engine.adapters import LoRAServing
from tessera.serving.engine.executor import LocalExecutor, StopServing
from tessera.serving.engine.kv_config import KVCacheConfig, resolve_num_blocks
from tessera.serving.engine.runner import ModelRunner, RunnerOutput, StepBatch
from tessera.serving.engine.scheduler import StepPlan

STEP, IDLE, STOP = 1, 2, 3
ADAPTERS = 4  # load or unload a LoRA adapter on every rank (`_Channel.adapter_op`)
_HEADER = 8
_TIMEOUT = timedelta(minutes=30)  # a single collective; idle ranks hear a heartbeat every second


def serving_layout(tp: int = 1, pp: int = 1) -> Layout:
    """The layout a server runs: tp x pp ranks, one stage per pipeline rank, no data parallel."""
    return Layout(tp=tp, pp=pp)


def init_serving(tp: int = 1, pp: int = 1,
                 device: torch.device | str = "cpu") -> tuple[Layout, ParallelGroups]:
    """Join the torchrun world when there is one and build the serving layout's groups.

    With more than one rank and tp = pp = 1, tp takes the whole world. Collective.
    """
    init_distributed(torch.device(device), timeout=_TIMEOUT)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp * pp == 1 and world > 1:
        tp = world
    if tp * pp != world:
        raise ConfigError(f"serving layout tp {tp} x pp {pp} = {tp * pp} ranks, but the world has "
                          f"{world}; launch tp x pp processes (e.g. --nproc-per-node {tp * pp})")
    layout = serving_layout(tp, pp)
    return layout, init_groups(layout)


def load_stages(path: str | Path, layout: Layout, groups: ParallelGroups, *,
                dtype: torch.dtype | str | None = None,
                device: torch.device | str = "cpu") -> list[GPTModel]:
    """This rank's stages of the checkpoint at `path` under `layout`, whatever its own layout."""
    manifest = read_manifest(path)
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    dtype = dtype or dtype_from_name(manifest.dtype)  # FP8 checkpoints: their compute dtype
    stages = build_stages(manifest.model, layout, groups, device=device, dtype=dtype,
                          init=False)
    load_weights(stages, path)
    return [m.eval() for m in stages]


class _Channel:
    """The step protocol's collectives, the same on every rank."""

    def __init__(self, runner: ModelRunner, layout: Layout):
        self.runner, self.device = runner, runner.device
        self.rank = dist.get_rank()
        # tp rank 0 of the pipeline rank holding the last stage
        self.logits_from = rank_of(0, 0, last_stage_pp_rank(layout), layout)
        self.vocab = runner.config.vocab_size

    def header(self, command: int = 0, sizes: tuple[int, ...] = (0, 0, 0, 0),
               vote: bool = False) -> list[int]:
        values = [command, int(vote), *sizes] + [0] * (_HEADER - 2 - len(sizes))
        h = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(h, op=dist.ReduceOp.MAX)
        return h.tolist()

    def send_batch(self, batch: StepBatch) -> None:
        # Each row's LoRA adapter slot travels too (-1 for none: serving.engine.adapters).
        adapters = batch.adapters if batch.adapters is not None else torch.full_like(batch.tasks, -1)
        body = torch.cat([batch.ids.flatten(), batch.positions.flatten(), batch.slots.flatten(),
                          batch.tasks, batch.keep, adapters.to(batch.tasks.device)]).to(self.device)
        dist.broadcast(body, src=0)

    def recv_batch(self, B: int, T: int, N: int, W: int = 0) -> StepBatch:
        """W: block-table width (paged cache), 0 for one slot per row."""
        S = B * max(W, 1)
        body = torch.empty(2 * B * T + S + 2 * B + N, dtype=torch.long, device=self.device)
        dist.broadcast(body, src=0)
        ids, positions, slots, tasks, keep, adapters = body.split([B * T, B * T, S, B, N, B])
        return StepBatch(ids.view(B, T), positions.view(B, T), slots.view(B, W) if W else slots,
                         tasks, keep, adapters if bool((adapters >= 0).any()) else None)

    def adapter_op(self, request: tuple[str, str, str | None] | None = None
                   ) -> Exception | None:
        """Every rank: apply rank 0's `(op, name, path)` ("load" or "unload") to this rank's
        adapter registry, the same outcome on every rank (module docstring). On rank 0,
        returns what failed (the registry's error, or an `AdapterError` naming a worker's);
        only a failed collective raises."""
        box: list[Any] = [request]
        dist.broadcast_object_list(box, src=0)
        op, name, path = box[0]
        registry = self.runner.adapters

        def attempt(fn) -> Exception | None:
            try:
                if registry is None:
                    raise AdapterError("this rank serves no LoRA adapters")
                fn()
                return None
            except Exception as exc:  # reported to rank 0, the same on every rank
                return exc

        def load() -> None:
            registry.load(name, path)

        def unload() -> None:
            registry.unload(name)

        mine: Exception | None = None
        if op == "load":  # workers first: rank 0 makes the name visible to requests last
            if self.rank != 0:
                mine = attempt(load)
            errors: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, None if mine is None else f"{mine}")
            failed = next((f"rank {i}: {e}" for i, e in enumerate(errors) if e), None)
            if failed is None and self.rank == 0:
                mine = attempt(load)
            outcome = [failed or (None if mine is None else f"{mine}")]
            dist.broadcast_object_list(outcome, src=0)
            if outcome[0] is not None and self.rank != 0 and mine is None:
                registry.unload(name)  # roll back: some rank could not load it
            if self.rank == 0 and outcome[0] is not None:
                return mine if mine is not None else AdapterError(
                    f"adapter {name!r} could not be loaded on every rank ({outcome[0]}); "
                    "the path must be readable on each rank's machine")
            return None
        if self.rank == 0:  # unload: rank 0 knows which requests use it
            mine = attempt(unload)
        outcome = [None if mine is None else f"{mine}"]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is None and self.rank != 0:
            registry.unload(name)
        return mine

    def logits_to_rank0(self, logits: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """Rank 0 gets the kept logits from the last stage (a no-op when it holds it)."""
        if self.logits_from == 0:
            return logits
        if n == 0:  # a prefill chunk that samples nothing: no message at all
            return torch.empty(0, self.vocab, device=self.device) if self.rank == 0 else None
        if self.rank == self.logits_from:
            dist.send(logits.contiguous(), dst=0)
            return None
        if self.rank == 0:
            out = torch.empty(n, self.vocab, dtype=torch.float32, device=self.device)
            dist.recv(out, src=self.logits_from)
            return out
        return None


class DistributedExecutor:
    """Rank 0's executor: announces each step, runs its own share, receives the logits."""

    def __init__(self, runner: ModelRunner, layout: Layout):
        if dist.get_rank() != 0:
            raise RuntimeError("DistributedExecutor runs on rank 0; other ranks run worker_loop")
        self.runner = runner
        self._channel = _Channel(runner, layout)
        self._stopped = False
        self.stop_requested = False  # set (e.g. by a signal handler) to stop every rank
        self._adapter_ops: queue.SimpleQueue = queue.SimpleQueue()

    def change_adapters(self, op: str, name: str, path: str | None = None) -> Future:
        """Thread-safe: ask every rank to "load" (from `path`) or "unload" adapter `name`; the
        engine thread applies it before its next step or heartbeat. The future's result is
        None, or it holds the error (`serving.engine.adapters`' kinds)."""
        done: Future = Future()
        self._adapter_ops.put((op, name, path, done))
        return done

    def _apply_adapter_ops(self) -> None:
        while not self._adapter_ops.empty():
            op, name, path, done = self._adapter_ops.get()
            if self._stopped:
                done.set_exception(AdapterError("the serving ranks have stopped"))
                continue
            self._channel.header(ADAPTERS)
            error = self._channel.adapter_op((op, name, path))
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(None)

    def execute_model(self, plan: StepPlan, pad_id: int) -> RunnerOutput:
        return self.runner.execute_model(plan, pad_id, self.run)

    def run(self, batch: StepBatch) -> torch.Tensor:
        if self._stopped:
            raise StopServing("the serving ranks have stopped")
        batch = batch.to(self.runner.device)
        try:
            self._apply_adapter_ops()
            width = batch.slots.shape[1] if batch.slots.ndim == 2 else 0
            sizes = (batch.ids.shape[0], batch.ids.shape[1], batch.keep.numel(), width)
            _, vote, *_ = self._channel.header(STEP, sizes, self.stop_requested)
            if vote:
                self._stopped = True
                raise StopServing("a rank asked to stop")
            self._channel.send_batch(batch)
            logits = self._channel.logits_to_rank0(self.runner.forward(batch), sizes[2])
        except StopServing:
            raise
        except Exception as exc:  # the ranks are out of step now: nothing can continue
            self._stopped = True
            raise StopServing(f"a step failed across ranks: {type(exc).__name__}: {exc}") from exc
        return logits

    def heartbeat(self) -> bool:
        if self._stopped:
            return False
        try:
            self._apply_adapter_ops()
            _, vote, *_ = self._channel.header(IDLE, vote=self.stop_requested)
        except Exception as exc:
            self._stopped = True
            raise StopServing(f"heartbeat failed: {exc}") from exc
        if vote:
            self._stopped = True
        return not vote

    def close(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._channel.header(STOP)


def worker_loop(runner: ModelRunner, layout: Layout, *,
                handle_signals: bool = True) -> None:
    """Serve rank 0's steps until it sends STOP or any rank votes to stop.

    With `handle_signals`, SIGTERM and SIGINT set this rank's stop vote (main thread only).
    """
    channel = _Channel(runner, layout)
    stop = {"vote": False}
    if handle_signals:
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.update(vote=True))
        except ValueError:  # not the main thread: no handlers, rank 0 still stops us
            pass
    while True:
        command, vote, B, T, N, W, *_ = channel.header(vote=stop["vote"])
        if command == STOP or vote:
            return
        if command == IDLE:
            continue
        if command == ADAPTERS:
            channel.adapter_op()
            continue
        batch = channel.recv_batch(B, T, N, W)
        channel.logits_to_rank0(runner.forward(batch), N)


def start_rank(path: str | Path, *, tp: int = 1, pp: int = 1,
               dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               max_batch: int = 8, tasks: Mapping[str, torch.Tensor] | None = None,
               tokenizer: Any = "checkpoint", handle_signals: bool = True,
               quantize: str = "none", compile_decode: bool = False,
               kv: KVCacheConfig | None = None, lora: LoRAServing | None = None,
               **engine_kwargs: Any):
    """Every rank calls this. Rank 0 gets an `LLMEngine` over all ranks; every other rank serves
    steps until the engine shuts down, then gets None.

    `tasks` (prompt-tuned tables) must be given on every rank; `tokenizer` (rank 0) defaults to
    the checkpoint's; `quantize` ("int8", "fp8": `core.quantize`) applies to every rank's shards, and the
    logit error it causes is printed at start (`core.quantize_error`; not under pp);
    `compile_decode` (one process only) compiles the decode step (`serving.engine.compiled`);
    `kv` is the KV cache (`serving.engine.kv_config`; paged by default),
    with one block count for every rank (the smallest any rank's memory allows); `lora`
    serves per-request LoRA adapters (`serving.engine.adapters`; every rank loads its pieces of the
    adapters given at start, in the same slots);
    `engine_kwargs` go to `LLMEngine` on rank 0.
    """
    from tessera.core.quantize_error import quantize_measured
    from tessera.serving.engine import LLMEngine

    if compile_decode and tp * pp > 1:
        raise ValueError(f"a compiled decode step runs in one process; tp {tp} x pp {pp} "
                         "serves eagerly, so drop compile_decode / --compile (or serve with tp=1, pp=1)")
    layout, groups = init_serving(tp, pp, device)
    stages = load_stages(path, layout, groups, dtype=dtype, device=device)
    errors = [quantize_measured(stage, quantize) for stage in stages]
    if quantize != "none" and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"tessera serve: {errors[0].describe()}" if errors[0] else
              f"tessera serve: {quantize} weights (logit error not measured: a pipeline stage "
              "has no logits of its own)", file=sys.stderr, flush=True)
    if kv is None:
        kv = KVCacheConfig(kind="paged")
    if kv.kind == "paged":
        kv = _agree_on_blocks(kv, stages, groups, max_batch)
    runner = ModelRunner(stages, max_batch, tasks, compile_decode=compile_decode, kv=kv,
                         lora=lora)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        worker_loop(runner, layout, handle_signals=handle_signals)
        return None
    if tokenizer == "checkpoint":
        from tessera.core.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path) if read_manifest(path).tokenizer else None
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    executor = DistributedExecutor(runner, layout) if distributed else LocalExecutor(runner)
    engine_kwargs.setdefault("model_name", Path(path).name)
    return LLMEngine(executor, tokenizer, kv=kv, **engine_kwargs)


def _agree_on_blocks(kv: KVCacheConfig, stages: list[GPTModel], groups: ParallelGroups,
                     max_batch: int) -> KVCacheConfig:
    """`kv` with the pool's block count every rank can hold (each rank holds its own layers'
    blocks; a memory budget gives each rank its own count). Collective when distributed."""
    from dataclasses import replace

    from tessera.core.parallel.sharding import kv_geometry

    first = stages[0]
    c, param = first.config, next(first.parameters())
    entry = kv_geometry(c, groups.tp_size)
    blocks = resolve_num_blocks(
        kv, num_layers=sum(len(m.layer_ids) for m in stages), kv_heads=entry.heads,
        head_dim=entry.key_dim, dtype=param.dtype, device=param.device, max_batch=max_batch,
        max_seq=c.max_position_embeddings, value_dim=entry.value_dim)
    if dist.is_initialized() and dist.get_world_size() > 1:
        agreed = torch.tensor([blocks], dtype=torch.long, device=param.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        blocks = int(agreed)
    return replace(kv, num_blocks=blocks)
