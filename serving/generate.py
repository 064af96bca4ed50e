"""`tessera generate --checkpoint DIR`: generation in this process, beside the engine.

The verb's parser lives with the client (`tessera.clients.cli`), which also runs `--url`; the
root command hands `run_local` to it, so neither package imports the other (see the import
contracts in pyproject.toml).

As the server does: a text prompt starts with BOS, `--stop` strings cut the text before them
(and end generation), `--chat` renders the prompt as a user message (after an optional
`--system` one) through the checkpoint's chat template (else the built-in one), and `--stream`
prints the text as it is decoded (`serving.engine.detokenize`: never half a character).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def generate_text(checkpoint: str, prompt: str, *, max_tokens: int = 64,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int | None = None, dtype: str | None = None,
                  stop: Sequence[str] = (), chat: bool = False, system: str | None = None,
                  on_text: Callable[[str], None] | None = None) -> str:
    """The continuation of `prompt` by the model at `checkpoint` (EOS dropped, cut before the
    first `stop` string), one process. `chat`: `prompt` is a user message (see the module
    docstring). `on_text(delta)` receives the text as it becomes final.

    Raises `CheckpointError` / `ValueError` (bad checkpoint, prompt too long) and
    `FileNotFoundError` (no checkpoint there).
    """
    from tessera.core.checkpoint import load_checkpoint
    from tessera.core.generation import generate_ids
    from tessera.core.tokenizer import load_tokenizer
    from tessera.serving.engine.detokenize import OutputText

    model = load_checkpoint(checkpoint, dtype=dtype)
    tokenizer = load_tokenizer(checkpoint)
    text = chat_prompt(checkpoint, prompt, system) if chat else prompt
    ids = tokenizer.encode(text, bos=tokenizer.adds_bos)
    output = OutputText(tokenizer, ids, list(stop))
    pieces: list[str] = []

    def release(final: bool = False) -> None:
        _, delta, _ = output.take(final=final)
        if delta:
            pieces.append(delta)
            if on_text is not None:
                on_text(delta)

    def on_token(token: int) -> bool:
        stopped = output.add(token, None, check_stop=True)
        release()
        return stopped

    generate_ids(model, ids, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                 eos_id=tokenizer.eos_id, seed=seed, on_token=on_token)
    release(final=True)
    return "".join(pieces)


def chat_prompt(checkpoint: str, message: str, system: str | None = None) -> str:
    """`message` (after `system`) rendered by the checkpoint's chat template, as served."""
    from tessera.core.chat_template import stored_chat_template
    from tessera.serving.http.openai_api import ChatTemplate
    from tessera.serving.http.schemas import ChatMessage

    messages = ([ChatMessage(role="system", content=system)] if system else []) + [
        ChatMessage(role="user", content=message)]
    return ChatTemplate(stored_chat_template(checkpoint)[0]).render(messages)


def run_local(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation (with `--chat`, the reply alone); `args` come from
    `tessera.clients.cli`'s parser.

    Returns the exit code: 0, or 2 when the checkpoint or prompt is unusable (message on stderr).
    """
    chat, stream = getattr(args, "chat", False), getattr(args, "stream", False)
    head = "" if chat else args.prompt

    def show(delta: str) -> None:
        print(delta, end="", flush=True)

    try:
        if stream:
            print(head, end="", flush=True)
        text = generate_text(args.checkpoint, args.prompt, max_tokens=args.max_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=args.seed, dtype=args.dtype, stop=getattr(args, "stop", None) or (),
                             chat=chat, system=getattr(args, "system", None),
                             on_text=show if stream else None)
    except (FileNotFoundError, ValueError) as exc:  # CheckpointError is a ValueError
        print(f"{chr(10) if stream else ''}tessera generate: {exc}", file=sys.stderr)
        return 2
    print("" if stream else head + text)
    return 0
