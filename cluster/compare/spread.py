"""What differs beyond the spread over seeds in an equal-budget comparison (``cluster/compare/report.py``).

With a handful of seeds per arm, a test statistic is not worth much; the rule here is plain and conservative:
an arm differs from the baseline arm on a figure when the ranges (min to max over seeds) of the two do not
overlap. If the arms did not differ, the seeds' values would be exchangeable, and two arms of ``n`` seeds each
would have disjoint ranges by chance with probability ``2 / C(2n, n)`` (0.1 for 3 seeds, 0.029 for 4): the
report says so, together with how many (arm, figure) pairs were looked at, so the reader can weigh a single
"beyond" against the number of tries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

FIGURES = (("final_accuracy", "final acc"), ("best_accuracy", "best acc"), ("reward", "reward (last ¼)"))


def chance_disjoint(n_a: int, n_b: int) -> float:
    """Probability that ``n_a`` and ``n_b`` exchangeable distinct values split into two disjoint ranges as the
    two groups: ``2 / C(n_a + n_b, n_a)`` (1 / C when one group is empty or sizes differ only by order)."""
    if n_a < 1 or n_b < 1:
        return 1.0
    return min(1.0, 2.0 / math.comb(n_a + n_b, n_a))


def _finite(xs: Sequence[float]) -> list[float]:
    return [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


def spread_lines(per_arm: Mapping[str, Mapping[str, Sequence[float]]], baseline: str) -> list[str]:
    """Markdown lines: for each arm other than ``baseline`` and each figure of ``FIGURES``, the difference of
    means and whether the two seed ranges are disjoint ("beyond the spread") or not ("within").

    Args:
        per_arm: ``{arm: {figure key: [value per seed]}}`` (NaN values are left out).
        baseline: the arm the others are compared with (the first arm of the comparison).

    Returns:
        The section's lines, starting with its heading; a line saying so when there is nothing to compare.
    """
    lines = [f"## Differences beyond the spread (against {baseline})", ""]
    base = per_arm.get(baseline, {})
    tried, found, expected = 0, [], 0.0
    for arm, figures in per_arm.items():
        if arm == baseline:
            continue
        cells = []
        for key, label in FIGURES:
            a, b = _finite(figures.get(key, [])), _finite(base.get(key, []))
            if len(a) < 2 or len(b) < 2:
                continue
            tried += 1
            expected += chance_disjoint(len(a), len(b))
            beyond = max(a) < min(b) or min(a) > max(b)
            diff = sum(a) / len(a) - sum(b) / len(b)
            cells.append(f"{label} {diff:+.3f} ({'**beyond**' if beyond else 'within'}: "
                         f"{min(a):.3f}–{max(a):.3f} vs {min(b):.3f}–{max(b):.3f})")
            if beyond:
                found.append(f"{arm} {label}")
        if cells:
            lines.append(f"- {arm}: " + "; ".join(cells))
    if not tried:
        return lines + ["Fewer than two seeds per arm: no spread to compare against.", ""]
    lines += ["", f"Rule: the seed ranges (min–max) of the arm and of {baseline} do not overlap. With no real "
              "difference that happens by chance with probability 2 / C(n_a + n_b, n_a) per (arm, figure) pair "
              f"(0.1 for 3 seeds each); {tried} pairs were looked at, so about {expected:.1f} would be expected "
              "by chance alone (the pairs are not independent: the arms share the baseline's seeds). "
              f"Beyond the spread: {', '.join(found) if found else 'nothing'}.", ""]
    return lines
