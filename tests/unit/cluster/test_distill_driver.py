"""The driver's part of on-policy distillation (``cluster.driver.distill``): the teacher's answers put on a step's
rollout (a failed share: NaN rewards, counted), the per-token advantages against hand-computed values (an
episode's environment tokens masked, per-turn reward advantages), and their layout in the learner's batch. The
teacher here is a stand-in with the fleet's ``logprobs`` surface; the real engines: tests/integration/test_distill.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from cluster.driver.batching import build_train_batch, rollout_advantages
from cluster.driver.collect import Collected
from cluster.driver.distill import Distiller, sampled_mask, token_table
from cluster.runtime.model_fleet import CallFailure
from cluster.config_sections import DistillConfig
from reward.contracts import RewardResult
from rollout.contracts import Completion


def _comp(i: int, response: list[int], logprobs: list[float], **kw) -> Completion:
    return Completion(prompt_uid=f"p{i // 2}", sample_index=i % 2, prompt_token_ids=[1, 5, 6],
                      response_token_ids=response, response_logprobs=logprobs, response_text="x", finish_reason="stop",
                      weight_version=0, **kw)


class FakeTeacher:
    """The fleet's surface: one answer per completion (a list of log-probs or a ``CallFailure``)."""

    def __init__(self, answers):
        self.answers = answers

    def logprobs(self, completions):
        assert len(completions) == len(self.answers)
        return list(self.answers)


def _rollout(scores=(1.0, 0.0, 1.0, 1.0)) -> Collected:
    comps = [_comp(0, [7, 8, 2], [-0.5, -1.0, -0.2]), _comp(1, [9, 2], [-2.0, -0.1]),
             _comp(2, [7, 2], [-0.3, -0.4]), _comp(3, [], [])]
    return Collected(completions=comps, results=[RewardResult(s, correct=s == 1.0) for s in scores])


def test_annotate_keeps_answers_and_makes_failed_samples_invalid():
    c = _rollout()
    fail = CallFailure("timeout", "TeacherTimeout", "no answer within distill.timeout_s=1")
    Distiller(DistillConfig(model_path="m"), FakeTeacher([[-1.0, -1.0, -1.0], fail, [-0.3], []])).annotate(c)
    assert c.teacher_logprobs == [[-1.0, -1.0, -1.0], None, None, []]  # sample 2: a wrong length is a failure too
    assert c.results[0].score == 1.0 and math.isnan(c.results[1].score) and math.isnan(c.results[2].score)
    assert c.results[1].status == "timeout" and c.results[1].detail["teacher"]["error"] == "TeacherTimeout"
    assert c.results[2].correct and c.results[2].detail["teacher"]["error"] == "TeacherLength"
    assert c.reward_metrics["distill/failed"] == 2.0 and c.reward_metrics["distill/teacher_s"] >= 0.0


def test_advantages_by_hand_alone_and_beside_the_reward():
    c = _rollout()
    Distiller(DistillConfig(model_path="m"), FakeTeacher(
        [[-1.0, -1.0, -1.0], [-1.0, -0.1], [-0.3, -0.9], []])).annotate(c)
    rewards = torch.tensor([r.score for r in c.results])
    adv = rollout_advantages(c.completions, rewards, 2, algorithm="gspo_token", normalize_std=True)
    alone = Distiller(DistillConfig(model_path="m", kl_coef=2.0), None).advantages(c, adv)
    # k = old - teacher: [0.5, 0, 0.8], [-1, 0], [0, 0.5], none; advantage = -2 k
    want = torch.tensor([[-1.0, 0.0, -1.6], [2.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(alone.advantages, want, rtol=0, atol=1e-6)
    assert c.reward_metrics["distill/reverse_kl"] == pytest.approx((0.5 + 0.8 - 1.0 + 0.5) / 7)
    assert c.reward_metrics["distill/reverse_kl_seq"] == pytest.approx((1.3 - 1.0 + 0.5) / 3)  # empty: left out
    beside = Distiller(DistillConfig(model_path="m", reward_weight=0.5), None).advantages(c, adv)
    a = adv.advantages  # group 0: rewards 1, 0 -> z-scores +-1; group 1: all equal -> 0
    assert a.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    want = torch.tensor([[0.0, 0.5, -0.3], [0.5, -0.5, 0.0], [0.0, -0.5, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(beside.advantages, want, rtol=0, atol=1e-5)
    batch = build_train_batch(c.completions, beside.returns, beside.advantages, 0)
    # response token j of a 3-token prompt sits at target 2 + j; prompt and padding targets stay 0
    torch.testing.assert_close(batch.advantages[0, 2:5], want[0], rtol=0, atol=1e-5)
    assert batch.advantages[:, :2].abs().sum() == 0 and batch.advantages[1, 4:].abs().sum() == 0


def test_episode_environment_tokens_and_invalid_rewards_get_zero():
    episode = _comp(0, [7, 8, 9, 2], [-0.5, 0.0, 0.0, -0.2], response_mask=[1, 0, 0, 1])
    c = Collected(completions=[episode, _comp(1, [9], [-1.0])],
                  results=[RewardResult(1.0), RewardResult(math.nan, status="error")])
    Distiller(DistillConfig(model_path="m"), FakeTeacher([[-1.0, -5.0, -5.0, -1.0], [-2.0]])).annotate(c)
    rewards = torch.tensor([r.score for r in c.results])
    adv = rollout_advantages(c.completions, rewards, 2, algorithm="gspo_token", normalize_std=True)
    out = Distiller(DistillConfig(model_path="m"), None).advantages(c, adv)
    torch.testing.assert_close(out.advantages, torch.tensor([[-0.5, 0.0, 0.0, -0.8], [0.0, 0.0, 0.0, 0.0]]),
                               rtol=0, atol=1e-6)
    assert c.reward_metrics["distill/reverse_kl"] == pytest.approx((0.5 + 0.8) / 2)  # the sampled tokens only


def test_per_turn_reward_advantages_join_token_by_token():
    c = _rollout()
    Distiller(DistillConfig(model_path="m"), FakeTeacher([[-0.5, -1.0, -0.2], [-2.0, -0.1], [-0.3, -0.4], []])
              ).annotate(c)  # the teacher agrees: k = 0
    rewards = torch.tensor([r.score for r in c.results])
    adv = rollout_advantages(c.completions, rewards, 2, algorithm="gspo_token", normalize_std=True)
    adv.advantages = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [6.0, 7.0, 0.0], [0.0, 0.0, 0.0]])
    out = Distiller(DistillConfig(model_path="m", reward_weight=2.0), None).advantages(c, adv)
    torch.testing.assert_close(out.advantages, 2.0 * adv.advantages, rtol=0, atol=1e-6)


def test_tables_and_a_rollout_not_annotated():
    comps = [_comp(0, [7, 8], [-1.0, -2.0]), _comp(1, [], [])]
    torch.testing.assert_close(token_table(comps, [[-1.0, -2.0], None]),
                               torch.tensor([[-1.0, -2.0], [math.nan, math.nan]]), equal_nan=True)
    assert sampled_mask(comps, 3).tolist() == [[True, True, False], [False, False, False]]
    with pytest.raises(ValueError, match="1 values for 2 response tokens"):
        token_table(comps, [[-1.0], []])
    c = Collected(completions=comps, results=[RewardResult(1.0), RewardResult(0.0)])
    adv = rollout_advantages(comps, torch.tensor([1.0, 0.0]), 2, algorithm="grpo", normalize_std=True)
    with pytest.raises(ValueError, match="no teacher log-probs"):
        Distiller(DistillConfig(model_path="m"), None).advantages(c, adv)
