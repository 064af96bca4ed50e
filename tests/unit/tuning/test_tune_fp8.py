"""`tessera tune --precision fp8` (emulated on CPU): the frozen base runs its block linears in
FP8 and stays bit-identical, only the prompts get gradients, and the losses follow the bf16
run's within e4m3's relative rounding, 2**-4, per step.

What FP8 changes against bf16 is the rounding of the attention linears' inputs and weights:
e4m3 keeps 3 mantissa bits, so each element moves by at most half a step, 2**-4 = 6.25 %
relative (bf16: 2**-8). The bound is that scale, RTOL = 2**-4: a run that follows bf16 moves
its loss by less than FP8 moves any operand. It is wider than pretraining's 1e-2 (tests/unit/
training/test_fp8_pretrain.py) because the tuning loss is the mean over a few answer tokens of
a trained model, which moves more under rounding: bf16 itself sat 0.4-0.8 % from fp32; FP8 sat
0.8-2.0 % from bf16 on AVX2 hosts (1.9 % and 2.0 % under ATEN_CPU_CAPABILITY default and avx2)
and 3.06 % on an AVX-512 host, where the old bound, 3e-2, failed. A scale that saturates (a
wrong amax) or a product left unscaled moves the loss by far more.
"""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from tessera.core.checkpoint import CheckpointReader
from tessera.core.fp8_training import EmulatedFp8
from tessera.core.prompt_table import read_prompt_table
from tessera.training.loop import train_step
from tessera.tuning.checkpoint import FP8_FILE, read_tuning_meta
from tessera.tuning.config import load_config
from tessera.tuning.loop import prepare_inputs, setup, train_batch, tune
from tests.unit.tuning.tuning_helper import tune_argv

STEPS = 3
RTOL = 2**-4  # e4m3's largest relative rounding of one element (module docstring)


LORA = ("--method", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all",
        "--lr", "1e-2")


def _losses(base, data, run, *precision: str, method=("--method", "prompt-tuning")):
    cfg, _ = load_config(tune_argv(base, run, data["kind_train"], None, *method,
                                   "--precision", *precision))
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    t = setup(cfg, inputs)
    losses = []
    for step in range(STEPS):
        tokens, labels = train_batch(t, inputs.train, step)
        losses.append(train_step(t.job, step, tokens, labels)["loss"])
    return t, losses


def test_fp8_tuning_follows_bf16_on_a_frozen_base(base, data, tmp_path):
    _, bf16 = _losses(base, data, tmp_path / "bf16", "bf16")
    t, fp8 = _losses(base, data, tmp_path / "fp8", "fp8")
    model = t.job.stages[0]
    # the base's MLP (ffn 172) is not a multiple of 16: attention only, the rest listed
    assert sorted(t.job.fp8.layers) == [f"layers.{i}.attention.{n}" for i in range(4)
                                        for n in ("wo", "wqkv")]
    assert len(t.job.fp8.fallback) == 8
    assert isinstance(model.layers["0"].attention.wqkv.format, EmulatedFp8)
    rel = [abs(a - b) / b for a, b in zip(fp8, bf16)]
    print(f"\ntuning losses bf16 {bf16}\n             fp8  {fp8}\n  max rel. diff {max(rel):.2e} "
          f"(bound {RTOL:.2e})")
    assert 0 < max(rel) < RTOL
    reader = CheckpointReader(base)
    for name, p in model.named_parameters():
        hooked = name.startswith("embedding_hook.")
        assert (p.grad is not None) == hooked, name
        if not hooked:
            assert torch.equal(p, reader.global_tensor(name)), name


def test_fp8_tuning_resume_is_exact(base, data, tmp_path):
    """The tuning checkpoint holds the base's FP8 state (amax histories, scales) and recipe;
    steps 1-2, save, 3-4 resumed end on the straight run's prompts, bit for bit."""
    extra = ("--method", "prompt-tuning", "--precision", "fp8", "--fp8-amax-history-len", "2",
             "--steps", "4", "--save-interval", "2", "--keep-last", "5")
    whole = tmp_path / "whole"
    cfg, _ = load_config(tune_argv(base, whole, data["kind_train"], None, *extra))
    tune(cfg)
    state = whole / "checkpoints" / "step-00000002"
    meta = read_tuning_meta(state)
    assert (meta["fp8"]["backend"], meta["fp8"]["recipe"], meta["fp8"]["amax_history_len"]) == (
        "emulated", "delayed", 2)
    fp8_state = load_file(str(state / FP8_FILE))
    assert sorted(fp8_state) == sorted(f"layers.{i}.attention.{n}.{k}" for i in range(4)
                                       for n in ("wo", "wqkv") for k in ("amax_history", "scale"))
    assert all((v != 1).any() for k, v in fp8_state.items() if k.endswith(".scale"))

    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(state, part / "checkpoints" / state.name)
    cfg, _ = load_config(tune_argv(base, part, data["kind_train"], None, *extra, "--resume"))
    tune(cfg)
    _, a = read_prompt_table(whole)
    _, b = read_prompt_table(part)
    assert torch.equal(a["kind"], b["kind"])


def test_fp8_lora_follows_bf16_lora_and_trains_only_the_factors(base, data, tmp_path):
    """The base's linears run in FP8 with the adapter's term added in high precision: the
    losses follow the bf16 LoRA run's within e4m3's rounding, the base stays bit-identical."""
    _, bf16 = _losses(base, data, tmp_path / "bf16", "bf16", method=LORA)
    t, fp8 = _losses(base, data, tmp_path / "fp8", "fp8", method=LORA)
    model = t.job.stages[0]
    assert isinstance(model.layers["0"].attention.wqkv.format, EmulatedFp8)
    assert model.layers["0"].attention.wqkv.adapter is not None
    rel = [abs(a - b) / b for a, b in zip(fp8, bf16)]
    print(f"\nLoRA losses bf16 {bf16}\n            fp8  {fp8}\n  max rel. diff {max(rel):.2e}")
    assert 0 < max(rel) < RTOL
    reader = CheckpointReader(base)
    for name, p in model.named_parameters():
        factor = ".lora_A." in name or ".lora_B." in name
        assert (p.grad is not None) == factor, name
        if factor:
            assert p.grad.abs().sum() > 0, name
        else:
            assert torch.equal(p, reader.global_tensor(name)), name


def test_fp8_lora_with_dropout_resumes_bit_for_bit(base, data, tmp_path):
    """A LoRA checkpoint holds the FP8 state and the RNG states: resumed at step 2 of 4, the
    adapter ends as the straight run's, bit for bit."""
    from tessera.core.lora_format import load_adapter

    extra = (*LORA, "--lora-dropout", "0.1", "--precision", "fp8", "--fp8-amax-history-len",
             "2", "--steps", "4", "--save-interval", "2", "--keep-last", "5")
    whole = tmp_path / "whole"
    straight = tune(load_config(tune_argv(base, whole, data["kind_train"], None, *extra))[0])
    state = whole / "checkpoints" / "step-00000002"
    assert sorted(load_file(str(state / FP8_FILE))) == sorted(
        f"layers.{i}.attention.{n}.{k}" for i in range(4) for n in ("wo", "wqkv")
        for k in ("amax_history", "scale"))
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(state, part / "checkpoints" / state.name)
    resumed = tune(load_config(tune_argv(base, part, data["kind_train"], None, *extra,
                                         "--resume"))[0])
    assert resumed["losses"] == straight["losses"][2:]
    _, a = load_adapter(whole / "adapter")
    _, b = load_adapter(part / "adapter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
