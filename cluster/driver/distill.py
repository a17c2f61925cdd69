"""On-policy distillation in the driver's step (``distill``): the teacher's log-probs for a step's samples, and
the per-token advantages from them.

``Distiller.annotate`` runs once per collected rollout, after the rewards (in the rollout thread when the rollout
of the next step overlaps the learner): one batched call per teacher engine (``cluster/runtime/teacher.py``)
gives the teacher's log-prob of every sampled response token; a sample whose call failed or timed out becomes
invalid (NaN reward, so advantage 0 and out of its group's statistics), counted in ``distill/failed`` and logged,
and marked as the service's failure (``reward.infra``: ``teacher_failed``, in ``reward/infra_failed``). It is
invalid whatever ``reward.on_infra_failure`` says: without the teacher's log-probs there is no signal to train
the sample on (``zero`` would need them).
``Distiller.advantages`` turns the group-relative advantages of ``batching.rollout_advantages`` into per-token ones,
``A_i,t = reward_weight * A_i - kl_coef * (log pi_old(y_t) - log pi_teacher(y_t))``
(``learner.distill.distill_advantages``), the behaviour log-probs being those the engine returned with the sample.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from cluster.driver.batching import RolloutAdvantages
from cluster.driver.collect import Collected
from cluster.runtime.model_fleet import CallFailure
from learner.distill import distill_advantages, reverse_kl_stats, reverse_kl_tokens, usable_rows
from reward.contracts import RewardResult
from reward.infra import DETAIL_KEY, Cause
from rollout.contracts import Completion

log = logging.getLogger("cluster.train")


def token_table(completions: list[Completion], values: list[list[float] | None], fill: float = 0.0) -> torch.Tensor:
    """float32 ``[N, R]`` (``R`` the longest response, at least 1): row ``i`` holds ``values[i]`` (one per
    response token of completion ``i``) then ``fill``; a None row is NaN throughout.

    Raises:
        ValueError: a row whose length is not its completion's response length.
    """
    width = max([len(c.response_token_ids) for c in completions] + [1])
    out = torch.full((len(completions), width), fill, dtype=torch.float32)
    for i, (c, row) in enumerate(zip(completions, values, strict=True)):
        if row is None:
            out[i] = math.nan
            continue
        if len(row) != len(c.response_token_ids):
            raise ValueError(f"completion {c.prompt_uid}#{c.sample_index}: {len(row)} values for "
                             f"{len(c.response_token_ids)} response tokens")
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def sampled_mask(completions: list[Completion], width: int) -> torch.Tensor:
    """bool ``[N, width]``: True on the response tokens an engine sampled (``Completion.response_mask``; every
    response token without one), False on an environment's tokens and padding."""
    out = torch.zeros((len(completions), width), dtype=torch.bool)
    for i, c in enumerate(completions):
        r = len(c.response_token_ids)
        out[i, :r] = True if c.response_mask is None else torch.tensor(c.response_mask, dtype=torch.bool)
    return out


class Distiller:
    """The teacher's part of a step (see the module docstring).

    Args:
        dc: the ``distill`` section.
        teacher: the ``cluster.runtime.teacher.TeacherFleet`` (anything with ``logprobs(completions)``).
    """

    def __init__(self, dc: Any, teacher: Any):
        self.dc = dc
        self.teacher = teacher

    def annotate(self, c: Collected) -> None:
        """Ask the teacher about every sample of ``c``: sets ``c.teacher_logprobs``; a sample whose call failed gets
        a NaN reward in ``c.results`` (its verifier's ``correct`` kept, the failure under ``detail["teacher"]``);
        adds ``distill/teacher_s`` (wall seconds) and ``distill/failed`` (samples) to ``c.reward_metrics``."""
        t = time.perf_counter()
        got = self.teacher.logprobs(c.completions)
        seconds = time.perf_counter() - t
        teacher: list[list[float] | None] = []
        failures: list[CallFailure] = []
        for i, (comp, row) in enumerate(zip(c.completions, got, strict=True)):
            if isinstance(row, CallFailure) or len(row) != len(comp.response_token_ids):
                failure = row if isinstance(row, CallFailure) else CallFailure(
                    "error", "TeacherLength", f"{len(row)} log-probs for {len(comp.response_token_ids)} tokens")
                failures.append(failure)
                teacher.append(None)
                old = c.results[i]  # a sample already lost to another service keeps that cause (counted once)
                cause = old.infra_failed or Cause.TEACHER_FAILED.value
                c.results[i] = RewardResult(math.nan, correct=old.correct, status=failure.status,
                                            detail={**old.detail, DETAIL_KEY: cause,
                                                    "teacher": {"error": failure.error, "message": failure.message}},
                                            elapsed_s=old.elapsed_s, infra_failed=cause)
            else:
                teacher.append([float(x) for x in row])
        c.teacher_logprobs = teacher
        c.reward_metrics["distill/teacher_s"] = c.reward_metrics.get("distill/teacher_s", 0.0) + seconds
        c.reward_metrics["distill/failed"] = c.reward_metrics.get("distill/failed", 0.0) + len(failures)
        if failures:
            log.warning("distillation teacher: %d of %d samples got no log-probs (NaN rewards; e.g. %s: %s)",
                        len(failures), len(got), failures[0].status, failures[0].message)

    def advantages(self, c: Collected, adv: RolloutAdvantages) -> RolloutAdvantages:
        """``adv`` (the reward's group advantages of ``c``, ``[N]`` or per token ``[N, R]``) turned into on-policy
        distillation's per-token advantages (``learner.distill.distill_advantages``); adds ``distill/reverse_kl``
        and ``distill/reverse_kl_seq`` (``learner.distill.reverse_kl_stats``) to ``c.reward_metrics``.

        Raises:
            ValueError: ``c`` was not annotated, or lengths that do not fit its completions.
        """
        if c.teacher_logprobs is None:
            raise ValueError("the rollout has no teacher log-probs (Distiller.annotate was not run on it)")
        comps = c.completions
        behaviour = token_table(comps, [list(x.response_logprobs) for x in comps])
        teacher = token_table(comps, c.teacher_logprobs)
        mask = sampled_mask(comps, behaviour.shape[1])
        valid = ~torch.isnan(adv.returns)
        k = reverse_kl_tokens(behaviour, teacher, mask)
        base = adv.advantages
        if base.dim() == 2:  # per-turn advantages: as wide as the table
            wide = torch.zeros((len(comps), behaviour.shape[1]), dtype=torch.float32)
            wide[:, : min(base.shape[1], wide.shape[1])] = base[:, : wide.shape[1]].to(torch.float32)
            base = wide
        per_token = distill_advantages(base, k, mask, valid, kl_coef=self.dc.kl_coef,
                                       reward_weight=self.dc.reward_weight)
        c.reward_metrics.update(reverse_kl_stats(k, mask, usable_rows(k, mask, valid)))
        return RolloutAdvantages(adv.returns, per_token, per_turn=True, summed_turn_rewards=adv.summed_turn_rewards)
