"""A model's own generation settings: the `generation_config.json` transformers writes next to
a model, kept in the checkpoint by `tessera convert --from hf` and written back on export.

What Tessera reads of it (`GenerationDefaults`): `eos_token_id` (an id or a list: every one ends
a generation, as in transformers' `generate`) and the sampling a request (OpenAI, Triton or
Megatron) that sets none gets:
`temperature`, `top_p`, `top_k`, and `do_sample=false` meaning greedy (temperature 0), as
`generate` computes. Other keys are kept in the file but not used by the server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.core.errors import ConfigError

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """End-of-sequence ids (first: the model's EOS) and default sampling (None: unset)."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def sampling(self) -> dict[str, float | int]:
        """The sampling fields the file sets (SamplingParams names)."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return {k: v for k, v in fields.items() if v is not None}


def _number(data: dict[str, Any], key: str, kind: type, where: Path) -> Any:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: {key}={value!r} must be a number")
    return kind(value)


def parse_generation_config(data: dict[str, Any], where: Path) -> GenerationDefaults:
    """The `GenerationDefaults` of a generation_config.json's contents; ConfigError (naming the
    field) for a value of the wrong kind."""
    eos = data.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            and i >= 0 for i in ids):
        raise ConfigError(f"{where}: eos_token_id={eos!r} must be a token id or a list of them")
    temperature = _number(data, "temperature", float, where)
    if data.get("do_sample") is False:  # transformers' generate: greedy whatever the rest says
        temperature = 0.0
    top_k = _number(data, "top_k", int, where)
    return GenerationDefaults(tuple(dict.fromkeys(ids)), temperature,
                              _number(data, "top_p", float, where), top_k)


def read_generation_defaults(directory: str | Path) -> GenerationDefaults:
    """The `generation_config.json` in `directory` (a checkpoint or an HF model), or the empty
    defaults when it has none."""
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return GenerationDefaults()
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return parse_generation_config(data, path)
