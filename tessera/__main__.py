"""`tessera VERB ...`: one entry point, verbs mapped to functions that are imported lazily.

Each verb names a `module:function` taking the remaining argv; importing only the chosen module
keeps `tessera --help` fast and lets, e.g., `tessera preprocess` run without the serving stack.
"""

from __future__ import annotations

import importlib
import os
import sys

from tessera import __version__

# verb -> ("module:function", one-line help). The function receives argv after the verb.
VERBS: dict[str, tuple[str, str]] = {
    "pretrain": ("tessera.training.cli:main", "pretrain a GPT (YAML config + --key value overrides)"),
    "evaluate": ("tessera.training.evaluate_cli:main", "loss and perplexity of a checkpoint on data"),
    "tokenizer": ("tessera.training.tokenizer_cli:main", "train a sentencepiece tokenizer"),
    "preprocess": ("tessera.training.preprocess:main", "tokenize text/JSONL into an indexed dataset"),
    "convert": ("tessera.converters.cli:main", "reshard, cast, FP8, or import/export Hugging Face"),
    "inspect": ("tessera.converters.inspect:main", "describe a checkpoint in plain words"),
    "tune": ("tessera.__main__:tune",
             "tune a model: prompt/p-tuning, LoRA, full SFT or DPO, on tasks or chats"),
    "serve": ("tessera.__main__:serve", "run the HTTP text-generation server"),
    "generate": ("tessera.__main__:generate", "generate text from a server or a local checkpoint"),
    "models": ("tessera.core.presets:main", "list the model presets with their sizes"),
    "plan": ("tessera.plan.cli:main", "pick the parallel layout, micro-batch and recompute"),
}


def generate(argv: list[str]) -> int:
    """`tessera generate`: the client runs `--url`; `--checkpoint` runs beside the engine.

    Clients may not import serving (nor serving clients), so the one place that knows both is
    this root command, which hands the local mode to the client's parser.
    """
    from tessera.clients.cli import main as generate_main

    def local(args):  # imported only when generating locally: --url never loads torch
        from tessera.serving.generate import run_local

        return run_local(args)

    return generate_main(argv, local=local)


def serve(argv: list[str]) -> int:
    """`tessera serve`: serving may not import the converters, so the one place that knows
    both hands serving the LoRA reader that also reads PEFT adapter directories."""
    from tessera.serving.cli import main as serve_main

    def read_adapter(directory, checkpoint):  # converters load only when an adapter is read
        from tessera.converters.peft_lora import read_any_adapter

        return read_any_adapter(directory, checkpoint)

    return serve_main(argv, adapter_reader=read_adapter)


def tune(argv: list[str]) -> int:
    """`tessera tune`: tuning may not import serving, so this root command hands it the
    engine's greedy answers for `--eval-engine` (serving loads only when they are asked for)."""
    from tessera.tuning.cli import main as tune_main

    def engine_answers(*args, **kwargs):
        from tessera.serving.engine_answers import greedy_answers

        return greedy_answers(*args, **kwargs)

    return tune_main(argv, engine_answers=engine_answers)


def _usage() -> str:
    lines = [f"tessera {__version__}", "", "usage: tessera VERB [options]   (tessera VERB --help)", ""]
    lines += [f"  {verb:<11} {help_}" for verb, (_, help_) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["pretrain"]  # the embedded default: the demo pretraining run
    if argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(__version__)
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"tessera: unknown verb {verb!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name = VERBS[verb][0].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("tessera"):
            print(f"tessera: the verb {verb!r} is not available in this build.", file=sys.stderr)
            return 2
        raise
    try:
        result = getattr(module, func_name)(rest)
    except BrokenPipeError:
        # The reader went away (`tessera plan ... | head`): not an error of ours. Point stdout
        # at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
