"""Every loss knob is a flag whose default is the `LossConfig` field's own, and the flags reach
the config."""

from __future__ import annotations

from dataclasses import fields

import pytest

from molt_proxy.cli import main, parser
from trainer.config import LossConfig, TrainerConfig, config_from_args


def loss_of(*flags: str) -> LossConfig:
    return config_from_args(parser().parse_args(["serve", "--model", "m", *flags]), "u", "m").loss


def test_every_loss_field_has_a_flag_defaulting_to_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    for f in fields(LossConfig):
        assert "--" + f.name.replace("_", "-") in shown
    assert loss_of() == LossConfig()


def test_loss_flags_reach_the_config() -> None:
    loss = loss_of(
        *("--clip-low", "0.1", "--clip-high", "0.4", "--is-low", "0.25", "--is-high", "3"),
        *("--is-mode", "mask", "--is-level", "sequence", "--max-staleness", "none"),
    )
    assert loss == LossConfig(
        clip_low=0.1,
        clip_high=0.4,
        is_low=0.25,
        is_high=3.0,
        is_mode="mask",
        is_level="sequence",
        max_staleness=None,
    )
    assert loss_of("--max-staleness", "2").max_staleness == 2


def test_a_bad_loss_flag_is_refused() -> None:
    with pytest.raises(SystemExit):
        loss_of("--is-mode", "clip")
    with pytest.raises(SystemExit):
        loss_of("--clip-low", "lots")
    with pytest.raises(ValueError, match="clip_low must be in"):
        loss_of("--clip-low", "1.5")


def test_trainer_config_default_loss_is_loss_config_default() -> None:
    assert TrainerConfig(proxy_url="u", model="m", out_dir="o").loss == LossConfig()


def test_credit_flags_reach_the_config() -> None:
    args = parser().parse_args(["serve", "--model", "m", "--turn-discount", "0.9", "--drop-flat-groups"])
    config = config_from_args(args, "u", "m")
    assert (config.turn_discount, config.drop_flat_groups) == (0.9, True)
    default = config_from_args(parser().parse_args(["serve", "--model", "m"]), "u", "m")
    assert (default.turn_discount, default.drop_flat_groups) == (None, False)
    with pytest.raises(ValueError, match="turn_discount must be in"):
        TrainerConfig(proxy_url="u", model="m", out_dir="o", turn_discount=1.5)
    with pytest.raises(ValueError, match="num_workers 1"):
        TrainerConfig(proxy_url="u", model="m", out_dir="o", num_workers=2, loss=LossConfig(kl_coef=0.1))


def test_train_only_flag_reaches_the_config_and_is_refused_where_it_cannot_apply() -> None:
    args = parser().parse_args(["serve", "--model", "m", "--train-only", "lm_head", "model.norm"])
    assert config_from_args(args, "u", "m").train_only == ("lm_head", "model.norm")
    assert config_from_args(parser().parse_args(["serve", "--model", "m"]), "u", "m").train_only == ()
    with pytest.raises(ValueError, match="FSDP"):
        TrainerConfig(proxy_url="u", model="m", out_dir="o", num_workers=2, train_only=("lm_head",))
    with pytest.raises(ValueError, match="LoRA"):
        TrainerConfig(proxy_url="u", model="m", out_dir="o", lora_rank=4, train_only=("lm_head",))
