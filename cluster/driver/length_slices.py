"""Step metrics sliced by response length: reward, accuracy, clip fraction and GSPO sequence ratio per bucket.

Buckets: ``trainer.length_buckets`` equal-width ranges of response length (tokens, EOS included) over
``[0, rollout.max_response_tokens]``, the same at every step, so a bucket's curve follows the same lengths
through training (quantiles of each step's lengths would move with the policy). Bucket ``i`` of ``B`` over
``L`` tokens holds the lengths ``lo_i..hi_i`` with ``hi_i = ceil(L (i + 1) / B)``, ``lo_0 = 0`` and
``lo_i = hi_{i-1} + 1``.

Keys (``length/<lo>-<hi>/...``): ``count`` (responses of the step in the bucket), ``reward_mean``,
``accuracy`` (from the rollout and its verdicts), ``clip_fraction`` (clipped units over units, a unit being a
sequence for GSPO and a token for GRPO, as ``actor/clip_fraction``) and ``seq_ratio_mean`` (mean GSPO
sequence ratio ``s_i``, Eq. 7, over the optimizer steps, as ``actor/seq_ratio_mean``), both from the learner's
per-length sums. A bucket without responses has only its ``count`` (0).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence


def bucket_ranges(max_len: int, num_buckets: int) -> list[tuple[int, int]]:
    """The inclusive ``(lo, hi)`` length ranges of ``num_buckets`` equal-width buckets over ``[0, max_len]``
    (``bucket_ranges(80, 4)`` -> ``[(0, 20), (21, 40), (41, 60), (61, 80)]``).

    Raises:
        ValueError: ``num_buckets`` not in ``[1, max_len]`` (the message names ``trainer.length_buckets``).
    """
    if not 1 <= num_buckets <= max_len:
        raise ValueError(f"trainer.length_buckets={num_buckets} must be in [1, rollout.max_response_tokens={max_len}]")
    his = [math.ceil(max_len * (i + 1) / num_buckets) for i in range(num_buckets)]
    return [(0 if i == 0 else his[i - 1] + 1, hi) for i, hi in enumerate(his)]


def bucket_index(length: int, ranges: Sequence[tuple[int, int]]) -> int:
    """The index of the range holding ``length``; a length above the last range counts in the last.

    Raises:
        ValueError: a negative length.
    """
    if length < 0:
        raise ValueError(f"response length {length} is negative")
    for i, (_, hi) in enumerate(ranges):
        if length <= hi:
            return i
    return len(ranges) - 1


def _label(r: tuple[int, int]) -> str:
    return f"length/{r[0]}-{r[1]}"


def rollout_slices(lengths: Sequence[int], rewards: Sequence[float], correct: Sequence[bool],
                   ranges: Sequence[tuple[int, int]]) -> dict[str, float]:
    """``count``, ``reward_mean`` (over valid, non-NaN rewards) and ``accuracy`` per bucket.

    Args:
        lengths: response length of each completion, tokens.
        rewards: its reward (NaN = invalid sample, left out of ``reward_mean``).
        correct: its verdict.
        ranges: from ``bucket_ranges``.

    Raises:
        ValueError: the three sequences differ in length.
    """
    if not len(lengths) == len(rewards) == len(correct):
        raise ValueError(f"{len(lengths)} lengths, {len(rewards)} rewards and {len(correct)} verdicts")
    count = [0] * len(ranges)
    rew_sum, rew_n, acc = [0.0] * len(ranges), [0] * len(ranges), [0] * len(ranges)
    for n, r, ok in zip(lengths, rewards, correct):
        b = bucket_index(n, ranges)
        count[b] += 1
        acc[b] += int(bool(ok))
        if not math.isnan(r):
            rew_sum[b] += r
            rew_n[b] += 1
    out: dict[str, float] = {}
    for b, rng in enumerate(ranges):
        out[f"{_label(rng)}/count"] = float(count[b])
        if count[b]:
            out[f"{_label(rng)}/accuracy"] = acc[b] / count[b]
            if rew_n[b]:
                out[f"{_label(rng)}/reward_mean"] = rew_sum[b] / rew_n[b]
    return out


def learner_slices(by_length: Mapping[int, Sequence[float]], ranges: Sequence[tuple[int, int]]) -> dict[str, float]:
    """``clip_fraction`` and ``seq_ratio_mean`` per bucket from the learner's per-length sums
    ``{length: [sequences, sum of s_i, clipped units, units]}`` (``learner.contracts.RolloutTrainResult.
    by_response_length``). Buckets without a sequence get no key."""
    sums = [[0.0, 0.0, 0.0, 0.0] for _ in ranges]
    for length, vals in by_length.items():
        acc = sums[bucket_index(int(length), ranges)]
        for j in range(4):
            acc[j] += float(vals[j])
    out: dict[str, float] = {}
    for (n_seq, ratio_sum, clipped, units), rng in zip(sums, ranges):
        if n_seq:
            out[f"{_label(rng)}/seq_ratio_mean"] = ratio_sum / n_seq
        if units:
            out[f"{_label(rng)}/clip_fraction"] = clipped / units
    return out


def plot_length_slices(history: list[dict[str, Any]], out: Path) -> Path | None:
    """Reward, accuracy, clip fraction and sequence ratio per length bucket against the step (2x2, one line
    per bucket), from the ``length/*`` keys of ``history``; None when no step logged them."""
    labels = sorted({k.rsplit("/", 1)[0] for r in history for k in r if k.startswith("length/")},
                    key=lambda s: int(s.split("/")[1].split("-")[0]))
    if not labels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward_mean", "reward (train rollouts)"), ("accuracy", "accuracy (train rollouts)"),
              ("clip_fraction", "clip fraction"), ("seq_ratio_mean", "sequence ratio s_i (mean)")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (metric, title) in zip(axes.flat, panels):
        for label in labels:
            key = f"{label}/{metric}"
            pts = [(r["step"], r[key]) for r in history if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3,
                        label=label.split("/")[1] + " tokens")
        ax.set_title(f"{title} by response length")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
