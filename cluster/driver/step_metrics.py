"""A step's metrics computed on the driver: reward, response, sampling, staleness and length slices, and the
warning about a mismatch correction that drops too much."""

from __future__ import annotations

from typing import Any

import torch

from cluster.common import mean
from cluster.config import Config
from cluster.driver import length_slices
from cluster.driver.collect import Collected, all_equal
from learner.objective_names import TOKEN_CORRECTIONS
from reward import infra


#: a mismatch correction that drops more than this share of a step's sequences or tokens is warned about: it is
#: meant to reject outliers, and above a quarter it cuts into the data itself.
CORRECTION_DROP_WARN = 0.25


def correction_warning(metrics: dict[str, Any], lc) -> str | None:
    """A warning when ``learner.rollout_correction`` dropped more than ``CORRECTION_DROP_WARN`` of a step's
    tokens (``token_*`` corrections: ``mismatch/masked_token_share``) or sequences (``seq_*``:
    ``mismatch/masked_seq_share``) in an update that was applied, else None. Measured:
    a ``seq_geo_rs`` band of [0.998, 1.002] against a bf16 engine dropped 79% of sequences, and the runs fell
    below their start (README, MoE comparison with a bf16 engine)."""
    # token corrections drop tokens (a sequence counts as masked with one dropped token); sequence ones sequences
    unit = "token" if lc.rollout_correction in TOKEN_CORRECTIONS else "seq"
    share = float(metrics.get(f"mismatch/masked_{unit}_share", 0.0))
    if share <= CORRECTION_DROP_WARN or metrics.get("health/skipped"):
        return None
    return (f"learner.rollout_correction={lc.rollout_correction!r} dropped {share:.0%} of the step's "
            f"{'sequences' if unit == 'seq' else 'tokens'} (band [{lc.rollout_correction_low:g}, "
            f"{lc.rollout_correction_high:g}]): the update learns from the rest only; widen "
            "learner.rollout_correction_low / rollout_correction_high to the mismatch/* the run logs")


def staleness(c: Collected, learner_version: int, max_staleness: int, step: int) -> dict[str, float]:
    """``rollout/staleness_mean|max``: weight versions between the sampling engine's and the learner's
    (``learner_version``), over the step's samples (0 on-policy; at most ``max_staleness``).

    Raises:
        RuntimeError: a sample older than the bound (a scheduling bug: nothing is trained on it).
    """
    ages = [learner_version - x.weight_version for x in c.completions]
    worst = max(ages, default=0)
    if worst > max_staleness:
        raise RuntimeError(f"step {step}: a sample is {worst} weight versions old, beyond "
                           f"trainer.max_staleness={max_staleness}")
    return {"rollout/staleness_mean": sum(ages) / len(ages) if ages else 0.0, "rollout/staleness_max": float(worst)}


def token_ages(c: Collected, learner_version: int) -> dict[str, float]:
    """The batch's sampled tokens per weight version, as ``rollout/tokens_age_<a>``: tokens sampled ``a``
    versions before ``learner_version`` (each token its own version: a sample or a turn may span weight syncs,
    partial rollouts and ``sync.in_flight``); environment replies (mask 0) are not counted."""
    counts: dict[int, int] = {}
    for x in c.completions:
        n = len(x.response_token_ids)
        versions = x.token_versions or [x.weight_version] * n
        mask = x.response_mask or [1] * n
        for v, m in zip(versions, mask):
            if m:
                counts[learner_version - v] = counts.get(learner_version - v, 0) + 1
    return {f"rollout/tokens_age_{a}": float(k) for a, k in sorted(counts.items())}


def response_token_limit(cfg: Config) -> int:
    """The most tokens a response may sample: ``rollout.max_response_tokens``, or for multi-turn episodes
    ``env.max_turns`` turns of it within ``rollout.max_model_len`` (the length slices' range)."""
    limit = cfg.rollout.max_response_tokens
    return min(limit * cfg.env.max_turns, cfg.rollout.max_model_len) if cfg.env.enabled else limit


def rollout_metrics(cfg: Config, c: Collected, rewards: torch.Tensor) -> dict[str, Any]:
    """Reward, response, sampling and rollout timing metrics of a step's rollout ``c`` (``rewards``: float32
    ``[N]``, NaN = invalid sample)."""
    tc = cfg.trainer
    m: dict[str, Any] = {}
    if tc.dynamic_sampling:
        m.update({"sampling/rounds": float(c.rounds), "sampling/dropped_groups": float(c.dropped),
                  "sampling/groups_trained": float(len(c.prompts))})
    valid = rewards[~torch.isnan(rewards)]
    lengths = [x.sampled_tokens for x in c.completions]  # an episode's sampled tokens (its replies left out)
    m.update({
        "reward/mean": float(valid.mean()) if valid.numel() else float("nan"),
        "reward/std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "reward/accuracy": mean([1.0 if r.correct else 0.0 for r in c.results]),
        "reward/invalid": float(torch.isnan(rewards).sum()),
        "reward/groups_all_equal": mean([1.0 if all_equal(g) else 0.0
                                         for g in rewards.view(-1, tc.group_size).tolist()]),
        "response/length_mean": mean([float(x) for x in lengths]),
        "response/length_max": float(max(lengths) if lengths else 0),
        "response/clip_ratio": mean([1.0 if x.truncated else 0.0 for x in c.completions]),
        "timing/rollout_s": c.rollout_s,
        "timing/reward_s": c.reward_s,
        "throughput/rollout_tokens_per_s": c.generated_tokens / c.rollout_s if c.rollout_s > 0 else 0.0,
    })
    m.update(c.reward_metrics)
    m.update(infra_metrics(c))
    return m


def infra_metrics(c: Collected) -> dict[str, float]:
    """``reward/infra_failed`` and ``reward/infra_failed/<cause>``: the step's samples whose reward, environment,
    judge, teacher or sandbox failed for a reason outside the model's output (``RewardResult.infra_failed``,
    ``reward.infra``), those of the groups it trains and those dynamic sampling dropped (the collector's counts
    in ``c.reward_metrics``)."""
    dropped = {k: v for k, v in c.reward_metrics.items() if k == infra.METRIC or k.startswith(infra.METRIC + "/")}
    return infra.add_counts(infra.counts(r.infra_failed for r in c.results), dropped)


def length_metrics(cfg: Config, c: Collected, rewards: torch.Tensor,
                   by_length: dict[int, list[float]]) -> dict[str, float]:
    """The step's metrics per response-length bucket (``cluster.driver.length_slices``; none when
    ``trainer.length_buckets`` is 0): reward and accuracy of the rollout, clip fraction and sequence ratio
    of the learner's update (absent when no update ran)."""
    n = cfg.trainer.length_buckets
    if not n:
        return {}
    ranges = length_slices.bucket_ranges(response_token_limit(cfg), n)
    lengths = [x.sampled_tokens for x in c.completions]  # an episode's sampled tokens: the learner's |y_i|
    out = length_slices.rollout_slices(lengths, rewards.tolist(), [r.correct for r in c.results], ranges)
    out.update(length_slices.learner_slices(by_length, ranges))
    return out
