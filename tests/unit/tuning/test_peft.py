"""PEFT interop against the real `peft` and `transformers` (local models, nothing downloaded).

A Tessera prompt table exported with `--export peft` loads with `PeftModel.from_pretrained` on the
Hugging Face export of the base and gives Tessera's logits (fp32, 1e-4); an adapter trained with
`peft` itself imports with `--import-peft` and gives PEFT's logits in Tessera.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tessera.converters.hf_io import export_hf  # noqa: E402
from tessera.core import ModelConfig, build_model, save_checkpoint  # noqa: E402
from tessera.core.checkpoint import load_checkpoint  # noqa: E402
from tessera.core.prompt_table import load_prompt_tables, write_prompt_table  # noqa: E402
from tessera.core.prompts import attach_prompts, fixed_prompts  # noqa: E402
from tessera.tuning import cli  # noqa: E402
from tessera.tuning.data import TaskSpec  # noqa: E402
from tessera.tuning.peft_format import export_peft  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations


@pytest.fixture(scope="module")
def hf_base(base, tmp_path_factory) -> Path:
    return export_hf(base, tmp_path_factory.mktemp("hf") / "base")


def _hf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _tessera_logits(base: Path, tables: dict[str, torch.Tensor], task: str,
                    prompt: list[int]) -> torch.Tensor:
    model = load_checkpoint(base, dtype=torch.float32)
    hook = attach_prompts(model, fixed_prompts(tables))
    hook.set_rows([task])
    n = tables[task].shape[0]
    return model(torch.tensor([[0] * n + prompt]))[0]


def _prompts(base: Path) -> list[list[int]]:
    from tessera.tuning.loop import base_tokenizer

    tok = base_tokenizer(str(base))
    return [tok.encode(t) for t in ("we saw a red box", "they like two small dogs", "i want")]


def test_exported_table_loads_in_peft_with_tesseras_logits(base, hf_base, tmp_path):
    table = {"kind": torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 0.3}
    write_prompt_table(tmp_path / "table", table, base_checkpoint=base,
                       tasks={"kind": TaskSpec("kind").to_dict()}, method="prompt-tuning")
    assert cli.main(["--export", "peft", "--prompts", str(tmp_path / "table"), "--output",
                     str(tmp_path / "peft")]) == 0
    model = peft.PeftModel.from_pretrained(_hf(hf_base), tmp_path / "peft" / "kind").eval()
    tables = load_prompt_tables(tmp_path / "table", base)
    for prompt in _prompts(base):
        with torch.no_grad():
            theirs = model(input_ids=torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(theirs, _tessera_logits(base, tables, "kind", prompt), **TOL)
        zero = {"kind": torch.zeros(8, 64)}  # another prompt: clearly other logits
        assert (theirs - _tessera_logits(base, zero, "kind", prompt)).abs().max() > 1e-2


def test_adapter_trained_with_peft_imports_with_peft_logits(base, hf_base, tmp_path):
    torch.manual_seed(0)
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=6,
                                     prompt_tuning_init="RANDOM")
    model = peft.get_peft_model(_hf(hf_base), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = torch.tensor([p[:3] for p in _prompts(base)])
    for _ in range(5):  # PEFT's own training: its forward, its loss, its optimizer
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(tmp_path / "adapter")
    assert cli.main(["--import-peft", str(tmp_path / "adapter"), "--checkpoint", str(base),
                     "--task", "qa", "--output", str(tmp_path / "imported")]) == 0
    tables = load_prompt_tables([tmp_path / "imported"], base)
    assert tables["qa"].shape == (6, 64)
    model.eval()
    for prompt in _prompts(base):
        with torch.no_grad():
            theirs = model(input_ids=torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(theirs, _tessera_logits(base, tables, "qa", prompt), **TOL)


def test_learned_position_models_match_too(tmp_path):
    """GPT-2 adds position embeddings to PEFT's prompt embeddings; the hook does the same."""
    config = ModelConfig.from_name("gpt2-tiny", vocab_size=101, num_layers=2)
    base = save_checkpoint(tmp_path / "gpt2", build_model(config, seed=3))
    hf = export_hf(base, tmp_path / "hf")
    table = {"t": torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 0.3}
    write_prompt_table(tmp_path / "table", table, base_checkpoint=base, tasks={},
                       method="prompt-tuning")
    export_peft(tmp_path / "table", tmp_path / "peft")
    model = peft.PeftModel.from_pretrained(_hf(hf), tmp_path / "peft" / "t").eval()
    prompt = [5, 17, 33, 2, 90]
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(theirs, _tessera_logits(base, table, "t", prompt), **TOL)
