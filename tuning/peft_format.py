"""Prompt tables to and from PEFT's prompt-tuning adapters (Hugging Face `peft`).

A PEFT `PROMPT_TUNING` adapter for a causal LM is a directory with `adapter_config.json`
(`peft_type`, `task_type`, `num_virtual_tokens`, `token_dim`, ...) and `adapter_model.safetensors`
holding one tensor, `prompt_embeddings (num_virtual_tokens, token_dim)`. PEFT prepends those
embeddings to the input embeddings, at positions 0..n-1, exactly where Tessera's virtual tokens
sit; so on the Hugging Face export of the same base (`converters.hf_io.export_hf`) an exported
table gives Tessera's logits, and an adapter trained with `peft` imports as a table.

One task per adapter directory: `export_peft` writes `OUT/TASK/` for each task.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from tessera.core.checkpoint import atomic_directory, read_manifest
from tessera.core.files import save_safetensors
from tessera.core.prompt_table import PromptTableError, read_prompt_table, write_prompt_table
from tessera.tuning.data import TaskSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY = "prompt_embeddings"


def export_peft(table_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                task: str | None = None, hf_model: str | None = None,
                overwrite: bool = False) -> list[Path]:
    """Write each task of the prompt table at `table_dir` (or only `task`) as a PEFT adapter
    `out_dir/TASK/`; `hf_model` fills `base_model_name_or_path`. Atomic; returns the dirs."""
    manifest, tables = read_prompt_table(table_dir)
    if task is not None and task not in tables:
        raise PromptTableError(f"{table_dir} has no task {task!r}; it has "
                               f"{', '.join(sorted(tables))}")
    base = _base_config(manifest)
    names = [task] if task is not None else sorted(tables)
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        for name in names:
            table = tables[name].float().contiguous()
            config = {
                "peft_type": "PROMPT_TUNING", "task_type": "CAUSAL_LM",
                "num_virtual_tokens": int(table.shape[0]), "token_dim": int(table.shape[1]),
                "num_transformer_submodules": 1,
                "num_attention_heads": base.num_heads if base else None,
                "num_layers": base.num_layers if base else None,
                "prompt_tuning_init": "RANDOM", "prompt_tuning_init_text": None,
                "tokenizer_name_or_path": None, "base_model_name_or_path": hf_model,
                "inference_mode": True, "revision": None, "modules_to_save": None,
                "auto_mapping": None,
            }
            (tmp / name).mkdir()
            (tmp / name / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            save_safetensors({KEY: table}, str(tmp / name / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return [Path(out_dir) / name for name in names]


def _base_config(manifest: dict):
    try:
        return read_manifest(manifest["base_checkpoint"]).model
    except Exception:  # the base moved: the adapter still loads, without these two hints
        return None


def read_peft_adapter(adapter_dir: str | os.PathLike) -> torch.Tensor:
    """The `(num_virtual_tokens, token_dim)` prompt embeddings of a PEFT prompt-tuning adapter."""
    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / ADAPTER_CONFIG
    if not config_file.is_file():
        raise PromptTableError(f"{adapter_dir} is not a PEFT adapter: {ADAPTER_CONFIG} is missing")
    config = json.loads(config_file.read_text())
    kind = config.get("peft_type")
    if kind != "PROMPT_TUNING":
        raise PromptTableError(f"{adapter_dir} is a {kind} adapter; only PROMPT_TUNING adapters "
                               "are prompt tables")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise PromptTableError(f"{adapter_dir}: task_type {config.get('task_type')!r}; only "
                               "CAUSAL_LM adapters apply to a decoder")
    if config.get("num_transformer_submodules") not in (None, 1):
        raise PromptTableError(f"{adapter_dir}: num_transformer_submodules "
                               f"{config['num_transformer_submodules']} (encoder-decoder); a "
                               "decoder has one")
    weights = adapter_dir / ADAPTER_WEIGHTS
    if weights.is_file():
        with safe_open(str(weights), framework="pt") as handle:
            stored = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    elif (adapter_dir / "adapter_model.bin").is_file():  # older PEFT; tensors only, no code
        stored = torch.load(adapter_dir / "adapter_model.bin", map_location="cpu",
                            weights_only=True)
    else:
        raise PromptTableError(f"{adapter_dir} has no {ADAPTER_WEIGHTS}")
    if KEY not in stored:
        raise PromptTableError(f"{adapter_dir}: no {KEY!r} tensor (it has {sorted(stored)})")
    table = stored[KEY]
    expected = (config.get("num_virtual_tokens"), config.get("token_dim"))
    if table.ndim != 2 or (None not in expected and tuple(table.shape) != expected):
        raise PromptTableError(f"{adapter_dir}: {KEY} has shape {tuple(table.shape)}, the "
                               f"config says {expected}")
    return table.float()


def import_peft(adapter_dir: str | os.PathLike, base_checkpoint: str | os.PathLike, task: str,
                out_dir: str | os.PathLike, add_eos: bool = True) -> Path:
    """Turn a PEFT prompt-tuning adapter trained on the HF export of `base_checkpoint` into a
    Tessera prompt table for task `task` (default template) at `out_dir`; `add_eos` records
    whether its answers end with EOS (for `tessera tune --evaluate`)."""
    spec = TaskSpec(name=task)
    table = read_peft_adapter(adapter_dir)
    hidden = read_manifest(base_checkpoint).model.hidden_size
    if table.shape[1] != hidden:
        raise PromptTableError(f"{adapter_dir}: token_dim {table.shape[1]} does not match the "
                               f"hidden size {hidden} of {base_checkpoint}; it was trained on "
                               "another model")
    return write_prompt_table(out_dir, {task: table}, base_checkpoint=base_checkpoint,
                              tasks={task: spec.to_dict()}, method="peft-import",
                              extra={"imported_from": str(Path(adapter_dir).resolve()),
                                     "add_eos": add_eos})
