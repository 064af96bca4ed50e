"""The learning-rate schedule never rises above --lr; min_lr defaults to a tenth of lr."""

import dataclasses

import pytest

from tessera.core.config import ConfigError, TrainSchedule
from tessera.training.config import TrainConfig, load_config
from tessera.training.optim import learning_rate
from tessera.training.run_plan import optimizer_settings
from tessera.tuning.config import TuneRunConfig
from tessera.tuning.config import load_config as load_tune_config


def schedule(cfg: TrainConfig) -> list[float]:
    """The rates a run of the written `cfg` steps through, as its plan resolves them."""
    settings = optimizer_settings(cfg, TrainSchedule())
    return [learning_rate(step, settings) for step in range(cfg.steps + 5)]


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("lr", [1e-5, 1e-4, 1e-3, 3e-3, 3e-2])
def test_schedule_never_exceeds_lr_with_the_default_min_lr(lr, decay):
    cfg, _ = load_config(["--lr", str(lr), "--decay", decay, "--steps", "50"])
    rates = schedule(cfg.train)
    assert max(rates) <= lr
    if decay != "constant":
        assert rates[-1] == pytest.approx(lr / 10, rel=1e-12)


def test_readme_lora_example_ends_below_its_lr():
    cfg, _ = load_tune_config(["--checkpoint", "BASE", "--data", "train.jsonl", "--method", "lora",
                               "--lr", "1e-3", "--steps", "40"])
    rates = schedule(cfg.train)
    assert max(rates) <= 1e-3
    assert rates[-1] == 1e-4


def test_default_schedules_are_the_ones_they_were():
    """The pretraining (and demo) default ended at 3e-4 and tuning's at 3e-3, bit for bit."""
    pretrain = TrainConfig()
    assert schedule(pretrain) == schedule(dataclasses.replace(pretrain, min_lr=3e-4))
    tune = TuneRunConfig().train
    assert schedule(tune) == schedule(dataclasses.replace(tune, min_lr=3e-3))


def test_an_explicit_min_lr_is_kept():
    cfg, _ = load_config(["--lr", "1e-3", "--min-lr", "0", "--steps", "10", "--warmup-steps", "0"])
    assert schedule(cfg.train)[-1] == 0.0


def test_min_lr_above_lr_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^--min-lr 0.003 is above --lr 0.001[^\n]*$"):
        load_config(["--lr", "1e-3", "--min-lr", "3e-3"])
    with pytest.raises(ConfigError, match="--min-lr 0.01 is above --lr 0.001"):
        load_tune_config(["--lr", "1e-3", "--min-lr", "1e-2"])


def test_min_lr_above_lr_in_yaml_is_refused(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("train: {lr: 1.0e-5}\n")
    cfg, _ = load_config(["--config", str(run)])
    assert max(schedule(cfg.train)) <= 1e-5
    run.write_text("train: {lr: 1.0e-5, min_lr: 1.0e-4}\n")
    with pytest.raises(ConfigError, match="above --lr"):
        load_config(["--config", str(run)])
