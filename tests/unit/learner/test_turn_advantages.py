"""Per-turn advantages of multi-turn episodes (``learner.advantages.turn_advantages`` /
``turn_token_advantages``, our extension of GSPO-token): hand-computed values, the equivalence with the sequence
advantage when the environment gives no per-turn reward, the edge cases (one turn, NaN reward, zero std), and the
offline audit's independent GSPO-token objective on per-token advantages against the learner's loss."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from learner.advantages import group_advantages, turn_advantages, turn_returns, turn_token_advantages
from learner.audit_checks import policy_objective
from learner.objectives import Objective, policy_loss

NAN = float("nan")
EPS = 1e-6


def _reference(rewards, turn_rewards, group_size, normalize_std=True):
    """The docstring's formula in plain Python floats: G_i,k = R_i + sum_{j>=k} r_i,j; mean and population std
    of the group's valid G_i,1; 0 for invalid episodes and degenerate groups."""
    out = []
    for g in range(0, len(rewards), group_size):
        returns = [[R + sum(rs[k:]) for k in range(len(rs))] for R, rs in
                   zip(rewards[g : g + group_size], turn_rewards[g : g + group_size])]
        full = [G[0] for G in returns if not math.isnan(G[0])]
        degenerate = len(full) <= 1 or max(full) == min(full)
        mean = statistics.fmean(full) if full else 0.0
        std = statistics.pstdev(full) if len(full) > 1 else 0.0
        for G in returns:
            if math.isnan(G[0]) or degenerate:
                out.append([0.0] * len(G))
            else:
                out.append([(x - mean) / (std + EPS) if normalize_std else x - mean for x in G])
    return out


def test_hand_computed_group():
    # episode 0: R=1, turns rewarded 0.5 then 0 -> G = [1.5, 1.0]; episode 1: R=0, one turn rewarded 0.5 -> [0.5];
    # episode 2: R=0, two unrewarded turns -> [0, 0]. Full returns 1.5, 0.5, 0: mean 2/3, population std sqrt(7/18)
    rewards = torch.tensor([1.0, 0.0, 0.0])
    table = torch.tensor([[0.5, 0.0], [0.5, 0.0], [0.0, 0.0]])
    assert turn_returns(rewards, table).tolist() == [[1.5, 1.0], [0.5, 0.0], [0.0, 0.0]]
    s = math.sqrt(7 / 18) + EPS
    adv = turn_advantages(rewards, table, 3)
    assert adv.dtype == torch.float32 and adv.shape == (3, 2)
    torch.testing.assert_close(adv[0], torch.tensor([(1.5 - 2 / 3) / s, (1.0 - 2 / 3) / s]))
    torch.testing.assert_close(adv[1, :1], torch.tensor([(0.5 - 2 / 3) / s]))
    torch.testing.assert_close(adv[2], torch.tensor([-2 / 3 / s, -2 / 3 / s]))
    mean_only = turn_advantages(rewards, table, 3, normalize_std=False)  # Dr. GRPO: no std scaling
    torch.testing.assert_close(mean_only[0], torch.tensor([5 / 6, 1 / 3]))
    torch.testing.assert_close(mean_only[1, 0], torch.tensor(-1 / 6))

    # spread over tokens: ep 0 has 6 response tokens, turns at 0 and 3 (turn 1 = tokens 0-2: sampled ids and the
    # environment's reply after them); ep 1 has 2 tokens, one turn; ep 2 has 4 tokens, turns at 0 and 1
    tok = turn_token_advantages(rewards, [[0.5, 0.0], [0.5], [0.0, 0.0]], [[0, 3], [0], [0, 1]], [6, 2, 4], 3)
    assert tok.shape == (3, 6) and tok.dtype == torch.float32
    a = adv.tolist()
    torch.testing.assert_close(tok, torch.tensor([[a[0][0]] * 3 + [a[0][1]] * 3,
                                                  [a[1][0]] * 2 + [0.0] * 4,
                                                  [a[2][0]] + [a[2][1]] * 3 + [0.0] * 2]))


def test_without_turn_rewards_every_token_carries_the_sequence_advantage():
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(24, generator=g) * 3 - 1).to(torch.float32)
    rewards[[2, 9, 10]] = NAN
    rewards[12:16] = 0.25  # a degenerate group
    lengths = [int(x) for x in torch.randint(1, 9, (24,), generator=g)]
    for normalize_std in (True, False):
        seq = group_advantages(rewards, 4, normalize_std=normalize_std)
        # zero per-turn rewards over 3 turns: bit-identical to the sequence advantage on every turn
        per_turn = turn_advantages(rewards, torch.zeros(24, 3), 4, normalize_std=normalize_std)
        assert torch.equal(per_turn, seq[:, None].expand(24, 3))
        # per token: None (no turn data) and explicit zeros alike
        starts = [None if i % 2 else [0, n // 2] for i, n in enumerate(lengths)]
        turn_r = [None if i % 2 else [0.0, 0.0] for i in range(24)]
        tok = turn_token_advantages(rewards, turn_r, starts, lengths, 4, normalize_std=normalize_std)
        for i, n in enumerate(lengths):
            assert torch.equal(tok[i, :n], seq[i].expand(n)) and not tok[i, n:].any()


def test_matches_python_reference_random():
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(16, generator=g, dtype=torch.float64).round()
    rewards[5] = NAN
    table = (torch.rand(16, 4, generator=g, dtype=torch.float64) - 0.5).round(decimals=1)
    for normalize_std in (True, False):
        adv = turn_advantages(rewards, table, 4, normalize_std=normalize_std)
        assert adv.dtype == torch.float64
        want = _reference(rewards.tolist(), table.tolist(), 4, normalize_std)
        torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_one_turn_is_the_sequence_advantage_of_the_summed_return():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    r = [0.5, -0.25, 0.0, 1.0]
    tok = turn_token_advantages(rewards, [[x] for x in r], [[0]] * 4, [3, 3, 3, 3], 4)
    seq = group_advantages(rewards + torch.tensor(r), 4)
    assert torch.equal(tok, seq[:, None].expand(4, 3))


def test_nan_reward_is_invalid_on_every_turn():
    rewards = torch.tensor([1.0, NAN, 0.0])
    table = torch.tensor([[1.0, 0.0], [5.0, 5.0], [0.0, 0.0]])  # episode 0: G = [2, 1]
    adv = turn_advantages(rewards, table, 3)
    # valid full returns 2 and 0: mean 1, std 1; the NaN episode's turn rewards take no part
    torch.testing.assert_close(adv, torch.tensor([[1 / (1 + EPS), 0.0], [0.0, 0.0], [-1 / (1 + EPS)] * 2]))


def test_zero_std_group_is_exactly_zero_on_every_turn():
    # full returns 1, 1, 1 (0.1 + 0.9 != 1.0 would leave a residue: exact zeros wanted) although the turns differ
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0], dtype=torch.float64)
    table = torch.tensor([[0.0, 0.0], [0.75, 0.25], [0.5, 0.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    for normalize_std in (True, False):
        adv = turn_advantages(rewards[:3], table[:3], 3, normalize_std=normalize_std)
        assert adv.tolist() == [[0.0, 0.0]] * 3
        # a group with one episode (G=1) has no baseline either
        assert turn_advantages(rewards[3:4], table[3:4], 1, normalize_std=normalize_std).tolist() == [[0.0, 0.0]]


def test_bad_turn_data_is_refused():
    r = torch.zeros(2)
    with pytest.raises(ValueError, match="finite"):
        turn_advantages(r, torch.tensor([[0.0], [float("inf")]]), 2)
    with pytest.raises(ValueError, match="finite"):
        turn_returns(r, torch.tensor([[0.0], [NAN]]))
    with pytest.raises(ValueError, match=r"\[N, K>=1\]"):
        turn_returns(r, torch.zeros(2))
    with pytest.raises(ValueError, match="multiple of group_size"):
        turn_advantages(torch.zeros(3), torch.zeros(3, 1), 2)
    ok = dict(response_lengths=[4, 4], group_size=2)
    with pytest.raises(ValueError, match="disagree"):
        turn_token_advantages(r, [[0.0], [0.0, 1.0]], [[0], [0]], **ok)
    with pytest.raises(ValueError, match="disagree"):
        turn_token_advantages(r, [[0.0], None], [[0], [0]], **ok)
    with pytest.raises(ValueError, match="ascend from 0"):
        turn_token_advantages(r, [[0.0], [0.0, 1.0]], [[0], [1, 2]], **ok)
    with pytest.raises(ValueError, match="ascend from 0"):
        turn_token_advantages(r, [[0.0], [0.0, 1.0]], [[0], [0, 5]], **ok)
    with pytest.raises(ValueError, match="ascend from 0"):
        turn_token_advantages(r, [[0.0], [0.0, 1.0, 0.0]], [[0], [0, 3, 2]], **ok)
    with pytest.raises(ValueError, match="must agree"):
        turn_token_advantages(r, [[0.0]], [[0]], **ok)


def test_audit_objective_matches_learner_loss_on_per_token_advantages():
    """The offline audit's independent GSPO-token objective (``learner.audit_checks.policy_objective``) on
    per-token advantages gives the learner's loss and gradient, with some tokens clipped."""
    g = torch.Generator().manual_seed(3)
    b, t = 4, 7
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[3] = False  # an empty row
    old = -torch.rand(b, t, generator=g, dtype=torch.float64)
    base = old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    grads, losses = [], []
    for fn in ("learner", "audit"):
        lp = base.clone().requires_grad_(True)
        if fn == "learner":
            out = policy_loss(lp, old, adv, mask, Objective("gspo_token", 0.0003, 0.0004, "seq_mean_token_mean"))
            loss = out.loss
        else:
            loss, stats = policy_objective(lp, old, adv, mask, algorithm="gspo_token", clip_low=0.0003,
                                           clip_high=0.0004, loss_agg="seq_mean_token_mean", num_sequences=3,
                                           num_tokens=int(mask.sum()))
        loss.backward()
        losses.append(loss.detach())
        grads.append(lp.grad)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    assert 0.0 < stats["clip_fraction"] < 1.0 and stats["clip_fraction"] == pytest.approx(
        out.metrics["clip_fraction"], rel=1e-12)
    with pytest.raises(ValueError, match="'gspo_token' only"):
        policy_objective(base, old, adv, mask, algorithm="grpo", clip_low=0.2, clip_high=0.2, loss_agg="token_mean",
                         num_sequences=3, num_tokens=int(mask.sum()))
