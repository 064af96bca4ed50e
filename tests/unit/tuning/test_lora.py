"""LoRA tuning in one process: the base stays bit-identical and only A/B get gradients; tuning
checkpoints hold only the adapter and resume exactly; the adapter directory evaluates to the
run's metrics; `--merge` writes a checkpoint whose logits equal base + adapter; LoRA beats
prompt tuning at equal steps on the held-out `kind` task; bad input fails before any write."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open

from tessera.core import save_checkpoint
from tessera.core.checkpoint import CheckpointReader, load_checkpoint
from tessera.core.fingerprint import base_fingerprint
from tessera.core.lora import attach_lora, is_lora_parameter
from tessera.core.lora_format import load_adapter
from tessera.training.loop import train_step
from tessera.tuning import cli
from tessera.tuning.config import load_config
from tessera.tuning.loop import prepare_inputs, setup, train_batch, tune
from tessera.tuning.lora_state import STATE_FILE
from tests.unit.tuning.tuning_helper import tune_argv

LORA = ("--method", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all",
        "--lr", "1e-2")


def test_base_is_bit_identical_and_only_adapter_parameters_get_gradients(base, data, tmp_path):
    cfg, _ = load_config(tune_argv(base, tmp_path / "run", data["kind_train"], None, *LORA,
                                   "--lora-dropout", "0.1", "--micro-batches", "2"))
    inputs = prepare_inputs(cfg, train=cfg.tune.data)
    t = setup(cfg, inputs)
    model = t.job.stages[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    reader = CheckpointReader(base)
    for step in range(3):
        tokens, labels = train_batch(t, inputs.train, step)
        train_step(t.job, step, tokens, labels)
        for name, p in model.named_parameters():
            assert (p.grad is not None) == is_lora_parameter(name), name
            # B starts at zero, so A's first gradient is zero (as in PEFT); then both move.
            if is_lora_parameter(name) and (step or "lora_B" in name):
                assert p.grad.abs().sum() > 0, (step, name)
    optimized = {id(p) for group in t.job.optimizer.param_groups for p in group["params"]}
    assert len(optimized) == 2 * 4 * 4  # A and B of qkv, wo, w1, w2 in each of 4 layers
    for name, p in model.named_parameters():
        if is_lora_parameter(name):
            assert id(p) in optimized and not torch.equal(p, before[name]), name
        else:
            assert id(p) not in optimized and torch.equal(p, before[name]), name
            assert torch.equal(p, reader.global_tensor(name)), name


@pytest.fixture(scope="module")
def run(base, data, tmp_path_factory):
    """An 8-step LoRA run with checkpoints at steps 4 and 8: its directory, summary and flags."""
    out = tmp_path_factory.mktemp("lora") / "whole"
    extra = (*LORA, "--steps", "8", "--save-interval", "4", "--keep-last", "5", "--eval-batches",
             "2")
    cfg, _ = load_config(tune_argv(base, out, data["kind_train"], data["kind_valid"], *extra))
    return out, tune(cfg), extra


def test_checkpoints_hold_only_the_adapter_and_resume_exactly(base, data, run, tmp_path):
    whole, summary, extra = run
    state = whole / "checkpoints" / "step-00000004"
    with safe_open(str(state / STATE_FILE), framework="pt") as f:
        names = list(f.keys())
    assert names and all(is_lora_parameter(n.split("/")[-1]) for n in names)
    assert any(n.startswith("exp_avg/") for n in names)
    part = tmp_path / "part"  # the run as it was after its step-4 checkpoint
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(state, part / "checkpoints" / state.name)
    cfg, _ = load_config(tune_argv(base, part, data["kind_train"], None, *extra, "--resume"))
    resumed = tune(cfg)
    assert resumed["losses"] == summary["losses"][4:]
    _, a = load_adapter(whole / "adapter")
    _, b = load_adapter(part / "adapter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_with_dropout_resumes_bit_for_bit(base, data, tmp_path):
    """The checkpoint carries the RNG states, so the resumed run draws the same masks."""
    extra = (*LORA, "--lora-dropout", "0.1", "--steps", "6", "--save-interval", "3",
             "--keep-last", "5")
    whole = tune(load_config(tune_argv(base, tmp_path / "whole", data["kind_train"], None,
                                       *extra))[0])
    state = tmp_path / "whole" / "checkpoints" / "step-00000003"
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(state, part / "checkpoints" / state.name)
    torch.manual_seed(1234)  # whatever the process drew since: the checkpoint's states win
    resumed = tune(load_config(tune_argv(base, part, data["kind_train"], None, *extra,
                                         "--resume"))[0])
    assert resumed["losses"] == whole["losses"][3:]
    _, a = load_adapter(tmp_path / "whole" / "adapter")
    _, b = load_adapter(part / "adapter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_adapter_evaluates_and_merges_to_base_plus_adapter(base, data, run, tmp_path, capsys):
    whole, summary, _ = run
    adapter = whole / "adapter"
    config, tensors = load_adapter(adapter)
    assert config.base_fingerprint == base_fingerprint(base) and len(config.modules) == 16
    assert (config.rank, config.alpha, config.targets) == (4, 8.0, ("all",))
    after = summary["after"]["kind"]
    capsys.readouterr()
    assert cli.main(["--evaluate", "--adapter", str(adapter), "--data", str(data["kind_valid"]),
                     "--add-eos", "false", "--eval-batches", "2", "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert f"{after['loss']:.4f}" in table and f"{100 * after['accuracy']:.1f}%" in table

    merged_dir = tmp_path / "merged"
    assert cli.main(["--merge", str(adapter), "--output", str(merged_dir)]) == 0
    merged, plain = load_checkpoint(merged_dir), load_checkpoint(base)
    for name, p in plain.named_parameters():  # only the adapted weights changed
        changed = not torch.equal(p, dict(merged.named_parameters())[name])
        assert changed == (name.removesuffix(".weight") in config.modules), name
    attach_lora([plain], config, tensors=tensors)
    ids = torch.randint(0, plain.config.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), plain(ids), rtol=1e-5, atol=1e-5)


def test_lora_beats_prompt_tuning_at_equal_steps(base, data, tmp_path, capsys):
    """The held-out `kind` split, 12 steps each, each at its own good learning rate.

    Exact match saturates: on this two-label task both methods can answer every held-out
    example, so accuracy alone cannot rank them (LoRA must only not be worse). The held-out
    loss keeps measuring how much probability each puts on the right label, and there LoRA,
    which adapts every block, must be strictly lower than eight virtual tokens.
    """
    figures = {}
    for method, flags in (("lora", LORA), ("prompt-tuning", ("--method", "prompt-tuning",
                                                             "--lr", "1e-1"))):
        cfg, _ = load_config(tune_argv(base, tmp_path / method, data["kind_train"],
                                       data["kind_valid"], *flags, "--steps", "12"))
        after = tune(cfg)["after"]["kind"]
        figures[method] = after["accuracy"], after["loss"]
    with capsys.disabled():
        print("\n  held-out 'kind' after 12 steps (exact match, loss): " +
              ", ".join(f"{m} {a:.1%} {loss:.4f}" for m, (a, loss) in figures.items()))
    (lora_acc, lora_loss), (prompt_acc, prompt_loss) = figures["lora"], figures["prompt-tuning"]
    assert lora_acc >= 0.9 and lora_acc >= prompt_acc, figures
    assert lora_loss < prompt_loss, figures


def test_yaml_and_flags_configure_lora(tmp_path, capsys):
    config = tmp_path / "lora.yaml"
    config.write_text("tune:\n  method: lora\n  lora_rank: 2\n  lora_alpha: 4\n"
                      "  lora_targets: qkv,w2\ntrain:\n  lr: 1e-3\n")
    cfg, _ = load_config(["--config", str(config), "--lora-dropout", "0.1"])
    t = cfg.tune
    assert (t.method, t.lora_rank, t.lora_alpha, t.lora_dropout, t.lora_targets) == (
        "lora", 2, 4.0, 0.1, "qkv,w2")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "--lora-targets" in out and "--merge ADAPTER_DIR" in out and "--method lora" in out


def _fails(argv, capsys, *needles):
    capsys.readouterr()
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # a flag out of range: argparse's error
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err


def test_bad_input_fails_before_anything_is_written(base, data, run, tmp_path, capsys):
    out = tmp_path / "out"
    argv = tune_argv(base, out, data["kind_train"], None, *LORA)
    _fails([*argv, "--lora-rank", "0"], capsys, "argument --lora-rank: must be >= 1, got 0")
    _fails([*argv, "--lora-dropout", "1.5"], capsys,
           "argument --lora-dropout: must be in [0, 1), got 1.5")
    _fails([*argv, "--lora-targets", "qkv,q_proj"], capsys, "'q_proj' matches no module",
           "layers.N.")
    _fails([*argv, "--lora-targets", "layers.("], capsys, "not a valid regular expression")
    _fails([*argv, "--export", "peft"], capsys, "tessera convert --to peft")
    assert not out.exists()

    # An adapter for another base: refused by --merge and --evaluate, nothing written.
    model = load_checkpoint(base)
    with torch.no_grad():
        model.layers["0"].attention.wo.weight.mul_(1.5)
    other = save_checkpoint(tmp_path / "other", model)
    adapter = str(run[0] / "adapter")
    _fails(["--merge", adapter, "--checkpoint", str(other), "--output", str(out)], capsys,
           "this LoRA adapter was tuned on", "tune it again on this base")
    _fails(["--evaluate", "--adapter", adapter, "--checkpoint", str(other), "--data",
            str(data["kind_valid"]), "--device", "cpu"], capsys, "this LoRA adapter was tuned")
    _fails(["--merge", adapter, "--checkpoint", str(base)], capsys, "--merge needs --output")
    assert not out.exists()
    out.mkdir()
    _fails(["--merge", adapter, "--output", str(out)], capsys, "already exists")
    assert list(out.iterdir()) == []
