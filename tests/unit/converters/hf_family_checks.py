"""The checks every converted Hugging Face decoder family passes, against transformers itself:
a random-weight HF model built locally from a config (nothing downloaded) imports with its
logits, greedy generation through the serving engine equals `generate`, the export gives the
same logits again, a tp2 reshard keeps them, and a peft LoRA round-trips unmerged."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tessera.converters.cli import main
from tessera.converters.reshard import reshard_checkpoint
from tessera.core.checkpoint import load_checkpoint
from tessera.core.lora import attach_lora
from tessera.core.lora_format import load_adapter
from tessera.serving.engine import LLMEngine
from tessera.serving.engine.executor import LocalExecutor
from tessera.serving.engine.kv_config import KVCacheConfig
from tessera.serving.engine.runner import ModelRunner
from tessera.serving.types import GenerationRequest, SamplingParams
from tests.serving_helper import collect


def convert(*argv: object) -> None:
    assert main([str(a) for a in argv]) == 0


@torch.no_grad()
def perturbed(model, scale: float = 0.05):
    """`model` (a transformers model) in fp32 eval mode with every weight, norm and bias moved
    by noise, so a swapped, dropped or mis-scaled tensor shows in the logits."""
    torch.manual_seed(0)
    for p in model.parameters():
        p.add_(torch.randn_like(p) * scale)
    return model.float().eval()


def ids(vocab: int, length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logit_diff(hf_model, tessera_model, tokens: torch.Tensor) -> float:
    return (hf_model(tokens).logits - tessera_model(tokens)).abs().max().item()


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy `generate` of `n` tokens, never stopping early."""
    hf_model.generation_config.eos_token_id = None
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, num_beams=1, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_greedy(model, prompt: list[int], n: int, context: int | None = None) -> list[int]:
    """Greedy tokens of the serving engine (paged KV cache, one request), with a context of
    `context` positions (None: the model's max_position_embeddings)."""
    runner = ModelRunner(model, 1, max_seq=context)
    with LLMEngine(LocalExecutor(runner)) as engine:
        result = collect(engine, [GenerationRequest("r", prompt, SamplingParams(
            max_tokens=n, temperature=0, ignore_eos=True))])[0]
    return result.token_ids


def engine_run(model, prompt: list[int], n: int, kv: KVCacheConfig | None = None
               ) -> tuple[list[int], dict[str, float]]:
    """Greedy tokens of one request through the serving engine with the KV cache `kv` (None:
    the slot cache), and the engine's stats after it."""
    runner = ModelRunner(model, 1, kv=kv)
    with LLMEngine(LocalExecutor(runner), kv=kv) as engine:
        result = collect(engine, [GenerationRequest("r", prompt, SamplingParams(
            max_tokens=n, temperature=0, ignore_eos=True))])[0]
        return result.token_ids, engine.stats()


def export_matches(ckpt: Path, out: Path, hf_model, tokens: torch.Tensor, transformers) -> None:
    """`tessera convert --to hf` of `ckpt` loads in transformers with `hf_model`'s config and
    the logits of the imported checkpoint (which the import checks equal `hf_model`'s; a fresh
    model, since transformers' dynamic rope remembers the longest sequence it has run)."""
    convert("--to", "hf", "--input", ckpt, "--output", out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    want, got = hf_model.config.to_dict(), reloaded.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        want.pop(key, None), got.pop(key, None)
    if want.get("head_dim") is None and "head_dim" in got:  # unset: hidden / heads
        want["head_dim"] = want["hidden_size"] // want["num_attention_heads"]
    assert got == want, {k: (want.get(k), got.get(k)) for k in set(want) | set(got)
                         if want.get(k) != got.get(k)}
    with torch.no_grad():
        diff = (reloaded(tokens).logits - load_checkpoint(ckpt)(tokens)).abs().max().item()
    assert diff <= 1e-4, diff


def tp2_keeps_logits(ckpt: Path, out: Path, tokens: torch.Tensor, pp: int = 1) -> None:
    """A tp2 (x `pp` stages) reshard of `ckpt` holds per-rank shards and gives the same
    logits, bit for bit."""
    with torch.no_grad():
        want = load_checkpoint(ckpt)(tokens)
    reshard_checkpoint(ckpt, out, tp=2, pp=pp, progress=False)
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    assert (manifest["layout"]["tp"], manifest["layout"]["pp"]) == (2, pp)
    with torch.no_grad():
        assert torch.equal(load_checkpoint(out)(tokens), want)


def peft_round_trip(hf_dir: Path, ckpt: Path, root: Path, targets: list[str],
                    tokens: torch.Tensor, transformers, peft) -> None:
    """A LoRA trained a few steps with peft on `hf_dir` imports (`--from peft`) as an adapter
    whose unmerged Tessera model gives `PeftModel`'s logits, and exports back (`--to peft`) to
    one that does too."""
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float()
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets,
                                                    task_type="CAUSAL_LM"))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
    model.save_pretrained(root / "trained")
    convert("--from", "peft", "--input", root / "trained", "--checkpoint", ckpt, "--output",
            root / "adapter")
    convert("--to", "peft", "--input", root / "adapter", "--checkpoint", ckpt, "--output",
            root / "again")
    adapter, tensors = load_adapter(root / "adapter")
    ours = load_checkpoint(ckpt).eval()
    attach_lora([ours], adapter, tensors=tensors)
    for trained in ("trained", "again"):
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float()
        reference = peft.PeftModel.from_pretrained(base, root / trained).eval()
        with torch.no_grad():
            want = reference(tokens).logits
            with reference.disable_adapter():  # the adapter must matter
                plain = reference(tokens).logits
            got = ours(tokens)
        diff, effect = (got - want).abs().max().item(), (plain - want).abs().max().item()
        assert diff <= 1e-4 and effect > 1e-3, (trained, diff, effect)
