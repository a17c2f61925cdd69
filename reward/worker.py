"""The reward worker: scores completions with the configured verifiers through the protected runner (exact match
in the worker itself, see below).

A plain class; ``reward.pool.RewardPool`` wraps it as a Ray actor. The score of one completion is

    ``primary_weight * primary + sum_i w_i * term_i + overlong_penalty``

where ``primary`` is ``cfg.verifier`` (or the row's own ``verifier``) and alone decides ``correct``. A call
that times out scores ``cfg.timeout_score``, one that raises ``cfg.error_score`` (both 0 by default); a
verifier that returns something that is not a finite number (or a dict with one under ``score``) makes the score
NaN: an invalid sample, which the advantage computation gives advantage 0 and leaves out of its group's
statistics. A call whose process dies without answering, or whose verifier raised ``reward.infra.InfraFailure``
(the sandbox could not start a run), failed for a reason outside the response: the sample is scored by
``reward.on_infra_failure`` (NaN by default) and marked (``RewardResult.infra_failed``).

Calls run in chunks of up to ``cfg.calls_per_child`` per verifier process, each with its own timeout (see
``reward.runner``); calls of the verifiers in ``cfg.isolated_verifiers`` (default ``code``: a sandbox run
costs far more than a fork, and a process of its own keeps sandbox bookkeeping per call) get a process each.
The built-ins in ``cfg.inline_verifiers`` (default ``exact``, and only those of ``reward.config.INLINE_SAFE``:
string comparisons linear in the response) run in the worker itself, with no process at all.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

from reward.contracts import RewardRequest, RewardResult
from reward.config import RewardConfig
from reward.infra import DETAIL_KEY, Cause, detail_cause, infra_score
from reward.runner import CallOutcome, ProtectedRunner
from reward.sandbox import SandboxUnavailable, announce
from reward.verifiers import get_verifier


def overlong_penalty(num_tokens: int, max_len: int, buffer_len: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13).

    ``0`` when ``num_tokens <= max_len - buffer_len``; ``((max_len - buffer_len) - num_tokens) / buffer_len``
    (linear from 0 down to -1) inside the buffer; ``-1`` beyond ``max_len``. Lengths are in tokens.

    Raises:
        ValueError: ``buffer_len`` not in ``[1, max_len]`` or ``num_tokens < 0``.
    """
    if not 1 <= buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len={buffer_len} must be in [1, max_len={max_len}]")
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    start = max_len - buffer_len
    if num_tokens <= start:
        return 0.0
    if num_tokens <= max_len:
        return (start - num_tokens) / buffer_len
    return -1.0


def inline_call(fn: Any, response: str, row: dict) -> CallOutcome:
    """``fn(response, row)`` in this process, as the protected runner reports a call: ``ok`` with the value,
    or ``error`` naming the exception (for ``reward.config.INLINE_SAFE`` verifiers only)."""
    t = time.perf_counter()
    try:
        return CallOutcome("ok", fn(response, row), {}, time.perf_counter() - t)
    except Exception as err:  # noqa: BLE001 - reported as the runner reports a raising verifier
        return CallOutcome("error", None, {"error": type(err).__name__, "message": str(err)[:500]},
                           time.perf_counter() - t)


def interpret(outcome: CallOutcome, cfg: RewardConfig) -> tuple[float, bool | None, str, dict]:
    """``(score, correct or None, status, detail)`` of one verifier call outcome.

    A call past ``reward.timeout_s`` scores ``reward.timeout_score`` and one whose verifier raised
    ``reward.error_score`` (the response made it so: the model's); one whose process or fork server died
    (``VerifierDied``, ``RunnerLost``: ``worker_lost``) or whose verifier raised ``reward.infra.InfraFailure`` (the
    sandbox could not start, ...) is an infra failure: ``reward.on_infra_failure``'s score, its cause in
    ``detail["infra"]``."""
    if outcome.status == "timeout":
        return cfg.timeout_score, False, "timeout", dict(outcome.detail)
    if outcome.status != "ok":
        cause = detail_cause(outcome.detail)
        if cause is None and outcome.detail.get("error") in ("VerifierDied", "RunnerLost"):  # missing, not wrong
            cause = Cause.WORKER_LOST.value
        if cause is not None:
            return infra_score(cfg.on_infra_failure), False, "error", {**outcome.detail, DETAIL_KEY: cause}
        return cfg.error_score, False, "error", dict(outcome.detail)
    value, correct, extra = outcome.value, None, {}
    if isinstance(value, dict):
        extra = {k: v for k, v in value.items() if k not in ("score", "correct")}
        correct = value.get("correct") if isinstance(value.get("correct"), bool) else None
        value = value.get("score")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return math.nan, False, "error", {"error": "InvalidScore", "message": f"verifier returned {value!r}"}
    return float(value), correct, "ok", extra


class RewardWorker:
    """Scores ``RewardRequest`` lists; every verifier call is protected (timeout, killed process group) but those
    of ``reward.inline_verifiers`` (exact match, run here: ``inline_call``).

    At construction it logs, once, what the ``plain`` sandbox backend does not stop when the config chose it,
    and checks that bubblewrap works when ``code`` is a configured verifier.

    Raises (at construction):
        ValueError: an unknown verifier name in ``cfg.verifier`` / ``cfg.extra_terms``, or overlong shaping
            on (``overlong_buffer_len > 0``) without ``max_response_tokens``.
        reward.sandbox.SandboxUnavailable: ``code`` is configured, the backend is ``bwrap`` and bubblewrap
            does not work here (``score`` raises it too, for a row's own ``code`` verifier).
    """

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        if cfg.sandbox.backend == "plain" or "code" in [cfg.verifier] + [t.verifier for t in cfg.extra_terms]:
            announce(cfg.sandbox)
        self._verifiers: dict[str, Any] = {}
        for name in [cfg.verifier] + [t.verifier for t in cfg.extra_terms]:
            if name is not None:
                self._verifier(name)
        if cfg.overlong_buffer_len and cfg.max_response_tokens is None:
            raise ValueError(
                f"reward.overlong_buffer_len={cfg.overlong_buffer_len} needs reward.max_response_tokens (L_max)"
            )
        user_modules = [n.partition(":")[0] for n in self._verifiers if ":" in n]
        self.runner = ProtectedRunner(cfg.timeout_s, cfg.verifier_memory_mb, list(cfg.preload) + user_modules,
                                      cfg.parallel_calls, cfg.calls_per_child)
        self._isolated = set(cfg.isolated_verifiers)
        self._inline = set(cfg.inline_verifiers) - self._isolated

    def _verifier(self, name: str):
        if name not in self._verifiers:
            self._verifiers[name] = get_verifier(name, self.cfg)
            if ":" in name and getattr(self, "runner", None) is not None:
                self.runner.preload_modules([name.partition(":")[0]])
        return self._verifiers[name]

    def close(self) -> None:
        """Stop this worker's verifier fork server."""
        self.runner.close()

    def pid(self) -> int:
        """OS process id of this worker."""
        return os.getpid()

    def score(self, requests: list[RewardRequest]) -> list[RewardResult]:
        """One ``RewardResult`` per request, in order. Never raises for bad responses or verifier failures;
        an unknown verifier name on a row gives that row an ``error`` result with score NaN.

        Raises:
            reward.sandbox.SandboxUnavailable: a ``code`` call found that bubblewrap does not work here.
        """
        cfg = self.cfg
        calls, alone, here, plan = [], [], [], []  # plan[i] = (primary call index or error, [(term call index, term)])
        for req in requests:
            row = dataclasses.asdict(req.row) if dataclasses.is_dataclass(req.row) else dict(req.row)
            name = cfg.verifier or req.row.verifier
            try:
                fn = self._verifier(name)
            except ValueError as err:
                plan.append((str(err), []))
                continue
            calls.append((fn, req.response, row))
            alone.append(name in self._isolated)
            here.append(name in self._inline)
            primary = len(calls) - 1
            terms = []
            for term in cfg.extra_terms:
                calls.append((self._verifier(term.verifier), req.response, row))
                alone.append(term.verifier in self._isolated)
                here.append(term.verifier in self._inline)
                terms.append((len(calls) - 1, term))
            plan.append((primary, terms))
        outcomes = self.run_calls(calls, alone, here)
        for out in outcomes:  # a configuration problem, not a bad response: scoring code as 0 would train on it
            if out.status == "error" and out.detail.get("error") == "SandboxUnavailable":
                raise SandboxUnavailable(out.detail.get("message", "bubblewrap does not work here"))
        return [self._combine(req, p, outcomes) for req, p in zip(requests, plan)]

    def run_calls(self, calls: list[tuple[Any, str, dict]], alone: list[bool], inline: list[bool]) -> list[CallOutcome]:
        """Outcomes of ``calls`` in order: those flagged ``inline`` (named in ``cfg.inline_verifiers``) here
        (``inline_call``), the rest through the protected runner."""
        here = [i for i in range(len(calls)) if inline[i]]
        away = [i for i in range(len(calls)) if not inline[i]]
        outcomes: list[CallOutcome | None] = [None] * len(calls)
        for i in here:
            outcomes[i] = inline_call(*calls[i])
        for i, out in zip(away, self.runner.run([calls[i] for i in away], [alone[i] for i in away])):
            outcomes[i] = out
        return outcomes

    def _combine(self, req: RewardRequest, plan, outcomes: list[CallOutcome]) -> RewardResult:
        cfg = self.cfg
        primary, terms = plan
        if isinstance(primary, str):
            return RewardResult(math.nan, False, "error", {"error": "UnknownVerifier", "message": primary}, 0.0)
        out = outcomes[primary]
        score, correct, status, detail = interpret(out, cfg)
        cause = detail_cause(detail)
        elapsed = out.elapsed_s
        if correct is None:
            correct = score >= 1.0
        total = cfg.primary_weight * score
        if terms:
            detail["terms"] = {}
        for idx, term in terms:
            t_score, _, t_status, t_detail = interpret(outcomes[idx], cfg)
            cause = cause or detail_cause(t_detail)
            elapsed += outcomes[idx].elapsed_s
            total += term.weight * t_score
            detail["terms"][term.verifier] = t_score
            if t_status != "ok" and status == "ok":
                status, detail["term_failure"] = t_status, {"verifier": term.verifier, **t_detail}
        if cfg.overlong_buffer_len:
            pen = cfg.overlong_penalty_factor * overlong_penalty(
                req.num_response_tokens, cfg.max_response_tokens, cfg.overlong_buffer_len
            )
            detail["overlong_penalty"] = pen
            total += pen
        if cfg.mask_truncated and req.truncated:
            detail["masked"] = "truncated"
            total = math.nan
        if cause is not None:  # a call that failed for the service's reason: the whole sample is the service's
            total, detail[DETAIL_KEY] = infra_score(cfg.on_infra_failure), cause
        return RewardResult(float(total), bool(correct), status, detail, elapsed, infra_failed=cause or "")
