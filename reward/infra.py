"""Failures outside the model's output ("infrastructure failures"), in one place: their causes, how a sample they
hit is scored, and how they are counted. Every path that scores a sample uses it: the reward workers and their
pool (``reward.worker``, ``reward.pool``), the code sandbox (``reward.verifiers.code_verifier``,
``reward.envs.python_tool``), the env workers (``reward.env_worker``, OpenEnv's ``reward.openenv_env``), the agent
loop and the gateway's agent episodes (``cluster/driver``), the LLM judge (``cluster/runtime/judge.py``) and the
distillation teacher (``cluster/driver/distill.py``). docs/agents.md, "Whose failure is it", has the rule and what
falls on each side.

The rule: a sample whose reward could not be computed for a reason outside the model's output is not a wrong
answer. By default (``reward.on_infra_failure: invalid``) it is an invalid sample: reward NaN, advantage 0, left
out of its group's statistics; ``zero`` scores it 0 as before. Either way it is marked
(``RewardResult.infra_failed``, ``EnvOutcome.infra_failed``: the cause's name) and counted per step
(``reward/infra_failed``, ``reward/infra_failed/<cause>``). A failure the model caused, or one that cannot be told
apart from it (an environment's or agent's own code raising or running past its deadline), keeps the score its
own switch gives (``env.on_error``, ``reward.timeout_score``, ``reward.error_score``).

Code that talks to a service (a user environment, tool or agent program) says a failure is the service's by
raising ``InfraFailure`` with its cause; the env worker and the verifier runner carry the cause through as
``detail["infra"]``. This module imports nothing of the project.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Iterable

#: the metric counting a step's infra-failed samples; ``<METRIC>/<cause>`` counts them by cause
METRIC = "reward/infra_failed"
#: the key of a failure's cause in an outcome's ``detail`` (a ``Cause`` value)
DETAIL_KEY = "infra"


class Cause(str, enum.Enum):
    """Why a sample got no reward, when the model's output is not the reason (values: metric and detail names)."""

    WORKER_LOST = "worker_lost"  # a reward or env worker's process (or a verifier's process) died under the call
    SERVICE_TIMEOUT = "service_timeout"  # a service (an OpenEnv server, ...) did not answer within its deadline
    SERVER_DIED = "server_died"  # a server closed the connection, died, or would not start again
    SERVICE_ERROR = "service_error"  # a service answered with an error that is not about the model's action
    SANDBOX_START = "sandbox_start"  # the sandbox could not start a run of the model's code
    JUDGE_FAILED = "judge_failed"  # the LLM judge's engine raised, died or passed reward.judge.timeout_s
    TEACHER_FAILED = "teacher_failed"  # the distillation teacher's engine raised, died or passed distill.timeout_s


CAUSES = tuple(c.value for c in Cause)


class InfraFailure(RuntimeError):
    """A failure outside the model's output: raise it from an environment, a tool, an agent program or a verifier
    when a service it depends on failed, so that the sample is invalid (``reward.on_infra_failure``) instead of
    scored as the model's failure.

    Args:
        cause: a ``Cause`` (or its value).
        message: what failed, for the logs.

    Raises:
        ValueError: an unknown cause.
    """

    def __init__(self, cause: Cause | str, message: str = ""):
        self.cause = Cause(cause)
        super().__init__(message or self.cause.value)


def cause_of(err: BaseException) -> str | None:
    """The cause's value when ``err`` is an ``InfraFailure``, else None."""
    return err.cause.value if isinstance(err, InfraFailure) else None


def detail_cause(detail: dict[str, Any] | None) -> str | None:
    """The cause recorded in an outcome's ``detail`` (``detail["infra"]``) when it is a known one, else None."""
    value = (detail or {}).get(DETAIL_KEY)
    return value if value in CAUSES else None


def infra_score(policy: str) -> float:
    """The reward of an infra-failed sample under ``reward.on_infra_failure``: NaN for ``invalid``, 0.0 for ``zero``.

    Raises:
        ValueError: another policy.
    """
    if policy == "invalid":
        return math.nan
    if policy == "zero":
        return 0.0
    raise ValueError(f"reward.on_infra_failure={policy!r} must be 'invalid' or 'zero'")


def counts(causes: Iterable[str | None]) -> dict[str, float]:
    """``{METRIC: n, METRIC/<cause>: n_cause}`` over the samples' causes (None or "" = not infra-failed);
    ``METRIC`` is always there (0.0 when none failed), a cause only when it occurred."""
    out = {METRIC: 0.0}
    for cause in causes:
        if cause:
            out[METRIC] += 1.0
            key = f"{METRIC}/{cause}"
            out[key] = out.get(key, 0.0) + 1.0
    return out


def add_counts(into: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """``into`` with the ``counts`` of ``more`` added key by key (in place); returns ``into``."""
    for key, value in more.items():
        into[key] = into.get(key, 0.0) + value
    return into


__all__ = ["CAUSES", "Cause", "DETAIL_KEY", "InfraFailure", "METRIC", "add_counts", "cause_of", "counts",
           "detail_cause", "failed_reward", "infra_score"]


def failed_reward(env_cfg: Any, reward_cfg: Any, cause: str | None) -> float:
    """The reward of an episode that failed (``env_cfg``: the ``env`` section, ``reward_cfg``: the ``reward``
    one): ``reward.on_infra_failure``'s (NaN or 0) when ``cause`` names a service's failure (a ``Cause`` value),
    else ``env.on_error``'s (0, or NaN for ``drop``)."""
    if cause:
        return infra_score(reward_cfg.on_infra_failure)
    return 0.0 if env_cfg.on_error == "zero" else float("nan")
