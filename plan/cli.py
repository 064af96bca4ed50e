"""`tessera plan`: pick the parallel layout, micro-batch and recomputation before running.

Argument parsing and the dispatch to the four modes: plan (the analytic model's ranked
candidates, `tessera.plan.search`), `--serve`, `--calibrate` (`plan.calibrate`) and `--measure`
(`plan.measure`). `--help` imports no torch; the modes import what they need when they run.
"""

from __future__ import annotations

import argparse
import sys

from tessera.core.arg_types import non_negative_int, positive_float, positive_int, str2bool
from tessera.core.help import HelpFormatter

GPUS = ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu")

DESCRIPTION = """\
Plan a training run: enumerate every layout of the model on the cluster (tensor, pipeline, \
virtual-stage and data parallel sizes, micro-batch, sequence parallelism, activation \
recomputation), predict each one's memory per GPU and time per step from an analytic model \
(Korthikanti et al. 2022 for activation memory, Narayanan et al. 2021 for FLOPs and the \
pipeline bubble), drop those that do not fit, and rank the rest by predicted throughput. \
Answers in about a second, without a GPU.

Any of --tp --pp --virtual-stages --cp --ep --etp --micro-batch --sequence-parallel \
--recompute --recompute-layers fixes that dimension; fix them all to evaluate one configuration. \
--output writes the best candidate as a YAML config that `tessera pretrain --config` runs \
as is.

On this machine: --gpu cpu plans for CPU ranks from a calibration of this machine \
(--calibrate, about 15 s; done on first use), and --measure runs the planned candidates for \
a few real steps on --nproc-per-node local ranks and prints the measured ranking beside the \
predicted one. On a GPU machine, --calibrate --device cuda measures the GPU (GEMM and \
attention rates at training shapes, HBM bandwidth) and writes a profile for --gpu PATH.json."""

EPILOG = """\
examples:
  tessera plan --model llama3-8b --gpus 64 --gpu h100-80gb --global-batch 512 --seq-len 8192
  tessera plan --model llama3-8b --gpus 64 --gpu h100-80gb --global-batch 512 --seq-len 8192 \\
      --tokens 1e12 --top 10 --json
  tessera plan --model llama-1b --gpus 8 --gpu a100-80gb --global-batch 256 --seq-len 2048 \\
      --tp 2 --pp 1 --micro-batch 4 --recompute selective     # evaluate one configuration
  tessera plan --model llama-1b --gpus 8 --gpu a100-80gb --global-batch 256 --seq-len 2048 \\
      --output run.yaml && tessera pretrain --config run.yaml --data corpus
  tessera plan --serve --model nemotron4-15b --gpus 8 --gpu h100-80gb --precision fp8
  tessera plan --calibrate
  tessera plan --calibrate --device cuda --calibration-file h100.json && \
      tessera plan --model llama-1b --gpus 8 --gpu h100.json --global-batch 256 --seq-len 2048
  tessera plan --measure --nproc-per-node 4 --gpu cpu --model llama-tiny --global-batch 16 \\
      --seq-len 64

--json prints one object: {"candidates": [...], "training_days": D or null}, candidates best \
first, each with tp, pp, virtual_stages, dp, cp, ep, etp, micro_batch, sequence_parallel, \
recompute, recompute_layers, memory_gib (peak per GPU), step_time_s, tflops_per_gpu, mfu \
(and more), and within_model_error: true when #1 is predicted at most the model's error \
(6.5%, its worst on published runs) faster, too close for the model to rank (marked next \
to the rank in the table; true for #1). With --measure each candidate also has "measured": {ok, step_time_s, \
tokens_per_s, peak_memory_gib, step_times_s, error, cpu_share}, and the object has \
"spearman".

Exit codes: 0 done; 2 bad input or nothing fits (the message says what would)."""


def _gpu(text: str) -> str:
    """A profile name, or a JSON file holding a whole profile (a card the table lacks)."""
    if text in GPUS or text.endswith(".json"):
        return text
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from {', '.join(GPUS)}, or a hardware profile "
        "PATH.json that gives every field of tessera.plan.Hardware by name)")


def _count(text: str) -> float:
    """A count that may be written 1e12 or 300e9."""
    try:
        float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number (e.g. 300e9), got {text!r}") from None
    return positive_float(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera plan", formatter_class=HelpFormatter,
                                description=DESCRIPTION, epilog=EPILOG)
    job = p.add_argument_group("the job")
    job.add_argument("--model", metavar="PRESET", default="llama-demo",
                     help="model preset (`tessera models` lists them)")
    job.add_argument("--model-overrides", metavar="K=V", nargs="+", default=[],
                     help="ModelConfig fields, e.g. num_layers=48 hidden_size=6144 "
                     "(default: none)")
    job.add_argument("--global-batch", type=positive_int, metavar="B", default=None,
                     help="sequences per optimizer step (required to plan training)")
    job.add_argument("--seq-len", type=positive_int, metavar="S", default=None,
                     help="tokens per sequence (required to plan training)")
    job.add_argument("--tokens", type=_count, metavar="T", default=None,
                     help="tokens to train on, e.g. 300e9: prints the predicted training time "
                     "and sets the steps of --output")
    cluster = p.add_argument_group("the cluster")
    cluster.add_argument("--gpus", type=positive_int, metavar="N", default=None,
                         help="GPUs (ranks) in all (default: --nproc-per-node with --measure; "
                         "else required)")
    cluster.add_argument("--gpu", type=_gpu, default="h100-80gb",
                         metavar="{" + ",".join(GPUS) + ",PATH.json}",
                         help="GPU model, cpu for this machine's calibrated CPU ranks, or a JSON "
                         "hardware profile for another card (every field of "
                         "tessera.plan.Hardware: name, peak_tflops, memory_gib, memory_gbps, "
                         "intra_node_gbps, inter_node_gbps, ...), such as --calibrate --device cuda "
                         "writes")
    cluster.add_argument("--gpus-per-node", type=positive_int, metavar="N", default=None,
                         help="GPUs per node; tensor parallelism stays within one (default: 8; "
                         "with --gpu cpu all ranks are on this node)")
    cluster.add_argument("--calibration-file", metavar="PATH", default=None,
                         help="where --calibrate writes and --gpu cpu reads the CPU calibration "
                         "(default: $TESSERA_CACHE/plan-cpu.json, else "
                         "~/.cache/tessera/plan-cpu.json); with --calibrate --device cuda, "
                         "the GPU profile to write (default: plan-gpu.json there)")
    fix = p.add_argument_group("fix a dimension (default: searched)")
    for flag, help_ in (("--tp", "tensor-parallel size"), ("--pp", "pipeline-parallel size"),
                        ("--virtual-stages", "model chunks per pipeline rank (interleaved 1F1B)"),
                        ("--cp", "context-parallel size"), ("--ep", "expert-parallel size"),
                        ("--etp", "expert-tensor-parallel size: each routed expert's FFN split "
                         "over N ranks (MoE; searched among 1 and tp)"),
                        ("--micro-batch", "sequences per micro-batch")):
        fix.add_argument(flag, type=positive_int, metavar="N", default=None, help=help_)
    fix.add_argument("--sequence-parallel", type=str2bool, nargs="?", const=True, metavar="BOOL",
                     default=None, help="shard norm/dropout activations over tp (needs tp > 1)")
    fix.add_argument("--recompute", choices=("none", "selective", "full"), default=None,
                     help="activation recomputation: selective recomputes core attention, full "
                     "recomputes whole layers (all, or --recompute-layers of each stage)")
    fix.add_argument("--recompute-layers", type=int, metavar="N", default=None,
                     help="recompute only the first N layers per stage (--recompute full; "
                     "implied when --recompute is not given)")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=positive_int, metavar="K", default=5,
                     help="candidates to show (and to run with --measure)")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    out.add_argument("--output", metavar="FILE",
                     help="write the best candidate as a `tessera pretrain --config` YAML")
    serve = p.add_argument_group("serving (--serve)")
    serve.add_argument("--serve", action="store_true",
                       help="plan serving instead: tp/pp (--tp/--pp fix them), weight format, "
                       "batch and KV cache")
    serve.add_argument("--precision", "--dtype", choices=("bf16", "fp8", "fp32"), default=None,
                       help="number format: of the weights when serving (default: bf16), of "
                       "the compute when training (default: bf16 on GPUs, fp32 on cpu)")
    serve.add_argument("--context", type=positive_int, metavar="C", default=None,
                       help="tokens of context per request (default: the model's maximum)")
    serve.add_argument("--concurrency", type=positive_int, metavar="K", default=None,
                       help="sequences decoded at once per replica, for the time per token "
                       "and the KV cache (default: 1; the table also shows the most that fit)")
    serve.add_argument("--max-latency-ms", type=positive_float, metavar="L", default=None,
                       help="largest acceptable time per output token")
    serve.add_argument("--min-throughput", type=positive_float, metavar="X", default=None,
                       help="smallest acceptable output tokens/s over all requests")
    local = p.add_argument_group("this machine")
    local.add_argument("--calibrate", action="store_true",
                       help="measure this machine's GEMM and gloo all-reduce speed and memory "
                       "for --gpu cpu, save it to --calibration-file and exit; with --device "
                       "cuda measure this GPU instead (see --device)")
    local.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="what --calibrate measures: cpu (default) this CPU, for --gpu cpu; "
                       "cuda this machine's GPU (bf16 GEMMs and SDPA attention at llama "
                       "training shapes, HBM bandwidth; under 60 s), written as a profile "
                       "that --gpu PATH.json reads. Never chosen for you: a CUDA machine "
                       "still calibrates its CPU unless told --device cuda")
    local.add_argument("--measure", action="store_true",
                       help="also run the top candidates for a few steps on --nproc-per-node "
                       "local ranks and rank them by measured step time")
    local.add_argument("--nproc-per-node", type=positive_int, metavar="N", default=None,
                       help="local ranks for --measure (default: --gpus)")
    local.add_argument("--measure-steps", type=positive_int, metavar="N", default=6,
                       help="steps each candidate runs with --measure")
    local.add_argument("--measure-warmup", type=non_negative_int, metavar="N", default=2,
                       help="first steps left out of the measured time (compilation, first "
                       "allocations)")
    p.add_argument("--measure-worker", metavar="DIR", help=argparse.SUPPRESS)  # the ranks' part
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.measure_worker:
        from tessera.plan.measure import measure_worker

        return measure_worker(args.measure_worker)
    from tessera.plan.commands import run

    try:
        return run(args)
    except ValueError as exc:  # PlanError, ConfigError and bad calibration files are ValueErrors
        print(f"tessera plan: {exc}", file=sys.stderr)
        return 2
