"""Per-turn advantages on the driver's side (``cluster.driver.batching.rollout_advantages``, ``build_train_batch``):
``gspo_token`` episodes with per-turn rewards train on ``[N, L-1]`` advantages aligned with the response mask,
every other case keeps one advantage per sequence (other algorithms sum the per-turn rewards into the return);
the ``[N, L-1]`` advantages survive the split into minibatches and micro-batches and reach the loss."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from cluster.driver import batching
from cluster.driver.batching import build_train_batch, rollout_advantages, split_for_ranks
from learner.advantages import group_advantages
from learner.contracts import TrainBatch
from learner.microbatch import MicroBatch, batch_problem
from learner.objectives import Objective, policy_loss
from rollout.contracts import Completion

EPS = 1e-6


def _episode(prompt, turns, i, reward_per_turn=None, uid="u"):
    """An episode from ``turns`` = [(sampled ids, reply ids), ...]: sampled ids mask 1 (log-prob -0.5), replies
    mask 0; with ``reward_per_turn`` its turn data."""
    ids, mask, starts = [], [], []
    for sampled, reply in turns:
        starts.append(len(ids))
        ids += sampled + reply
        mask += [1] * len(sampled) + [0] * len(reply)
    lp = [-0.5 if m else 0.0 for m in mask]
    return Completion(uid, i, prompt, ids, lp, "", "stop", 1, response_mask=mask,
                      turn_starts=starts if reward_per_turn is not None else None,
                      turn_rewards=reward_per_turn)


def _group(turn_rewards):
    """Two episodes of one prompt: episode 0 has turns (7, 8 | reply 20) and (9 | -), episode 1 one turn (7)."""
    a = _episode([5, 6], [([7, 8], [20]), ([9], [])], 0, turn_rewards[0])
    b = _episode([5, 6], [([7], [])], 1, turn_rewards[1])
    return [a, b]


def test_gspo_token_with_turn_rewards_gets_token_advantages_aligned_with_the_mask():
    comps = _group([[0.5, 0.0], [0.0]])
    rewards = torch.tensor([0.0, 1.0])
    adv = rollout_advantages(comps, rewards, 2, algorithm="gspo_token", normalize_std=True)
    assert adv.per_turn and not adv.summed_turn_rewards
    # G_0 = [0.5, 0], G_1 = [1]: full returns 0.5 and 1 -> mean 0.75, std 0.25
    s = 0.25 + EPS
    a0, a1, b0 = (0.5 - 0.75) / s, (0.0 - 0.75) / s, (1.0 - 0.75) / s
    assert adv.returns.tolist() == [0.5, 1.0] and adv.advantages.shape == (2, 4)
    torch.testing.assert_close(adv.advantages, torch.tensor([[a0, a0, a0, a1], [b0, 0.0, 0.0, 0.0]]))

    batch = build_train_batch(comps, adv.returns, adv.advantages, pad_token_id=0)
    assert batch.advantages.shape == batch.response_mask.shape == (2, 5) and batch.advantages.dtype == torch.float32
    # row 0: [5, 6 | 7, 8, 20, 9]; targets 1..4 are tokens 7, 8, 20 (the reply: masked, turn 1's value), 9
    assert batch.response_mask.tolist() == [[False, True, True, False, True], [False, True, False, False, False]]
    torch.testing.assert_close(batch.advantages, torch.tensor([[0.0, a0, a0, a0, a1], [0.0, b0, 0.0, 0.0, 0.0]]))
    assert batch.rewards.tolist() == [0.5, 1.0]  # the returns
    assert batch_problem(batch, "b") is None


def test_without_turn_rewards_nothing_changes():
    rewards = torch.tensor([0.0, 1.0])
    seq = group_advantages(rewards, 2)
    for turn_rewards in ([None, None], [[0.0, 0.0], [0.0]]):  # no turn data, or an environment that rewards none
        for algorithm in ("gspo_token", "gspo", "grpo"):
            adv = rollout_advantages(_group(turn_rewards), rewards, 2, algorithm=algorithm, normalize_std=True)
            assert adv.returns is rewards and torch.equal(adv.advantages, seq)
            assert not adv.per_turn and not adv.summed_turn_rewards
            batch = build_train_batch(_group(turn_rewards), adv.returns, adv.advantages, 0)
            assert batch.advantages.shape == (2,)


def test_sequence_level_algorithms_sum_turn_rewards_into_the_return(caplog, monkeypatch):
    monkeypatch.setattr(batching, "_summed_logged", False)
    rewards = torch.tensor([0.0, 1.0, float("nan"), 0.0])
    comps = _group([[0.5, 0.25], [0.0]]) + _group([[1.0, 0.0], None])
    with caplog.at_level(logging.INFO, logger="cluster.train"):
        for algorithm in ("gspo", "grpo", "ppo"):
            adv = rollout_advantages(comps, rewards, 2, algorithm=algorithm, normalize_std=False)
            assert adv.summed_turn_rewards and not adv.per_turn
            assert adv.returns[[0, 1, 3]].tolist() == [0.75, 1.0, 0.0] and math.isnan(adv.returns[2])
            # the first group's returns 0.75 and 1: mean-only advantages -0.125, 0.125; the second has one valid
            assert adv.advantages.tolist() == [-0.125, 0.125, 0.0, 0.0]
    assert sum("added into each episode's return" in r.getMessage() for r in caplog.records) == 1  # once


def test_bad_turn_data_is_refused():
    with pytest.raises(ValueError, match="given together"):
        Completion("u", 0, [1], [2, 3], [0.0, 0.0], "", "stop", 0, turn_starts=[0])
    with pytest.raises(ValueError, match="ascending, start at 0"):
        Completion("u", 0, [1], [2, 3], [0.0, 0.0], "", "stop", 0, turn_starts=[1], turn_rewards=[0.0])
    with pytest.raises(ValueError, match="within its 2 tokens"):
        Completion("u", 0, [1], [2, 3], [0.0, 0.0], "", "stop", 0, turn_starts=[0, 3], turn_rewards=[0.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        Completion("u", 0, [1], [2, 3], [0.0, 0.0], "", "stop", 0, turn_starts=[0], turn_rewards=[float("nan")])
    comps = _group([[0.5, 0.0], [0.0]])
    comps[0].turn_rewards = [0.5]  # set after construction: caught by the driver
    with pytest.raises(ValueError, match="one per turn"):
        rollout_advantages(comps, torch.zeros(2), 2, algorithm="gspo_token", normalize_std=True)
    with pytest.raises(ValueError, match=r"R >= 4"):
        build_train_batch(_group([None, None]), torch.zeros(2), torch.zeros(2, 3), 0)


def test_token_advantages_through_minibatches_micro_batches_and_the_loss():
    """8 episodes in 4 groups: split into minibatches and ranks (rows follow their advantages), cut into
    micro-batches trimmed to their own width (the advantages with them), and GSPO-token's loss on them equals
    the loss with the same per-token advantages written by hand."""
    comps, turn_r = [], []
    for i in range(8):
        turns = [([7] * (1 + i % 3), [20, 21]), ([9] * (1 + i % 2), [])][: 1 + i % 2]
        r = [0.1 * i, -0.05][: len(turns)]
        comps.append(_episode([5], turns, i % 2, r, uid=f"p{i // 2}"))
        turn_r.append(r)
    rewards = torch.tensor([1.0, 0.0] * 4)
    adv = rollout_advantages(comps, rewards, 2, algorithm="gspo_token", normalize_std=True)
    batch = build_train_batch(comps, adv.returns, adv.advantages, 0)
    plans = split_for_ranks(batch, num_minibatches=2, world_size=2, seed=0)
    for plan in plans:
        for rows, mb in zip(plan.row_indices, plan.minibatches):
            assert torch.equal(mb.advantages, batch.advantages[rows]) and batch_problem(mb, "mb") is None
            micro = MicroBatch(mb, 0, 1, torch.device("cpu"), "response_mask")
            assert micro.advantages.shape == micro.mask.shape == (1, micro.width - 1)
            assert torch.equal(micro.advantages, mb.advantages[:1, : micro.width - 1])
    whole = MicroBatch(batch, 0, len(batch), torch.device("cpu"), "response_mask")
    lp = whole.old_log_probs + 0.01 * torch.arange(whole.mask.numel(), dtype=torch.float32).view_as(whole.mask)
    obj = Objective("gspo_token", 0.2, 0.2, "seq_mean_token_mean")
    got = policy_loss(lp, whole.old_log_probs, whole.advantages, whole.mask, obj).loss
    by_hand = torch.zeros_like(whole.mask, dtype=torch.float32)
    for i, c in enumerate(comps):
        for k, start in enumerate(c.turn_starts):
            end = c.turn_starts[k + 1] if k + 1 < len(c.turn_starts) else len(c.response_token_ids)
            by_hand[i, start:end] = adv.advantages[i, start]  # prompt length 1: token j is target j
    assert torch.equal(policy_loss(lp, whole.old_log_probs, by_hand, whole.mask, obj).loss, got)
    with pytest.raises(ValueError, match="gspo_token"):  # GSPO takes one advantage per sequence
        policy_loss(lp, whole.old_log_probs, whole.advantages, whole.mask, Objective("gspo", 0.2, 0.2,
                                                                                     "seq_mean_token_mean"))
    bad = TrainBatch(batch.input_ids, batch.attention_mask, batch.response_mask, batch.old_log_probs,
                     batch.advantages[:, :-1], batch.rewards, batch.prompt_uids, batch.weight_versions)
    assert "advantages has shape" in batch_problem(bad, "b")


def test_every_branch_trains_with_its_episodes_reward_and_advantage_and_the_group_stays_per_episode():
    # a group of 3 episodes; episode 1 forked once (its earlier branch 0 trains beside its last branch 1)
    eps = [_episode([1, 2], [([7, 8], [])], i) for i in range(3)]
    branch = _episode([1, 3], [([5, 6, 4], [])], 1)
    rewards = torch.tensor([1.0, 0.0, 0.5])
    adv = rollout_advantages(eps, rewards, 3, algorithm="gspo", normalize_std=True)
    keys = [("u#0", 0), ("u#1", 1), ("u#2", 0)]
    rows, out, names = batching.with_branches(eps, adv, keys, {"u#1": [(0, branch)]}, unit=4, pad_token_id=0)
    assert rows[:4] == [*eps, branch] and names == [*keys, ("u#1", 0)]  # 4 rows: a multiple of 4, no padding
    assert torch.equal(out.advantages[:3], adv.advantages)  # the group's statistics: its 3 episodes only
    assert out.advantages[3] == adv.advantages[1] and out.returns[3] == 1 * rewards[1]
    assert torch.allclose(adv.advantages, group_advantages(rewards, 3, normalize_std=True))
    # with unit 8, four empty rows: no response token, so nothing trains on them
    rows, out, names = batching.with_branches(eps, adv, keys, {"u#1": [(0, branch)]}, unit=8, pad_token_id=0)
    batch = build_train_batch(rows, out.returns, out.advantages, pad_token_id=0)
    assert len(rows) == 8 and names[4:] == [("", 0)] * 4 and not batch.response_mask[4:].any()
    assert torch.isnan(out.returns[4:]).all() and not out.advantages[4:].any()
    assert len(split_for_ranks(batch, 4, 2, seed=0)) == 2
    same = batching.with_branches(eps, adv, keys, {}, unit=8, pad_token_id=0)  # no branch: the batch unchanged
    assert same[0] is eps and same[1] is adv
