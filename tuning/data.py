"""Task datasets for prompt tuning: JSONL examples, per-task templates, answer-only labels.

One example per line: `{"task": "sentiment", "input": "...", "answer": "..."}`. Each task has a
template (default `"{input} {answer}"`): the fields before the answer field form the prompt, the
answer field (last in the template) is what the model learns to produce. A sequence is

    [virtual tokens of the task] + prompt tokens + answer tokens (+ EOS)

and only answer tokens (and EOS) carry labels; every other position is -100. The prompt and the
answer are tokenized separately (whitespace right before the answer field is dropped: a
sentencepiece answer starts with its own word marker), so the boundary is exact.

Virtual tokens occupy positions [0, n_virtual) of every row (`core.models.decoder.model`'s hook
contract). In a batch, their token ids are the *task's index* in the hook's task list: `VirtualPrompts` reads
each row's task from its position-0 id, which travels with the ids through any pipeline
schedule's micro-batch split. The base model never sees those ids: the hook replaces their
embeddings.

Over-long examples are cut from the end of the task's `truncate_field` until they fit the
context, and counted per task; an example that cannot fit even with that field empty is an
error naming file and line, as is a missing field, a field that is not text, or an unknown task.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessera.core.chat_template import ChatTemplate
from tessera.core.config import ConfigError
from tessera.core.tokenizer import Tokenizer
from tessera.tuning.chat_data import ConversationError, render_row

DEFAULT_TEMPLATE = "{input} {answer}"
_TASK_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class DataError(ConfigError):
    """A bad example or template; the message starts with `file:line` where there is one."""


@dataclass
class TaskSpec:
    """How one task's examples become token sequences."""

    name: str
    template: str = DEFAULT_TEMPLATE
    answer_field: str = "answer"
    truncate_field: str | None = "input"  # None: an over-long example is an error
    virtual_tokens: int | None = None  # None: the run's --virtual-tokens

    def __post_init__(self) -> None:
        if not _TASK_NAME.match(self.name):
            raise DataError(f"task name {self.name!r} must be letters, digits, '_' or '-'")
        fields = self.fields()
        if fields.count(self.answer_field) != 1:
            raise DataError(f"task {self.name!r}: template {self.template!r} must contain "
                            f"{{{self.answer_field}}} exactly once")
        if not self.template.rstrip().endswith("{" + self.answer_field + "}"):
            raise DataError(f"task {self.name!r}: the answer field {{{self.answer_field}}} "
                            f"must end the template {self.template!r}")
        if self.truncate_field is not None and self.truncate_field not in fields:
            raise DataError(f"task {self.name!r}: truncate_field {self.truncate_field!r} is "
                            f"not a field of the template {self.template!r}")
        if self.truncate_field == self.answer_field:
            raise DataError(f"task {self.name!r}: the answer field cannot be the one truncated")
        if self.virtual_tokens is not None and self.virtual_tokens < 1:
            raise DataError(f"task {self.name!r}: virtual_tokens must be >= 1")

    def fields(self) -> list[str]:
        try:
            return [f for _, f, _, _ in string.Formatter().parse(self.template) if f]
        except ValueError as exc:
            raise DataError(f"task {self.name!r}: bad template {self.template!r} ({exc})") from exc

    def prompt_template(self) -> str:
        """The template before the answer field, trailing whitespace dropped."""
        return self.template[: self.template.rindex("{" + self.answer_field + "}")].rstrip()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def task_specs_from_yaml(raw: Any, source: str | None) -> dict[str, TaskSpec]:
    """`tasks:` of a tune YAML: `{name: {template, answer_field, truncate_field, virtual_tokens}}`."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: `tasks` must map task names to their settings")
    known = {"template", "answer_field", "truncate_field", "virtual_tokens"}
    out = {}
    for name, body in raw.items():
        body = body or {}
        if not isinstance(body, dict) or set(body) - known:
            extra = sorted(set(body) - known) if isinstance(body, dict) else body
            raise ConfigError(f"{source}: tasks.{name}: unknown settings {extra}; use "
                              f"{sorted(known)}")
        out[str(name)] = TaskSpec(name=str(name), **body)
    return out


@dataclass
class Example:
    """One tokenized example (virtual tokens not included: they are added per batch)."""

    task: str
    prompt: list[int]  # template tokens before the answer
    answer: list[int]  # answer tokens, plus EOS when the run adds it
    answer_text: str
    where: str  # "file:line"
    # A conversation: per token of prompt + answer, whether it has a loss (else: the answer's)
    trained: list[bool] | None = None


@dataclass
class TaskData:
    examples: list[Example]
    truncated: Counter = field(default_factory=Counter)  # task -> examples cut to fit

    def by_task(self) -> dict[str, list[Example]]:
        out: dict[str, list[Example]] = {}
        for ex in self.examples:
            out.setdefault(ex.task, []).append(ex)
        return out


def read_jsonl(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """`(file:line, object)` for each non-blank line of a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg})") from exc
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            rows.append((where, obj))
    if not rows:
        raise DataError(f"data file {path} has no examples")
    return rows


def discover_tasks(path: str | Path) -> list[str]:
    """Task names in a JSONL file, in order of first appearance (a missing one is an error)."""
    seen: dict[str, None] = {}
    for where, obj in read_jsonl(path):
        seen.setdefault(_task_of(where, obj), None)
    return list(seen)


def _task_of(where: str, obj: dict[str, Any]) -> str:
    task = obj.get("task")
    if task is None and "messages" in obj:
        return "chat"  # a conversation (tuning.chat_data)
    if task is None:
        raise DataError(f"{where}: missing field 'task' (which task this example belongs to)")
    if not isinstance(task, str):
        raise DataError(f"{where}: field 'task' must be a string, got {task!r}")
    return task


def load_examples(path: str | Path, specs: dict[str, TaskSpec], n_virtual: dict[str, int],
                  tokenizer: Tokenizer, context: int, add_eos: bool,
                  chat_template: ChatTemplate | None = None,
                  all_tokens: bool = False) -> TaskData:
    """Tokenize every example of `path`; tasks must be among `specs`.

    `context` is the longest sequence allowed (virtual tokens + prompt + answer + EOS).
    Conversations (`{"messages": [...]}` rows) are rendered by `chat_template` (the built-in
    one when None), their loss on the assistant's tokens, or on all with `all_tokens`
    (`tuning.chat_data`).
    """
    data = TaskData([])
    for where, obj in read_jsonl(path):
        task = _task_of(where, obj)
        if task not in specs:
            raise DataError(f"{where}: unknown task {task!r}; this run knows "
                            f"{', '.join(sorted(specs))}")
        if "messages" in obj:
            try:
                chat = render_row(obj, chat_template or ChatTemplate(), tokenizer, context,
                                  n_virtual[task], all_tokens)
            except ConversationError as exc:
                raise DataError(f"{where}: {exc}") from None
            data.truncated[task] += chat.cut
            data.examples.append(Example(task, chat.prompt, chat.answer, chat.answer_text,
                                         where, trained=chat.trained))
            continue
        spec = specs[task]
        values = {}
        for name in spec.fields():
            if name not in obj:
                raise DataError(f"{where}: task {task!r} needs field {name!r} (template "
                                f"{spec.template!r}); the example has {sorted(obj)}")
            value = obj[name]
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise DataError(f"{where}: field {name!r} must be text, got {value!r}")
            values[name] = str(value)
        answer_text = values.pop(spec.answer_field)
        answer = tokenizer.encode(answer_text, eos=add_eos)
        budget = context - n_virtual[task] - len(answer)
        prompt, cut = _fit_prompt(spec, values, tokenizer, budget, where, context,
                                  n_virtual[task])
        data.truncated[task] += cut
        data.examples.append(Example(task, prompt, answer, answer_text, where))
    return data


def _fit_prompt(spec: TaskSpec, values: dict[str, str], tokenizer: Tokenizer, budget: int,
                where: str, context: int, n_virtual: int) -> tuple[list[int], bool]:
    """The prompt's tokens within `budget`, cutting the end of the truncate field if needed."""
    template = spec.prompt_template()
    prompt = tokenizer.encode(template.format(**values)) if template else []
    if len(prompt) <= budget:
        return prompt, False
    field_ = spec.truncate_field
    if field_ is None or field_ not in values:
        raise DataError(f"{where}: task {spec.name!r}: {n_virtual} virtual + {len(prompt)} prompt "
                        f"tokens + the answer exceed the context of {context} and the task has "
                        "no truncate_field; shorten the example or set one")
    pieces = tokenizer.encode(values[field_])
    keep = len(pieces) - (len(prompt) - budget)
    for _ in range(8):  # re-tokenizing a cut text can shift a token or two: converge
        if keep <= 0:
            break
        prompt = tokenizer.encode(template.format(
            **{**values, field_: tokenizer.decode(pieces[:keep])}))
        if len(prompt) <= budget:
            return prompt, True
        keep -= len(prompt) - budget
    rest = len(tokenizer.encode(template.format(**{**values, field_: ""}))) if template else 0
    raise DataError(f"{where}: task {spec.name!r}: {n_virtual} virtual tokens + the answer "
                    f"({context - budget - n_virtual} tokens) + the rest of the template "
                    f"({rest}) leave no room for field {field_!r} in the context of {context} "
                    "tokens; use fewer virtual tokens, a larger --seq-len, or a shorter answer")


def sequence(ex: Example, task_index: int, n_virtual: int) -> list[int]:
    """The full token sequence of an example: virtual slots (ids = task index), prompt, answer."""
    return [task_index] * n_virtual + ex.prompt + ex.answer


def make_batch(examples: list[Example], task_index: dict[str, int], n_virtual: dict[str, int],
               seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `tokens (B, seq_len)` and `labels (B, seq_len)`: next-token targets on the
    answer (and EOS) only, -100 elsewhere."""
    tokens = torch.full((len(examples), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), seq_len), -100, dtype=torch.long)
    for row, ex in enumerate(examples):
        n = n_virtual[ex.task]
        full = sequence(ex, task_index[ex.task], n)
        inputs = full[:-1]
        tokens[row, : len(inputs)] = torch.tensor(inputs)
        labels[row, : len(inputs)] = torch.tensor(targets(ex, full, n))
    return tokens, labels


def targets(ex: Example, full: list[int], n_virtual: int) -> list[int]:
    """Next-token targets of `full[:-1]`: the answer's (or a conversation's trained) tokens,
    -100 elsewhere."""
    if ex.trained is None:
        trained = [False] * (n_virtual + len(ex.prompt)) + [True] * len(ex.answer)
    else:
        trained = [False] * n_virtual + ex.trained
    return [token if keep else -100 for token, keep in zip(full[1:], trained[1:])]


def longest(examples: list[Example], n_virtual: dict[str, int]) -> int:
    """Input length (the sequence minus its last token) of the longest example."""
    return max(n_virtual[e.task] + len(e.prompt) + len(e.answer) - 1 for e in examples)


def step_indices(step: int, n_examples: int, global_batch: int, seed: int) -> list[int]:
    """The example indices of global batch `step`: epochs of seeded permutations, back to back,
    so batch `step` depends on the step alone (resuming needs nothing else)."""
    out = []
    for k in range(step * global_batch, (step + 1) * global_batch):
        epoch, i = divmod(k, n_examples)
        out.append(_permutation(n_examples, seed, epoch)[i])
    return out


_PERMS: dict[tuple[int, int, int], list[int]] = {}


def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    key = (n, seed, epoch)
    if key not in _PERMS:
        if len(_PERMS) > 64:
            _PERMS.clear()
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        _PERMS[key] = order
    return _PERMS[key]
