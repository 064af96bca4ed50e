"""The modes of `tessera plan` once its arguments parse: plan training (and optionally measure
the candidates and write the best as a run config), plan serving, or calibrate this CPU or
this GPU.

Each mode raises `PlanError` / `ConfigError` (both ValueErrors) for bad input; the CLI prints
them and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tessera.plan import Fixed, Hardware, PlanError, TrainingJob, explain, load_hardware


def run(args: argparse.Namespace) -> int:
    from tessera.plan.flag_checks import check_flags

    check_flags(args)
    if args.calibrate:
        return _calibrate(args)
    if args.serve:
        return _serve(args)
    return _train(args)


def _calibrate(args: argparse.Namespace) -> int:
    """`--calibrate`: this CPU for `--gpu cpu`, or with `--device cuda` this GPU as a
    profile for `--gpu PATH.json`."""
    if args.device == "cuda":
        from tessera.plan.calibrate_gpu import calibrate_device, default_gpu_profile_path

        path = Path(args.calibration_file) if args.calibration_file else None
        calibrate_device(path or default_gpu_profile_path(), "cuda")
        return 0
    from tessera.plan.calibrate import calibrate

    calibrate(_calibration_path(args))
    import torch

    if args.device is None and torch.cuda.is_available():
        print("tessera plan: this calibrated the CPU (for --gpu cpu); to measure this "
              "machine's GPU add --device cuda", file=sys.stderr)
    return 0


def _calibration_path(args: argparse.Namespace) -> Path:
    from tessera.plan.calibrate import default_path

    return Path(args.calibration_file) if args.calibration_file else default_path()


def _model(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The ModelConfig and the fields the user overrode (for the run config's `model:`)."""
    from tessera.core.presets import model_from_spec

    model, fields_set = model_from_spec(None, args.model, args.model_overrides)
    return model, {k: getattr(model, k) for k in sorted(fields_set)}


def _hardware(args: argparse.Namespace, ranks_per_node: int) -> Hardware:
    """The `--gpu` profile. For `cpu`: this machine's calibration (made now if the default
    file is missing; a `--calibration-file` that does not exist is refused, since a mistyped
    path should not cost a calibration and leave a file there), its memory shared by the
    ranks on it, and its GEMM rate, memory bandwidth (the memory-bound ops run on the same
    cores) and fixed per-op costs shared when there are more ranks than cores (the
    calibration is one rank on one core)."""
    if args.gpu != "cpu":
        return load_hardware(args.gpu)
    path = _calibration_path(args)
    if not path.is_file() and args.calibration_file:
        raise PlanError(f"--calibration-file {path} does not exist: make it with `tessera plan "
                        f"--calibrate --calibration-file {path}`, or leave the flag out to use "
                        "the default calibration (measured on first use)")
    if not path.is_file():
        from tessera.plan.calibrate import calibrate

        print(f"tessera plan: no calibration of this CPU at {path}; measuring it now "
              "(once, about 15 s)", file=sys.stderr)
        calibrate(path)
    hw = load_hardware("cpu", path)
    cores = int(json.loads(path.read_text()).get("cores", ranks_per_node))
    share = min(1.0, cores / ranks_per_node)
    return dataclasses.replace(
        hw, memory_gib=hw.memory_gib / ranks_per_node,
        peak_tflops={k: v * share for k, v in hw.peak_tflops.items()},
        memory_gbps=hw.memory_gbps * share,
        layer_overhead_us=hw.layer_overhead_us / share,
        microbatch_overhead_us=hw.microbatch_overhead_us / share,
        loss_ns_per_logit=hw.loss_ns_per_logit / share)


def _train(args: argparse.Namespace) -> int:
    from tessera.plan import plan_training
    from tessera.plan.report import plan_json, plan_text
    from tessera.plan.search import within_model_error

    missing = [f for f, v in (("--global-batch", args.global_batch), ("--seq-len", args.seq_len))
               if v is None]
    gpus = args.gpus or (args.nproc_per_node if args.measure else None)
    if gpus is None:
        missing.append("--gpus")
    if missing:
        raise PlanError(f"planning training needs {' and '.join(missing)} (see tessera plan "
                        "--help)")
    if args.measure and args.nproc_per_node and gpus != args.nproc_per_node:
        raise PlanError(f"--measure runs the candidates on this machine: --gpus ({gpus}) must "
                        f"equal --nproc-per-node ({args.nproc_per_node}), or be left out")
    per_node = args.gpus_per_node or (gpus if args.gpu == "cpu" else 8)
    model, model_fields = _model(args)
    from tessera.plan.flag_checks import check_recompute_layers
    from tessera.plan.models.registry import plan_family

    refused = plan_family(model).mode_problems(model, measure=args.measure)
    if refused:
        raise PlanError("; ".join(refused))
    check_recompute_layers(args, model.num_layers)
    hw = _hardware(args, min(gpus, per_node))
    precision = args.precision or ("fp32" if args.gpu == "cpu" else "bf16")
    # CPU ranks run Tessera's own loop, which averages the gradients after the backward
    # (`core.parallel.grad_buckets.average_gradients`), and on the cores the backward runs on.
    job = TrainingJob(model, gpus=gpus, hardware=hw, global_batch=args.global_batch,
                      seq_len=args.seq_len, gpus_per_node=per_node, tokens=args.tokens,
                      precision=precision, overlap_grad_reduce=args.gpu != "cpu")
    fixed = Fixed(tp=args.tp, pp=args.pp, virtual_stages=args.virtual_stages, cp=args.cp,
                  ep=args.ep, etp=args.etp, micro_batch=args.micro_batch,
                  sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                  recompute_layers=args.recompute_layers)  # alone, Fixed reads it as full
    fitting = plan_training(job, fixed)
    shown = fitting[:args.top]
    why = explain(shown[0], shown[1]) if len(shown) > 1 else None
    if args.output:
        _write_output(args, shown[0], model_fields, precision, gpus, hw.name)
    measured, rho = None, None
    if args.measure:
        measured, rho = _measure(args, shown, model, model_fields, precision, gpus)
    if args.json:
        print(json.dumps(plan_json(shown, measured, rho), indent=2))
        return 0
    header = (f"tessera plan: {model.name} on {gpus} x {hw.name} ({hw.memory_gib:.1f} GiB, "
              f"{per_node} per node), global batch {args.global_batch} x {args.seq_len} tokens, "
              f"{precision}")
    ties = sum(within_model_error(fitting[0], c) for c in fitting)
    print(plan_text(header, shown, len(fitting), why, args.tokens, ties, args.gpu == "cpu",
                    measuring=measured is not None))
    if measured is not None:
        from tessera.plan.calibrate import cpu_cores, cpu_isa

        where = (f"{gpus} CPU ranks on {cpu_cores()} cores ({cpu_isa()})" if args.gpu == "cpu"
                 else f"{gpus} local GPUs")
        setting = (f"{where}, {args.measure_steps} steps each, the first "
                   f"{args.measure_warmup} left out, median step time")
        from tessera.plan.report import measured_text

        print("\n" + measured_text(shown, measured, rho, setting))
    if args.output:
        run = f"-m tessera pretrain --config {args.output} --data PREFIX"
        run += plan_family(model).launch_flags
        launch = (f"torchrun --nproc-per-node {gpus} {run}" if gpus <= per_node else
                  f"torchrun --nnodes {gpus // per_node} --nproc-per-node {per_node} {run}")
        print(f"\nwrote {args.output}; run it with\n  {launch}")
    return 0


def _run_config(args, candidate, model_fields, precision) -> dict[str, Any]:
    from tessera.plan.run_config import run_config

    return run_config(candidate.parallel_fields(), model=args.model, model_fields=model_fields,
                      global_batch=args.global_batch, seq_len=args.seq_len,
                      precision=precision, tokens=args.tokens)


def _write_output(args, best, model_fields, precision, gpus, hardware_name: str) -> None:
    from tessera.plan.report import figure
    from tessera.plan.run_config import write_run_config

    config = _run_config(args, best, model_fields, precision)
    header = (f"Planned by `tessera plan` for {gpus} x {hardware_name}: {best.layout}, "
              f"micro-batch {best.micro_batch}, recompute {best.recompute};\npredicted "
              f"{best.memory_gib:.1f} GiB per GPU, {figure(best.step_time_s)} s per step, "
              f"{figure(best.tflops_per_gpu, 1000)} TFLOP/s per GPU.\nAdd the data: tessera pretrain "
              f"--config {Path(args.output).name} --data PREFIX --tokenizer TOKENIZER")
    path = Path(args.output)
    if path.is_dir():
        raise PlanError(f"--output {path} is a directory; give the YAML file to write, e.g. "
                        f"--output {path / 'run.yaml'}")
    try:
        write_run_config(path, config, gpus, header)
    except OSError as exc:  # a read-only or full disk: say so, as for any other bad input
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        raise PlanError(f"cannot write --output {path}: {exc.strerror or exc}{where}") from None


def _local_gpus() -> int:
    """CUDA devices on this machine (imports torch: only `--measure` on GPUs asks)."""
    import torch

    return torch.cuda.device_count()


def _measure(args, shown, model, model_fields, precision, gpus):
    """Run each shown candidate for a few steps on `gpus` local ranks; (measurements, rho)."""
    from tessera.core.config import ConfigError
    from tessera.plan.measure import Measurement, measure_all, spearman, synthetic_data

    steps = args.measure_steps
    if args.measure_warmup >= steps:
        raise PlanError(f"--measure-warmup ({args.measure_warmup}) must be below "
                        f"--measure-steps ({steps})")
    if args.gpu != "cpu" and _local_gpus() < gpus:
        raise PlanError(f"--measure --gpu {args.gpu} runs {gpus} ranks on this machine's GPUs, "
                        f"but it has {_local_gpus()}; measure with --gpu cpu (gloo ranks on "
                        f"this CPU), or run it on a machine with {gpus} GPUs")
    # A candidate `tessera pretrain` cannot express (cp or ep > 1 for now) is reported as
    # failed, like one that fails while running; the others still run.
    configs: dict[int, dict[str, Any]] = {}
    measured: list[Measurement | None] = []
    for i, c in enumerate(shown):
        try:
            configs[i] = _run_config(args, c, model_fields, precision)
            measured.append(None)
        except ConfigError as exc:
            measured.append(Measurement(False, error=str(exc)))
    labels = [f"{c.layout}, micro-batch {c.micro_batch}, recompute {c.recompute}"
              for i, c in enumerate(shown) if i in configs]
    with tempfile.TemporaryDirectory(prefix="tessera-plan-measure-") as tmp:
        tokens = steps * args.global_batch * (args.seq_len + 1) + 4096
        data = synthetic_data(Path(tmp), model.vocab_size, tokens)
        device = "cpu" if args.gpu == "cpu" else "cuda"
        ran = iter(measure_all(list(configs.values()), Path(tmp), data, nproc=gpus,
                               steps=steps, warmup=args.measure_warmup, device=device,
                               labels=labels) if configs else [])
    measured = [m if m is not None else next(ran) for m in measured]
    ok = [i for i, m in enumerate(measured) if m.ok]
    rho = spearman([shown[i].step_time_s for i in ok], [measured[i].step_time_s for i in ok])
    return measured, rho


def _serve(args: argparse.Namespace) -> int:
    from tessera.plan import plan_serving
    from tessera.plan.report import serving_json, serving_text

    if args.gpus is None:
        raise PlanError("planning serving needs --gpus (see tessera plan --help)")
    model, _ = _model(args)
    per_node = args.gpus_per_node or (args.gpus if args.gpu == "cpu" else 8)
    hw = _hardware(args, min(args.gpus, per_node))
    plan = plan_serving(model, args.gpus, hw, precision=args.precision or "bf16",
                        batch=args.concurrency or 1, context=args.context,
                        gpus_per_node=per_node, max_latency_ms=args.max_latency_ms,
                        min_throughput=args.min_throughput, tp=args.tp, pp=args.pp)
    if args.json:
        print(json.dumps(serving_json(plan), indent=2))
    else:
        print(serving_text(plan, args.top))
    return 0 if plan.fits else 2  # as for a training job that nothing fits
