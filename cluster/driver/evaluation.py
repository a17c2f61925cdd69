"""Held-out evaluation: greedy accuracy, and from k samples per prompt pass@k (unbiased estimator) and mean@k.

``pass@k`` is the probability that at least one of k samples is correct, estimated per prompt from ``n``
samples of which ``c`` are correct with the unbiased estimator of Chen et al. 2021 ("Evaluating Large
Language Models Trained on Code", arXiv 2107.03374, Eq. 1)::

    pass@k = E_prompts[ 1 - C(n - c, k) / C(n, k) ]

and ``mean@k`` is the mean accuracy over the k samples, ``E_prompts[c / k]`` (with ``n = k``; it equals the
unbiased pass@1). The samples are drawn at the rollout temperature (the policy being trained), beside the
greedy accuracy of ``evaluate``.
"""

from __future__ import annotations

import math
import time
from typing import Any

from cluster.common import mean
from cluster.config import Config
from cluster.driver.collect import score
from rollout.contracts import PromptRow

EVAL_SAMPLING_SEED = 2_000_003  # + rollout.seed: the same held-out samples' randomness at every evaluation


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from ``n`` samples with ``c`` correct: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al. 2021, arXiv 2107.03374, Eq. 1), exact in integers (``math.comb``) before the one division.

    Raises:
        ValueError: ``n < 1``, ``k`` not in ``[1, n]`` or ``c`` not in ``[0, n]`` (the message names them).
    """
    if n < 1 or not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def reported_ks(n: int) -> list[int]:
    """The k of the pass@k reported from ``n`` samples per prompt: the powers of two below ``n``, and ``n``
    (``n=6`` -> ``[1, 2, 4, 6]``).

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"trainer.eval_samples must be >= 1 to report pass@k, got {n}")
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def sampled_metrics(correct: list[list[bool]]) -> dict[str, float]:
    """``eval/pass@<k>`` for every k of ``reported_ks(n)`` and ``eval/mean@<n>`` over prompts, from the
    verdicts of ``n`` samples per prompt (``correct[i][j]``: sample j of prompt i judged correct).

    Raises:
        ValueError: no prompt, or prompts with different sample counts.
    """
    if not correct:
        raise ValueError("no held-out prompt to compute pass@k over")
    n = len(correct[0])
    if any(len(c) != n for c in correct):
        raise ValueError(f"every prompt needs the same number of samples, got {sorted({len(c) for c in correct})}")
    counts = [sum(1 for x in c if x) for c in correct]
    out = {f"eval/pass@{k}": sum(pass_at_k(n, c, k) for c in counts) / len(counts) for k in reported_ks(n)}
    out[f"eval/mean@{n}"] = sum(c / n for c in counts) / len(counts)
    return out


def evaluate_sampled(fleet: Any, rewards: Any, rows: list[PromptRow], k: int, seed: int) -> dict[str, float]:
    """Sample ``k`` completions per held-out prompt at the rollout temperature (seeded with ``seed``), score
    them with the reward pool and return ``sampled_metrics`` plus ``eval/sampled_response_length_mean``
    (tokens). ``fleet``: ``cluster.runtime.services.EngineFleet``; ``rewards``: ``reward.pool.RewardPool``."""

    comps = fleet.generate(rows, k, seed=seed)
    results = score(rewards, {r.uid: r for r in rows}, comps)
    rewards.metrics()  # eval's counters are not the step's
    correct = [[bool(r.correct) for r in results[i * k : (i + 1) * k]] for i in range(len(rows))]
    out = sampled_metrics(correct)
    out["eval/sampled_response_length_mean"] = sum(len(c.response_token_ids) for c in comps) / max(len(comps), 1)
    return out


def evaluate(cfg: Config, fleet: Any, rewards: Any, rows: list[PromptRow], episodes: Any = None) -> dict[str, float]:
    """Greedy decoding on the held-out ``rows``; accuracy = share judged correct by the verifier. With
    ``trainer.eval_samples`` = k > 0 also k samples per prompt at the rollout temperature (the same seed at
    every evaluation): ``eval/pass@j`` and ``eval/mean@k``. ``fleet``: ``cluster.runtime.services.EngineFleet``;
    ``rewards``: ``reward.pool.RewardPool``; ``episodes``: None, or the ``agent_loop.EpisodeRunner`` whose greedy
    episodes are evaluated instead (judged by their environments; ``eval/turns_mean``, ``eval/tool_calls_mean``).
    Returns the ``eval/*`` metrics and ``timing/eval_s``; ``eval/infra_failed`` counts the greedy samples a service
    failed (``reward.infra``: judged not correct, so an accuracy that drops with it is the service's)."""
    t = time.perf_counter()
    if episodes is not None:
        return {**evaluate_episodes(cfg, episodes, rows), "timing/eval_s": time.perf_counter() - t}
    comps = fleet.generate(rows, 1, greedy=True)
    results = score(rewards, {r.uid: r for r in rows}, comps)
    rewards.metrics()  # eval's counters are not the step's
    out = {
        "eval/accuracy": mean([1.0 if r.correct else 0.0 for r in results]),
        "eval/num_prompts": float(len(results)),
        "eval/infra_failed": float(sum(bool(r.infra_failed) for r in results)),
        "eval/response_length_mean": mean([float(len(c.response_token_ids)) for c in comps]),
    }
    k = cfg.trainer.eval_samples
    if k:
        out.update(evaluate_sampled(fleet, rewards, rows, k, seed=cfg.rollout.seed + EVAL_SAMPLING_SEED))
    out["timing/eval_s"] = time.perf_counter() - t
    return out


def evaluate_episodes(cfg: Config, episodes: Any, rows: list[PromptRow]) -> dict[str, float]:
    """``evaluate`` for multi-turn episodes: one greedy episode per held-out row, and with
    ``trainer.eval_samples`` = k > 0 k episodes at the rollout temperature (``sampled_metrics``)."""
    comps, results, agent, _ = episodes.run(rows, 1, EVAL_SAMPLING_SEED, temperature=0.0)
    out = {"eval/accuracy": mean([1.0 if r.correct else 0.0 for r in results]), "eval/num_prompts": float(len(rows)),
           "eval/infra_failed": float(sum(bool(r.infra_failed) for r in results)),
           "eval/response_length_mean": mean([float(len(c.response_token_ids)) for c in comps]),
           "eval/turns_mean": agent["agent/turns_mean"], "eval/tool_calls_mean": agent["agent/tool_calls_mean"]}
    k = cfg.trainer.eval_samples
    if k:
        _, sampled, _, _ = episodes.run(rows, k, cfg.rollout.seed + EVAL_SAMPLING_SEED)
        out.update(sampled_metrics([[bool(r.correct) for r in sampled[i * k: (i + 1) * k]] for i in range(len(rows))]))
    return out
