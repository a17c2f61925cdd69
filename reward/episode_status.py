"""An episode's statuses, in one place: the env worker (``reward.env_worker``), the agent loop and the agent
programs' episodes (``cluster/driver``) all speak of an episode's end with these names, and group them here.

They are plain strings (not an Enum): they travel in Ray results (``EnvStart``, ``EnvStep``, ``EnvOutcome``), in
a verdict's ``detail["episode"]`` / ``detail["env"]`` and in metric names (``env/<status>``), and ``timeout`` and
``error`` are also the statuses of a deadline-bound call (``reward.runner.CallOutcome``), which an env worker's
failed call hands on to its episode as they are. ``cluster/`` may import this module; it imports nothing.

How each ends, and how it is scored:

- ``RUNNING``: under way (no end yet).
- ``OK``: the environment said done (for an agent program: it returned, or closed its session, with status
  ``ok``); scored by the environment's ``reward()``, or the agent's reward, or the row's verifier.
- ``MAX_TURNS``: cut at ``env.max_turns``; scored as it stands (``reward()``).
- ``CUT``: (env worker) finished before the environment said done, e.g. at the driver's token budget; scored
  as it stands (``reward()``).
- ``CUT_TOKENS``: (driver) a turn cut at its token limit, or no room left in ``rollout.max_model_len`` for the
  next; scored as it stands (the env worker sees it as ``CUT``; an agent's reward or the verifier).
- ``TIMEOUT``: the environment, a tool or the agent ran past its deadline (``env.tool_timeout_s``,
  ``env.episode_timeout_s``), or a service did not answer in time; failed.
- ``ERROR``: the environment raised or broke its contract, the agent raised or closed its session with an
  error, a service failed, or the episode's env worker died; failed.

A failed episode is scored by ``env.on_error`` (0.0, or NaN: dropped), unless the failure was a service's, not
the model's (``reward.infra``: the env worker died, an OpenEnv server died or timed out, the sandbox could not
start, code that raised ``InfraFailure``): then its cause travels with it (``EnvOutcome.infra_failed``,
``RewardResult.infra_failed``) and ``reward.on_infra_failure`` scores it (NaN, an invalid sample, by default).
"""

from __future__ import annotations

RUNNING = "running"
OK = "ok"
MAX_TURNS = "max_turns"
CUT = "cut"
CUT_TOKENS = "cut_tokens"
TIMEOUT = "timeout"
ERROR = "error"

FAILED = (TIMEOUT, ERROR)  # failed: scored by env.on_error, or by reward.on_infra_failure when a service's (reward.infra)
SCORED = (OK, MAX_TURNS, CUT, CUT_TOKENS)  # ended and scored as they stand (reward(), the agent, the verifier)

__all__ = ["CUT", "CUT_TOKENS", "ERROR", "FAILED", "MAX_TURNS", "OK", "RUNNING", "SCORED", "TIMEOUT"]
