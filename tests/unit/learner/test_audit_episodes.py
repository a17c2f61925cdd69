"""The offline ratio audit on multi-turn episodes (docs/agents.md), on hand-made tensors: an episode's response
interleaves sampled turns (engine mask 1) and the environment's replies (mask 0, engine log-prob 0.0); the audit
rebuilds its expected mask from the prompt length, the attention mask and the saved episode mask, counts |y_i| on
sampled tokens only, and keeps the environment's tokens out of its log-prob checks. Single-answer steps (no
episode masks, as in older dumps) audit as before."""

from __future__ import annotations

import pytest
import torch

from learner import audit
from learner.audit_checks import SavedBatch, log_prob_checks
from learner.audit_masks import mask_checks

# Row 0: an episode, prompt 2 tokens, response 5 tokens: turn (2 sampled), reply (2 env), turn (1 sampled), then
# 1 padding. Row 1: a single answer in the same step (episode mask all -1), prompt 3, response 3.
ATTN = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0]])
PROMPTS = torch.tensor([2, 3])
SAMPLED = torch.tensor([[1, 1, 0, 0, 1], [-1, -1, -1, -1, -1]], dtype=torch.int8)
# targets (t predicts token t+1): row 0's response tokens 0..4 sit at 2..6, targets 1..5, sampled at 1, 2, 5;
# row 1's response tokens at 3..5, targets 2..4.
WANT = torch.tensor([[0, 1, 1, 0, 0, 1, 0], [0, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)


def _batch(saved_mask: torch.Tensor = WANT, sampled: torch.Tensor | None = SAMPLED) -> SavedBatch:
    n, width = saved_mask.shape
    ids = torch.arange(1, 1 + n * (width + 1)).reshape(n, width + 1) * ATTN
    old = torch.where(saved_mask, -1.0, 0.0).to(torch.float64)  # the environment's tokens: 0.0 from the engines
    return SavedBatch(input_ids=ids, attention_mask=ATTN, saved_mask=saved_mask, old=old, learner_lp=old.clone(),
                      advantages=torch.ones(n, dtype=torch.float64), prompt_lengths=PROMPTS, sampled=sampled)


def _meta(batch: SavedBatch) -> dict:
    uids = ["a", "b"]
    return {"prompt_uids": uids,
            "prompt_token_ids": {u: batch.input_ids[i, : int(PROMPTS[i])].tolist() for i, u in enumerate(uids)}}


def test_sampled_target_mask_and_expected_mask_hand_values():
    got = audit.sampled_target_mask(PROMPTS, SAMPLED, 7)
    assert got[0].tolist() == [False, True, True, False, False, True, False]
    assert got[1].all()  # a single answer: no episode mask
    assert torch.equal(audit.expected_response_mask(PROMPTS, ATTN, SAMPLED), WANT)
    # without episode masks: every response token (the single-answer expectation, as before)
    plain = audit.expected_response_mask(PROMPTS, ATTN)
    assert plain[0].tolist() == [False, True, True, True, True, True, False]
    assert torch.equal(plain[1], WANT[1])
    assert audit.episode_lengths(SAMPLED).tolist() == [5, -1]
    assert not audit.sampled_target_mask(torch.tensor([-1, 3]), SAMPLED, 7)[0].any()  # unknown prompt length


def test_mask_checks_count_sampled_tokens_of_an_episode():
    batch = _batch()
    mask, lengths, checks = mask_checks(batch, _meta(batch))
    assert torch.equal(mask, WANT) and lengths.tolist() == [3, 3]  # |y_0| = 3 sampled tokens, not 5
    assert [c.name for c in checks] == ["mask_alignment", "prompt_tokens", "length_normalisation",
                                        "episode_mask_length"]
    assert not any(c.failed for c in checks), checks


def test_mask_checks_flag_trained_environment_tokens_and_a_short_episode_mask():
    trained_env = WANT.clone()
    trained_env[0, 3:5] = True
    batch = _batch(trained_env)
    failed = {c.name: c for c in mask_checks(batch, _meta(batch))[2] if c.failed}
    assert set(failed) == {"mask_alignment", "length_normalisation"}
    assert failed["mask_alignment"].diff == 2 and "an episode" in failed["mask_alignment"].where
    short = SAMPLED.clone()
    short[0, 4] = -1
    batch = _batch(sampled=short)
    failed = {c.name: c for c in mask_checks(batch, _meta(batch))[2] if c.failed}
    assert "episode_mask_length" in failed and "a sampled-token mask of 4 for 5" in failed["episode_mask_length"].where


def test_single_answer_steps_audit_as_before():
    """No episode tensor (single answers, or a dump from before episodes were saved): the same three checks, and
    an episode's environment tokens are then expected in the mask (so such a dump of an agent run fails)."""
    tensors = {"input_ids": _batch().input_ids, "attention_mask": ATTN, "response_mask": WANT,
               "old_log_probs": torch.zeros(2, 7), "learner_log_probs": torch.zeros(2, 7),
               "advantages": torch.ones(2), "prompt_lengths": PROMPTS}
    batch = SavedBatch.from_tensors(tensors)
    assert batch.sampled is None and not batch.is_episode(0)
    mask, lengths, checks = mask_checks(batch, _meta(batch))
    assert [c.name for c in checks] == ["mask_alignment", "prompt_tokens", "length_normalisation"]
    assert lengths.tolist() == [5, 3]
    assert {c.name for c in checks if c.failed} == {"mask_alignment", "length_normalisation"}
    with_episodes = SavedBatch.from_tensors({**tensors, audit.EPISODE_MASK_KEY: SAMPLED})
    assert torch.equal(with_episodes.sampled, SAMPLED) and with_episodes.is_episode(0)


def test_log_prob_checks_leave_the_environment_tokens_out():
    """Audit log-probs far from the engines' 0.0 on the environment's tokens do not count, and GSPO's log s_i
    divides by the sampled tokens."""
    batch = _batch()
    mask, lengths, _ = mask_checks(batch, _meta(batch))
    audit_lp = batch.old.clone()
    audit_lp[0, 3:5] = -7.0  # the model's log-probs of the environment's reply: not the engines' business
    audit_lp[0, 1] += 0.3  # one sampled token off by 0.3 nats
    checks = {c.name: c for c in log_prob_checks(batch, audit_lp, mask, lengths, 1e-4)}
    assert checks["behaviour_log_probs"].diff == pytest.approx(0.3)
    assert "target 1" in checks["behaviour_log_probs"].where
    want = audit.sequence_log_ratios(audit_lp, batch.old, WANT)[0]
    assert float(want) == pytest.approx(0.3 / 3)  # 3 sampled tokens, not 5
    assert checks["sequence_log_ratio"].diff == pytest.approx(0.3 / 3)  # the learner's (saved) log-probs: 0 off
