"""`tessera serve --checkpoint DIR`: the HTTP server over one engine, on one or tp x pp ranks.

Single process by default. Under torchrun (or with `--nproc-per-node N`, which relaunches this
command through torch's own launcher) rank 0 runs the engine and the HTTP server and every other
rank serves the engine's steps (`serving.engine.distributed`). SIGTERM / Ctrl-C stop every rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from tessera.core.arg_types import non_negative_int, port, positive_float, positive_int
from tessera.core.chat_template import stored_chat_template
from tessera.core.generation_defaults import read_generation_defaults
from tessera.core.help import HelpFormatter

DEFAULT_SERVED_NAME = "tessera"  # what the README's client examples send as `model`

_EPILOG = """examples:
  tessera serve --checkpoint runs/demo/checkpoints/step-00000300
  tessera serve --checkpoint CKPT --tp 2 --nproc-per-node 2 --dtype bf16
  tessera serve --checkpoint CKPT --prompts runs/tune/squad --port 9000
  tessera serve --checkpoint CKPT --lora sql=runs/tune/sql-lora --allow-runtime-lora
  TESSERA_API_KEY=secret tessera serve --checkpoint CKPT --host 0.0.0.0"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tessera serve", formatter_class=HelpFormatter,
        description="Serve a checkpoint over HTTP (OpenAI, KServe v2 / Triton, Megatron /api).",
        epilog=_EPILOG)
    env_checkpoint = os.environ.get("TESSERA_CHECKPOINT")
    p.add_argument("--checkpoint", required=not env_checkpoint, default=env_checkpoint,
                   help="Tessera checkpoint directory (any layout; default: $TESSERA_CHECKPOINT)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "auto"), default=None,
                   help="compute dtype (default: the checkpoint's, except that a bf16 or fp16 "
                        "checkpoint runs in fp32 on a CPU without native bf16, where bf16 is "
                        "emulated and slower; auto: chosen from the CPU, see core/cpu_isa.py)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    # core.quantize.QUANTIZE_CHOICES, spelled out so that --help does not import torch
    p.add_argument("--quantize", choices=("none", "int8", "fp8"), default="none",
                   help="int8: weight-only int8 matrices with bf16 activations, for faster "
                        "CPU decoding (implies --dtype bf16); fp8: e4m3 block matrices with "
                        "per-channel scales, W8A8 through torch._scaled_mm on Hopper GPUs, "
                        "dequantized per product elsewhere. Either prints its logit error vs "
                        "the unquantized model at start (see core/quantize.py)")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=("on", "off", "auto"),
                   help="compile the decode step with TorchInductor (auto: only on a CPU with "
                        "native bf16, where it pays; see core/cpu_isa.py): about 2x faster "
                        "single-stream decoding of small models in bf16 on CPU (1.4x in fp32), "
                        "after 10-60 s of compiling at start; one process only, not with "
                        "--quantize int8; decode batches are padded to 1, 2, 4, ... rows, a "
                        "graph each (see serving/engine/compiled.py)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="TorchInductor's on-disk cache directory: a restart with the same one "
                        "reuses the compiled kernels (default: $TORCHINDUCTOR_CACHE_DIR, else "
                        "torch's per-user directory under /tmp)")
    # From the environment too, so a container image can listen on all interfaces by default
    # and keep doing so when its command is overridden.
    p.add_argument("--host", default=os.environ.get("TESSERA_HOST", "127.0.0.1"),
                   help="bind address (default: $TESSERA_HOST, else 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel ranks")
    p.add_argument("--nproc-per-node", type=positive_int, default=None, metavar="N",
                   help="start this many local ranks (tp x pp) through torch.distributed.run "
                        "(default: this process only)")
    p.add_argument("--max-batch", type=positive_int, default=8, help="requests running at once")
    p.add_argument("--max-queue", type=non_negative_int, default=128,
                   help="requests waiting for a slot before new ones get 503")
    p.add_argument("--max-concurrency", type=positive_int, default=64,
                   help="HTTP generation requests admitted at once; more get 429")
    p.add_argument("--request-timeout", type=positive_float, default=600.0,
                   help="seconds a generation request may take, queueing included")
    p.add_argument("--max-body-bytes", type=positive_int, default=4 << 20,
                   help="largest request body; larger ones get 413")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="longest prompt accepted (default: whatever fits the context)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="chat template file for /v1/chat/completions (default: role: text)")
    p.add_argument("--max-step-tokens", type=positive_int, default=512,
                   help="tokens per engine step (decodes + prompt chunks)")
    p.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $TESSERA_API_KEY)")
    p.add_argument("--prompts", action="append", default=[], metavar="DIR",
                   help="prompt table directory from `tessera tune` (repeatable)")
    p.add_argument("--served-model-name", "--model-name", dest="served_model_name", nargs="+",
                   default=None, metavar="NAME",
                   help="the name(s) clients give as `model`; the first is the one answers "
                        f"carry (default: {DEFAULT_SERVED_NAME!r}, and the checkpoint "
                        "directory's name as a second one)")
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    # The KV cache (serving/engine/kv_config.py)
    p.add_argument("--kv-cache", choices=("paged", "slots"), default=None,
                   help="paged: blocks shared through the prefix cache (default); slots: one "
                        "whole-context row per request")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="paged pool size: 8GiB, 512MiB, a number above 1 (GiB), or a fraction "
                        "of free memory in (0, 1] (default: what --max-batch whole-context "
                        "slots would take)")
    p.add_argument("--kv-block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share KV blocks between requests with a common prefix")
    # Speculative decoding (serving/engine/speculative.py)
    p.add_argument("--speculative", choices=("ngram", "draft"), default=None,
                   help="speculative decoding: ngram proposes the tokens that followed the "
                        "last n-gram's earlier occurrence in the request (prompt lookup); "
                        "draft proposes with --draft-checkpoint. Exact: greedy output is "
                        "unchanged, sampled output keeps its distribution (default: off)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=None, metavar="K",
                   help="draft tokens per request and step (default 4)")
    p.add_argument("--draft-checkpoint", default=None, metavar="DIR",
                   help="--speculative draft: a smaller Tessera checkpoint with the same "
                        "tokenizer, run in the serving process with its own KV cache")
    p.add_argument("--ngram-min", type=positive_int, default=None, metavar="N",
                   help="--speculative ngram: shortest n-gram looked up (default 1)")
    p.add_argument("--ngram-max", type=positive_int, default=None, metavar="N",
                   help="--speculative ngram: longest n-gram looked up, tried first (default 3)")
    p.add_argument("--header-timeout", type=positive_float, default=10.0, metavar="S",
                   help="close a connection whose request headers take longer (slowloris)")
    p.add_argument("--body-timeout", type=positive_float, default=30.0, metavar="S",
                   help="answer 408 when a request body stalls this long")
    p.add_argument("--keep-alive-timeout", type=positive_float, default=5.0, metavar="S",
                   help="close idle keep-alive connections after this long")
    p.add_argument("--max-connections", type=positive_int, default=1024,
                   help="open connections at most; requests on more get 503")
    # Per-request LoRA adapters (serving/engine/adapters.py)
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve the LoRA adapter directory PATH (`tessera tune --method lora`, "
                        "or a PEFT adapter_config.json + adapter_model.safetensors) as NAME, "
                        "selected by model 'BASE:NAME' or 'NAME' (repeatable)")
    p.add_argument("--max-loras", type=positive_int, default=4,
                   help="LoRA adapters loaded at once (slots kept in memory)")
    p.add_argument("--max-lora-rank", type=positive_int, default=16,
                   help="largest LoRA rank per layer (a PEFT adapter of q, k and v at rank r "
                        "has rank 3r on the fused qkv)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="let POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and "
                        "unload adapters (directories on this machine) while serving; behind "
                        "--api-key when one is set")
    p.add_argument("--t5-sentinels", type=non_negative_int, default=None, metavar="N",
                   help="T5 checkpoints: sentinel tokens <extra_id_k> above the tokenizer "
                        "(default: the room the model's vocabulary has, at most 100)")
    return p


def main(argv: list[str], adapter_reader: Any = None) -> int:
    """`adapter_reader(directory, checkpoint) -> (AdapterConfig, tensors)` reads LoRA adapter
    directories (the root command passes one that reads PEFT directories too, which serving
    may not import); default: Tessera adapter directories only."""
    args = build_parser().parse_args(argv)
    args.adapter_reader = adapter_reader
    from tessera.core.checkpoint import CheckpointError
    from tessera.core.config import ConfigError

    from_env = args.checkpoint == os.environ.get("TESSERA_CHECKPOINT")
    if from_env and not Path(args.checkpoint).exists():  # e.g. the Docker image, nothing mounted
        print(f"tessera serve: no checkpoint at {args.checkpoint} ($TESSERA_CHECKPOINT): mount "
              "one there (docker run -p 8000:8000 -v \"$PWD/CKPT:/models/ckpt:ro\" IMAGE) or "
              "pass --checkpoint DIR", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.nproc_per_node and world == 1:
        if args.tp * args.pp not in (1, args.nproc_per_node):
            print(f"tessera serve: tp {args.tp} x pp {args.pp} does not match --nproc-per-node "
                  f"{args.nproc_per_node}", file=sys.stderr)
            return 2
        from tessera.core.parallel.launch import launch_local_ranks

        return launch_local_ranks("serve", argv, args.nproc_per_node)
    try:
        from tessera.serving.http.family_apps import app_for_family

        family_app = app_for_family(args, served_names(args))  # BERT, T5: one process
        engine = None if family_app else _start(args)
    except (CheckpointError, ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"tessera serve: {exc}", file=sys.stderr)
        return 2
    if family_app is not None:
        import uvicorn

        uvicorn.Server(uvicorn_config(family_app, args)).run()
        return 0
    if engine is None:
        return 0  # a worker rank: rank 0 has stopped
    try:
        return _run_http(engine, args)
    finally:
        engine.shutdown()


def _start(args: argparse.Namespace):
    """This rank's part: the engine on rank 0, the worker loop (then None) elsewhere."""
    from tessera.core.parallel.groups import resolve_device
    from tessera.serving.engine.distributed import start_rank
    from tessera.serving.engine.speculative import config_from_flags

    speculative = config_from_flags(args.speculative, args.num_speculative_tokens,
                                    args.draft_checkpoint, args.ngram_min, args.ngram_max)
    tasks = None
    if args.prompts:
        from tessera.core.prompt_table import load_prompt_tables

        tasks = load_prompt_tables(args.prompts, args.checkpoint)
    # background=False: the step loop runs on this (main) thread, see `serving.engine.bridge`.
    if args.quantize == "int8" and args.dtype not in (None, "bf16"):
        raise ValueError(f"--quantize int8 computes in bf16; drop --dtype {args.dtype}")
    if args.quantize == "fp8" and args.compile == "on":
        raise ValueError("--quantize fp8 runs the eager decode step: drop --compile")
    dtype = "bf16" if args.quantize == "int8" else args.dtype
    from tessera.serving.adapter_cli import lora_serving

    lora = lora_serving(args)
    if args.quantize == "fp8" and args.compile == "auto":  # FP8 weights decode eagerly
        args.compile = "off"
    dtype, args.compile = host_choices(args.checkpoint, dtype, args.compile, args.device)
    if args.compile:
        if args.compile_cache is not None:
            from tessera.core.compile_cache import use_compile_cache_dir

            use_compile_cache_dir(args.compile_cache)
        print("tessera serve: compiling the decode step (10-60 s, once per start)",
              file=sys.stderr, flush=True)
    from tessera.serving.engine.kv_config import KVCacheConfig

    kind = args.kv_cache or "paged"
    kv = KVCacheConfig(kind=kind, block_size=args.kv_block_size, memory=args.kv_cache_memory,
                       prefix_caching=not args.no_prefix_caching)
    # generation_config.json's eos ids (all of them end a request), when the checkpoint has one.
    eos = read_generation_defaults(args.checkpoint).eos_token_ids or None
    return start_rank(args.checkpoint, tp=args.tp, pp=args.pp, dtype=dtype, kv=kv, lora=lora,
                      quantize=args.quantize, compile_decode=args.compile,
                      device=resolve_device(args.device), max_batch=args.max_batch, tasks=tasks,
                      background=False,
                      max_queue=args.max_queue, max_step_tokens=args.max_step_tokens,
                      model_name=served_names(args)[0], speculative=speculative, eos_id=eos)


def uvicorn_config(app: Any, args: argparse.Namespace) -> Any:
    """The uvicorn config serving `app` with the flags' address and slow-client limits."""
    from tessera.serving.http.connections import server_config

    return server_config(app, host=args.host, port=args.port, log_level=args.log_level,
                         header_timeout_s=args.header_timeout,
                         keep_alive_s=args.keep_alive_timeout,
                         max_connections=args.max_connections)


def served_names(args: argparse.Namespace) -> list[str]:
    """`--served-model-name`, else "tessera" and the checkpoint directory's name."""
    if args.served_model_name:
        return list(args.served_model_name)
    return [DEFAULT_SERVED_NAME, Path(args.checkpoint).resolve().name]


def host_choices(checkpoint: str, dtype: str | None, compile_: str | bool, device: str
                 ) -> tuple[str | None, bool]:
    """The dtype and compile setting to serve with, after the host's say (`core.cpu_isa`):
    `auto` asks for its choice; an unset dtype keeps the checkpoint's unless that is bf16/fp16
    on a CPU that would emulate it. A choice the host made is said on stderr."""
    from tessera.core.checkpoint import read_manifest
    from tessera.core.cpu_isa import cpu_isa, serving_defaults

    if compile_ in (True, False):
        compile_ = "on" if compile_ else "off"
    if dtype not in (None, "auto") and compile_ != "auto":
        if compile_ == "on" and dtype in ("bf16", "fp16") and not cpu_isa().native_bf16 \
                and (device == "cpu" or (device == "auto" and not _cuda_available())):
            print(f"tessera serve: warning: this CPU ({cpu_isa()}) has no native bf16; a "
                  f"compiled {dtype} decode step is slower than eager here (up to 5x with "
                  "many requests: bench/bench_mm_layout.py); --dtype fp32 is faster",
                  file=sys.stderr, flush=True)
        return dtype, compile_ == "on"
    on_cpu = device == "cpu" or (device == "auto" and not _cuda_available())
    stored = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
        read_manifest(checkpoint).dtype, "fp32")
    isa = cpu_isa()
    choice = serving_defaults(isa, stored, "cpu" if on_cpu else "cuda")
    if dtype == "auto" or compile_ == "auto":
        print(f"tessera serve: host defaults: {choice.reason}", file=sys.stderr, flush=True)
    if dtype == "auto":
        dtype = choice.dtype
    elif dtype is None and on_cpu and stored != "fp32" and not isa.native_bf16:
        dtype = "fp32"
        print(f"tessera serve: the checkpoint is {stored}; this CPU ({isa}) serves it in fp32 "
              "(pass --dtype to choose)", file=sys.stderr, flush=True)
    return dtype, choice.compile_decode if compile_ == "auto" else compile_ == "on"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_http(engine, args: argparse.Namespace) -> int:
    """The engine's step loop on this (main) thread, uvicorn on a helper thread.

    SIGINT / SIGTERM shut the engine down, which stops uvicorn; uvicorn stopping on its own
    (it could not bind the port) shuts the engine down. Returns the exit code.
    """
    import uvicorn

    from tessera.serving.http.app import create_app  # the HTTP layer, imported only to serve
    from tessera.serving.http.flags import app_limits

    template, origin = chat_template_of(args)
    print(f"tessera serve: chat template: {origin}", file=sys.stderr, flush=True)
    defaults = read_generation_defaults(args.checkpoint).sampling()
    if defaults:
        print(f"tessera serve: default sampling from generation_config.json: {defaults}",
              file=sys.stderr, flush=True)
    app = create_app(engine, model_name=engine.model_name, chat_template=template,
                     allow_runtime_lora=args.allow_runtime_lora, sampling_defaults=defaults,
                     **app_limits(args, served_names(args)))
    server = uvicorn.Server(uvicorn_config(app, args))
    engine.on_stop(lambda: setattr(server, "should_exit", True))
    failed = []

    def serve_http() -> None:
        try:
            server.run()  # off the main thread, uvicorn installs no signal handlers
        except BaseException as exc:  # e.g. SystemExit(1) when the port is taken
            failed.append(exc)
        finally:
            engine.shutdown()

    http = threading.Thread(target=serve_http, name="tessera-http", daemon=True)
    previous = {s: signal.signal(s, lambda *_: engine.shutdown())
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        engine.run()
    finally:
        server.should_exit = True
        http.join(timeout=30)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if failed or not server.started else 0


def chat_template_of(args: argparse.Namespace) -> tuple[str | None, str]:
    """The chat template to serve (None: the built-in "role: content" one) and where it came
    from, in words, for the start-up log."""
    if args.chat_template:
        return Path(args.chat_template).read_text(), f"--chat-template {args.chat_template}"
    template, origin = stored_chat_template(args.checkpoint)
    if template is None:
        return None, ("the built-in 'role: content' lines (the checkpoint has none; give "
                      "--chat-template FILE for an instruct model)")
    return template, f"the checkpoint's {origin}"
