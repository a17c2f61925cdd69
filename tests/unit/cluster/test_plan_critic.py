"""PPO's critic in the config (learner.critic) and in the resource plan (a second engine on every rank)."""

from __future__ import annotations

import pytest

from cluster.config import load_config
from cluster.planning.memory_model import add_critic_gib, learner_memory_gib
from cluster.planning.plan import num_params, plan
from learner.objectives import resolve_objective
from tests.helpers import REPO_ROOT

GIB = 2**30
TINY = str(REPO_ROOT / "configs" / "tiny_moe.yaml")


def test_critic_memory_hand_values():
    """float32, ZeRO-2 over 2 ranks, P = 2**30: the critic's weights 4, gradients 4/2, AdamW moments 8/2 GiB."""
    lm = learner_memory_gib(float(GIB), zero_stage=2, dtype="float32", world_size=2)
    out = add_critic_gib(lm, float(GIB), zero_stage=2, dtype="float32", world_size=2)
    assert out["critic"] == 4 + 2 + 4
    assert out["total"] == lm["total"] + 10
    # ZeRO-3 bf16 over 4: weights 2/4, gradients 4/4, optimizer 12/4; offloaded: the optimizer leaves the device
    lm3 = learner_memory_gib(float(GIB), zero_stage=3, dtype="bfloat16", world_size=4)
    assert add_critic_gib(lm3, float(GIB), zero_stage=3, dtype="bfloat16", world_size=4)["critic"] == 0.5 + 1 + 3
    assert add_critic_gib(lm3, float(GIB), zero_stage=3, dtype="bfloat16", world_size=4,
                          offload_optimizer=True)["critic"] == 0.5


def test_plan_of_ppo_adds_the_critic_to_every_rank():
    base = load_config(TINY, [])
    ppo = load_config(TINY, ["learner.algorithm=ppo"])
    p = num_params(base)
    got, want = plan(ppo)["memory"], plan(base)["memory"]
    critic = got["learner_per_rank_gib"]["critic"]
    assert critic == round((4 * p + 4 * p / 2 + 8 * p / 2) / GIB, 2)  # float32, ZeRO-2, N=2
    assert "critic" not in want["learner_per_rank_gib"]
    assert got["learner_per_rank_gib"]["total"] > want["learner_per_rank_gib"]["total"]
    assert "PPO critic" in got["learner_formula"]


def test_ppo_config_defaults_and_refusals():
    cfg = load_config(TINY, ["learner.algorithm=ppo"]).learner
    c = cfg.critic
    assert (c.gamma, c.lam, c.cliprange_value, c.whiten_advantages, c.lr, c.model_path) == (1.0, 1.0, 0.5, True, None, None)
    o = resolve_objective("ppo")
    assert (o.clip_low, o.clip_high, o.loss_agg, o.sequence_level) == (0.2, 0.2, "token_mean", False)
    for bad in ("learner.critic.gamma=1.5", "learner.critic.lam=-0.1", "learner.critic.cliprange_value=0",
                "learner.critic.lr=0", "learner.critic.nope=1"):
        with pytest.raises(Exception, match=bad.split("=")[0].split(".")[-1]):
            load_config(TINY, ["learner.algorithm=ppo", bad])
