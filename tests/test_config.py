"""The config schema: defaults load, bad keys/values/combinations stop with errors naming key and value."""

import pytest

from cluster.config import ConfigError, load_config

CONFIGS = ["configs/tiny_moe.yaml", "configs/gsm8k_tiny.yaml"]


@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.learner.algorithm in ("gspo", "gspo_token", "grpo")


def test_defaults_follow_the_paper():
    cfg = load_config("configs/tiny_moe.yaml")
    assert cfg.learner.algorithm == "gspo"
    assert cfg.learner.clip_low is None and cfg.learner.clip_high is None  # objective defaults: 3e-4 / 4e-4
    assert cfg.learner.kl_coef == 0.0
    assert cfg.learner.num_minibatches == 4
    assert cfg.learner.normalize_adv_std is True


def test_overrides_are_typed():
    cfg = load_config("configs/tiny_moe.yaml", ["trainer.total_steps=3", "rollout.num_engines=2", "learner.zero_stage=3"])
    assert cfg.trainer.total_steps == 3 and cfg.rollout.num_engines == 2 and cfg.learner.zero_stage == 3


@pytest.mark.parametrize(
    "override, needle",
    [
        ("learner.no_such_key=1", "learner.no_such_key"),
        ("trainer.total_steps=abc", "trainer.total_steps"),
        ("trainer.group_size=1", "trainer.group_size"),
        ("learner.clip_low=-0.1", "learner.clip_low"),
        ("learner.micro_batch_size=7", "learner.micro_batch_size=7"),
        ("trainer.prompts_per_step=6", "trainer.prompts_per_step=6"),
        ("learner.loss_agg=token_mean", "learner.loss_agg='token_mean'"),
        ("rollout.top_p=0.9", "rollout.top_p=0.9"),
        ("learner.zero_stage=5", "learner.zero_stage"),
    ],
)
def test_bad_values_name_key_and_value(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny_moe.yaml", [override])
    assert needle in str(err.value)


def test_grpo_accepts_token_mean():
    cfg = load_config("configs/tiny_moe.yaml", ["learner.algorithm=grpo", "learner.loss_agg=token_mean"])
    assert cfg.learner.loss_agg == "token_mean"


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config("configs/tiny_moe.yaml", ["trainer.total_steps"])
