"""PPO's critic in the config (learner.critic) and in the resource plan (a second engine on every rank); LoRA's
adapter in the plan (its gradients and optimizer count the adapter's parameters)."""

from __future__ import annotations

import pytest

from cluster.config import load_config
from cluster.planning.memory_model import add_critic_gib, learner_memory_gib
from cluster.planning.memory_budget import num_params
from cluster.planning.plan import plan
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


def test_lora_trainable_params_hand_values():
    """r (in + out) per adapted projection and layer (Hu et al., Eq. 3): a dense shape with h=64, 4 heads and 2
    KV heads of 16, I=128, 2 layers, r=8: q 64+64, k 64+32, v 64+32, o 64+64 = 448 per layer; all-linear adds
    gate and up 64+128 each and down 128+64."""
    from cluster.config_sections import ModelShape
    from cluster.planning.memory_model import lora_trainable_params

    dense = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=100, intermediate_size=128)
    default = ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora_trainable_params(dense, 8, default) == 2 * 8 * 448
    assert lora_trainable_params(dense, 8, "all-linear") == 2 * 8 * (448 + 3 * 192)
    assert lora_trainable_params(dense, 8, ["q_proj", "q_proj"]) == 2 * 8 * 128
    moe = dense.model_copy(update={"intermediate_size": 0, "moe_intermediate_size": 32, "num_experts": 4,
                                   "num_experts_per_tok": 2})
    assert lora_trainable_params(moe, 8, default) == 2 * 8 * 448
    for targets in ("all-linear", ["q_proj", "gate_proj"], ["query_key_value"]):
        assert lora_trainable_params(moe, 8, targets) is None  # not known from the shape: the bound is counted
    assert lora_trainable_params(None, 8, default) is None and lora_trainable_params(dense, 0, default) is None


def test_lora_learner_memory_hand_values():
    """P = 2**30, T = 2**28, float32, ZeRO-2 over 2 ranks: weights 4 (P + T) = 5 GiB, gradients 4 T / 2 = 0.5,
    AdamW's two moments 8 T / 2 = 1."""
    lm = learner_memory_gib(float(GIB), zero_stage=2, dtype="float32", world_size=2, trainable_params=float(2**28))
    assert (lm["weights"], lm["gradients"], lm["optimizer"]) == (5.0, 0.5, 1.0)


SMALL = ["model.hidden_size=512", "model.num_layers=4", "model.num_experts=16", "model.moe_intermediate_size=512",
         "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.head_dim=64"]


def test_plan_of_lora_counts_the_adapter_in_gradients_and_optimizer():
    """The bench's small MoE (53.6 M parameters): full fine-tuning's weights, gradients and moments against a
    rank-512 adapter on the attention projections (T = 512 x 4 layers x (1024 + 768 + 768 + 1024), 7.3 M: large
    enough for the plan's 0.01-GiB rounding to see every term); an MLP target on an MoE is not counted from the
    shape, so the full model is (a bound), and the formula says so."""
    full = plan(load_config(TINY, SMALL))["memory"]
    lora = plan(load_config(TINY, [*SMALL, "learner.lora.rank=512"]))["memory"]
    cfg = load_config(TINY, SMALL).learner
    p = num_params(load_config(TINY, SMALL))
    t, n = 512 * 4 * (1024 + 768 + 768 + 1024), cfg.world_size
    got, was = lora["learner_per_rank_gib"], full["learner_per_rank_gib"]
    assert got["weights"] == round(4 * (p + t) / (n if cfg.zero_stage >= 3 else 1) / GIB, 2) > was["weights"]
    assert got["gradients"] == round(4 * t / (n if cfg.zero_stage >= 2 else 1) / GIB, 2) > 0
    assert got["optimizer"] == round(8 * t / (n if cfg.zero_stage >= 1 else 1) / GIB, 2) > 0
    assert got["gradients"] < was["gradients"] / 5 and got["optimizer"] < was["optimizer"] / 5
    assert f"LoRA r=512: {t} trainable parameters" in lora["learner_formula"]
    bound = plan(load_config(TINY, [*SMALL, "learner.lora.rank=64", "learner.lora.target_modules=[q_proj,gate_proj]"]))
    assert bound["memory"]["learner_per_rank_gib"]["gradients"] == full["learner_per_rank_gib"]["gradients"]
    assert "trainable count unknown here" in bound["memory"]["learner_formula"]
