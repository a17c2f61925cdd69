"""The env worker: the multi-turn episodes under way on one worker, each in its own ``Environment``.

A plain class; the driver wraps it as a Ray actor (as ``reward.pool`` does ``RewardWorker``). It is
thread-safe, so the actor may take several calls at once (``max_concurrency``) and step different episodes in
parallel; the calls of one episode are serialised. Results are plain dataclasses of Python values (picklable).

An episode: ``start`` (build the environment, its first messages and tool schemas), ``step`` once per
assistant turn until a step says ``done``, then ``finish`` (its reward; the environment is closed), or
``abort`` at any time (closed, no reward).

**Deadlines.** Every environment call (constructor with ``initial_messages`` and ``tools``, ``step``,
``reward``, ``close``) runs in a thread of its own with a deadline (``reward.deadline``) of
``env.tool_timeout_s`` seconds. Inside ``step``, each tool call run through ``Environment.call_tools`` /
``run_tool_call`` (the default ``step`` runs them so) gets a thread and that deadline of its own
(``reward.environment.run_with_tool_deadline``); the step as a whole gets the deadline once more than it has
tool calls (a backstop for the environment's own code around them). A call or tool call past its deadline
ends its episode with status ``timeout``; its thread cannot be killed and is abandoned
(``abandoned_threads``: the driver replaces a worker holding more than ``env.max_abandoned_threads``). An
environment whose start runs past the deadline and returns later is never closed (its thread is abandoned
before the worker holds it). A tool past its deadline ends the episode rather than going back to the model as
an error: its thread may still change the environment's state, which can no longer be trusted. Each call's
seconds are measured (``seconds`` of the results, ``env/time_s``).

**What ends an episode and what goes back to the model.**

- Back to the model, as ``{"role": "tool", ...}`` observations starting with ``Error:``, the episode going on:
  a tool that raises (kind ``raised``), an unknown tool (``unknown_tool``), arguments that do not fit
  (``bad_arguments``): see ``reward.environment.run_tool_call``; and the caller's ``parse_errors`` (tool calls
  the parser could not read; kind ``parse``; no ``name``), put before the step's own messages. These are the
  model's mistakes: it can learn to avoid them, and they are counted by kind (``tool_errors``,
  ``env/tool_errors/<kind>``). A turn whose only calls failed to parse is not a final answer: it never ends
  the episode, whatever ``step`` said about ``done`` (the model gets its errors back; ``max_turns`` bounds it).
- The episode ends (status ``timeout`` or ``error``; ``detail`` has the method, the exception type and its
  message, truncated): an environment method that raises, a call past its deadline, or an environment that
  breaks the contract (``initial_messages`` or ``step`` returning something else than described in
  ``reward.environment``; a reward that is not a finite number or dict of them). These are the environment's
  faults: the environment is closed at once and the episode's reward is 0 (``env.on_error: zero``) or NaN
  (``drop``: an invalid sample, advantage 0, left out of its group's statistics), never an exception out of
  the worker. Where the failure is a service's, not the model's (``reward.infra``: a method or tool raised
  ``InfraFailure``, e.g. an OpenEnv server that died or did not answer in time, a sandbox that could not start;
  an OpenEnv server that would not start again), the outcome says so (``EnvOutcome.infra_failed``, the cause)
  and the reward is ``reward.on_infra_failure``'s instead: NaN (invalid) by default.
- Raised to the caller (a configuration or driver mistake, not an episode outcome): a tool without a usable
  schema (``ToolSchemaError``, from ``start``), an unknown episode id (``UnknownEpisode``), an id started
  twice (``ValueError``).

An ``error`` in ``close`` after a good episode does not change its reward: it is counted
(``env/close_errors``) and noted in the outcome's ``detail["close"]``.

**OpenEnv** (``env.openenv``): the worker starts the environment's server when it starts (``app``; or uses
``url``) and stops it in ``close``; every episode is an ``reward.openenv_env.OpenEnvEnvironment``, one session
on it. A started server found dead when an episode starts is started again (``env/openenv_restarts``); one that
will not start again fails that episode's start (status ``error``).
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from reward.config import EnvConfig, RewardConfig
from reward.deadline import MESSAGE_CHARS, DeadlineRunner, error_detail
from reward.environment import (
    Environment,
    StepResult,
    ToolsEnvironment,
    ToolSchemaError,
    episode_reward,
    load_environment_class,
    load_tools,
    needs_sandbox,
    run_with_tool_deadline,
    tool_error_message,
    tool_schemas,
)
from reward.episode_status import CUT, FAILED, MAX_TURNS, OK, RUNNING
from reward.infra import Cause, detail_cause, failed_reward
from reward.runner import CallOutcome
from reward.verifiers import as_row_dict, get_verifier


class UnknownEpisode(KeyError):
    """No open episode has this id on this worker (never started, already finished or aborted, or lost with a
    restarted worker process)."""


@dataclass
class EnvStart:
    """An episode's start.

    Attributes:
        messages: the chat it starts from (``{"role": str, "content": str}`` dicts); [] when it failed.
        tool_schemas: the tools' JSON schemas for the chat template's ``tools=`` ([] when none, or failed).
        status: ``"ok"``, ``"timeout"`` or ``"error"`` (then the episode is over: ``finish`` scores it as
            ``env.on_error`` says).
        detail: ``{"method", "error", "message"}`` of a failure, else {}.
        seconds: wall-clock seconds of the environment's start (constructor, messages, tools).
    """

    messages: list[dict]
    tool_schemas: list[dict]
    status: str = OK
    detail: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class EnvStep:
    """The environment's answer to one assistant turn.

    Attributes:
        messages: observation messages for the model (parse errors first, then the environment's own).
        done: the episode is over (the environment said so, ``env.max_turns`` was reached, or it failed).
        reward: the environment's per-turn reward (float) or None.
        status: ``"ok"``; ``"max_turns"`` (this was the last turn allowed); ``"timeout"`` or ``"error"`` (the
            environment failed: the episode is over, ``messages`` is empty).
        seconds: wall-clock seconds of the environment's ``step``.
        tool_errors: failed tool calls of this turn by kind (``parse``, ``unknown_tool``, ``bad_arguments``,
            ``raised``).
        detail: ``{"method", "error", "message"}`` of a failure, else {}.
    """

    messages: list[dict]
    done: bool
    reward: float | None = None
    status: str = OK
    seconds: float = 0.0
    tool_errors: dict[str, int] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvOutcome:
    """An episode's result (``finish``).

    Attributes:
        reward: the episode's reward (float): the environment's ``reward()`` (a float, or its components'
            sum); for a failed episode 0.0 (``env.on_error: zero``) or NaN (``drop``: an invalid sample), and
            for one a service failed (``infra_failed``) NaN (``reward.on_infra_failure: invalid``) or 0.0.
        components: the named components of the reward ({} for a plain float or a failed episode).
        status: ``"ok"`` (the environment said done), ``"max_turns"`` (cut at the turn limit), ``"cut"``
            (finished before the environment said done, e.g. at the driver's token budget), all three scored
            by ``reward()``; ``"timeout"`` or ``"error"`` (the environment failed, in any method).
        detail: ``{"method", "error", "message"}`` of a failure; ``"close"``: a failure of ``close``.
        turns: assistant turns stepped.
        seconds: wall-clock seconds spent in the environment over the episode (all its calls).
        correct: ``reward >= 1.0`` (the reward worker's rule for a verifier that does not say), for accuracy.
        infra_failed: the ``reward.infra.Cause`` value of a failure outside the model's output (its reward is then
            ``reward.on_infra_failure``'s), else ``""``.
    """

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    status: str = OK
    detail: dict[str, Any] = field(default_factory=dict)
    turns: int = 0
    seconds: float = 0.0
    correct: bool = False
    infra_failed: str = ""


@dataclass
class _Episode:
    """One open episode (private to the worker). ``state``: running, ok, max_turns, timeout or error
    (``reward.episode_status``)."""

    env: Any = None
    state: str = RUNNING
    detail: dict[str, Any] = field(default_factory=dict)
    turns: int = 0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _check_messages(messages: Any, what: str) -> list[dict]:
    """``messages`` when it is a list of ``{"role": str, "content": str, ...}`` dicts.

    Raises:
        TypeError: anything else (the message says what and where).
    """
    if not isinstance(messages, list):
        raise TypeError(f"{what} must be a list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise TypeError(f"{what}[{i}] must be a dict with str 'role' and 'content', got {m!r}"[:MESSAGE_CHARS])
    return messages


def _check_step(result: Any) -> StepResult:
    """``result`` when it keeps ``StepResult``'s contract.

    Raises:
        TypeError: it is not a ``StepResult``, or a field has the wrong type (a non-finite reward included).
    """
    import math
    import numbers

    if not isinstance(result, StepResult):
        raise TypeError(f"step() must return a StepResult, got {type(result).__name__}")
    _check_messages(result.messages, "StepResult.messages")
    if not isinstance(result.done, bool):
        raise TypeError(f"StepResult.done must be a bool, got {result.done!r}")
    r = result.reward
    if r is not None and not (isinstance(r, numbers.Real) and not isinstance(r, bool) and math.isfinite(r)):
        raise TypeError(f"StepResult.reward must be None or a finite number, got {r!r}")
    if not (isinstance(result.tool_errors, dict) and all(isinstance(k, str) and isinstance(v, int)
                                                          for k, v in result.tool_errors.items())):
        raise TypeError(f"StepResult.tool_errors must be {{kind: count}}, got {result.tool_errors!r}")
    return result


def _contract(method: str, err: Exception) -> CallOutcome:
    return CallOutcome("error", None, error_detail(err, method))


def _timeouts(out: CallOutcome) -> CallOutcome:
    """``out`` with status ``timeout`` where its call raised ``ToolTimeout`` (a tool past its deadline) or an
    ``InfraFailure`` of cause ``service_timeout`` (a server that did not answer in time); else ``out``."""
    if out.status != "error":
        return out
    if out.detail.get("error") == "ToolTimeout":
        return CallOutcome("timeout", None, {**out.detail, "error": "Timeout"}, out.elapsed_s)
    if detail_cause(out.detail) == Cause.SERVICE_TIMEOUT.value:
        return CallOutcome("timeout", None, dict(out.detail), out.elapsed_s)
    return out


def parse_error_message(error: str) -> dict:
    """The observation for a tool call the parser could not read: ``{"role": "tool", "content": "Error: ..."}``
    (no ``name``: no tool was called)."""
    return tool_error_message(f"the tool call could not be parsed: {error}")


class EnvWorker:
    """The episodes under way on one env worker (see the module docstring for the rules).

    Args:
        cfg: the ``env`` config section (must be enabled: ``cls`` or ``tools`` set).
        reward_cfg: the ``reward`` section, for the verifier of a ``ToolsEnvironment`` (``reward.verifier``
            overrides the row's own, as in the reward worker, with its options); default ``RewardConfig()``.
            Its ``sandbox`` settings go to tools that run model-written code (``reward.envs.python_tool``,
            through ``reward.environment.tool_context``).

    Raises (at construction):
        ValueError: the section is off, ``env.cls`` does not name an ``Environment`` subclass, or an
            ``env.tools`` entry cannot be imported or has no usable schema (``ToolSchemaError``).
        reward.sandbox.SandboxUnavailable: a tool runs model code in the sandbox
            (``reward.environment.uses_sandbox``), ``reward.sandbox.backend`` is ``bwrap`` and bubblewrap does
            not work here (as the reward worker refuses the ``code`` verifier then).
        reward.openenv_server.OpenEnvStartError: ``env.openenv``'s server does not start here (``app``: served by
            this worker on 127.0.0.1 until ``close``) or does not answer (``url``).
    """

    def __init__(self, cfg: EnvConfig, reward_cfg: RewardConfig | None = None):
        if not cfg.enabled:
            raise ValueError("env section is off (env.cls and env.tools unset): nothing for an env worker to run")
        self.cfg = cfg
        self.reward_cfg = reward_cfg if reward_cfg is not None else RewardConfig()
        self._env_cls = load_environment_class(cfg.cls) if cfg.cls is not None else None
        self._tools = load_tools(cfg.tools) if cfg.cls is None else []
        self._agents = None  # env.agent: the agent programs under way (reward.agent_runner)
        if cfg.agent is not None:
            from reward.agent_runner import AgentRuns, load_agent

            self._agents = AgentRuns(load_agent(cfg.agent), cfg.episode_timeout_s)
        self._openenv = None
        if cfg.openenv.enabled:
            from reward.openenv_env import OpenEnvBackend

            self._openenv = OpenEnvBackend(cfg)
        if needs_sandbox(self._env_cls, self._tools):
            from reward.sandbox import announce

            announce(self.reward_cfg.sandbox)  # now, not as an error observation of every call
        self._verifiers: dict[str, Callable] = {}
        self._runner = DeadlineRunner("env")
        self._lock = threading.Lock()
        self._episodes: dict[str, _Episode] = {}
        self._counters: dict[str, float] = {}

    # ---------------------------------------------------------------------------------------------------------
    # the episode's calls

    def start(self, episode_id: str, row: Any, seed: int) -> EnvStart:
        """Open an episode: build its environment, its first messages and its tools' schemas.

        Args:
            episode_id: the caller's id of the episode (unique among this worker's open episodes).
            row: the data row (dict or ``PromptRow``).
            seed: the episode's seed (int; the same for the G episodes of a group).

        Returns:
            ``EnvStart``; with status ``timeout`` / ``error`` the episode is over (still to ``finish``).

        Raises:
            ValueError: ``episode_id`` is already open here.
            TypeError: ``row`` is neither a dict nor a dataclass.
            ToolSchemaError: a tool of the environment has no usable schema (the episode is closed and dropped).
        """
        row = as_row_dict(row)
        ep = _Episode()
        with self._lock:
            if episode_id in self._episodes:
                raise ValueError(f"episode {episode_id!r} is already open on this worker")
            self._episodes[episode_id] = ep
        with ep.lock:
            holder: list[Environment] = []
            try:  # outside the deadline: a verifier's first look-up may import its module, a dead server restarts
                verifier = (None if self._env_cls is not None or self._openenv is not None
                            else self._verifier_for(row))
                if self._openenv is not None:
                    self._count("env/openenv_restarts", self._openenv.ensure_running())
            except (ValueError, RuntimeError) as err:  # no verifier; an OpenEnv server that would not start again
                out = _contract("start", err)
            else:
                out = _timeouts(self._runner.call(self._open, row, seed, verifier, holder,
                                                  timeout_s=self.cfg.tool_timeout_s, method="start"))
            ep.env = holder[0] if holder else None
            ep.seconds += out.elapsed_s
            self._count("env/time_s", out.elapsed_s)
            messages: list[dict] = []
            schemas: list[dict] = []
            if out.status == "ok":
                try:
                    messages = _check_messages(out.value[0], "initial_messages()")
                    if not isinstance(out.value[1], (list, tuple)):
                        raise TypeError(f"tools() must return a list of callables, got {out.value[1]!r}")
                    schemas = tool_schemas(out.value[1])
                except TypeError as err:
                    out = _contract("start", err)
                except ToolSchemaError:  # the environment's code, not this episode: the caller hears of it
                    self._close(ep)
                    with self._lock:
                        self._episodes.pop(episode_id, None)
                    raise
            if out.status != "ok":
                self._fail(ep, out)
                return EnvStart([], [], out.status, dict(out.detail), out.elapsed_s)
            return EnvStart(messages, schemas, OK, {}, out.elapsed_s)

    def _open(self, row: dict, seed: int, verifier: Callable | None, holder: list) -> tuple[list, list]:
        """In the call thread: the environment (into ``holder`` at once, to be closed whatever follows), its
        first messages and its tools."""
        if self._env_cls is not None:
            env = self._env_cls(row, seed)
        elif self._openenv is not None:
            env = self._openenv.environment(row, seed)
        else:
            env = ToolsEnvironment(row, seed, self._tools, verifier)
        holder.append(env)
        return env.initial_messages(), env.tools()

    def start_agent(self, episode_id: str, row: Any, session: dict[str, str]) -> None:
        """``env.agent``: run the agent program of one episode against its gateway session
        (``reward.agent_runner.AgentRuns.start``); returns at once.

        Raises:
            ValueError: this worker runs no agent (``env.agent`` unset).
        """
        if self._agents is None:
            raise ValueError("start_agent: env.agent is unset on this env worker")
        self._agents.start(episode_id, as_row_dict(row), session)

    def start_agents(self, jobs: list[tuple[str, Any, dict[str, str]]]) -> None:
        """``start_agent`` of each ``(episode_id, row, session)``: a round's agents in one call."""
        for episode_id, row, session in jobs:
            self.start_agent(episode_id, row, session)

    def verify_many(self, items: list[tuple[Any, str]]) -> list[tuple[float, bool]]:
        """``verify`` of each ``(row, text)``, in order, eight at a time: a round's verdicts in one call."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(8, max(len(items), 1))) as pool:
            return list(pool.map(lambda item: self.verify(*item), items))

    def verify(self, row: Any, text: str) -> tuple[float, bool]:
        """``(score, correct)`` of the row's verifier on ``text`` (an agent that returned no reward: its last
        assistant message), read as the reward worker reads a verifier (``reward.worker.interpret``); a failed
        verifier gives its ``reward`` section's error score."""
        from reward.worker import interpret

        row = as_row_dict(row)
        out = self._runner.call(self._verifier_for(row), text, row, timeout_s=self.cfg.tool_timeout_s,
                                method="verify")
        score, correct, _, _ = interpret(out, self.reward_cfg)
        return float(score), bool(correct if correct is not None else score >= 1.0)

    def _verifier_for(self, row: dict) -> Callable:
        name = self.reward_cfg.verifier or row.get("verifier")
        if not isinstance(name, str) or not name:
            raise ValueError(f"row {row.get('uid')!r} names no verifier and reward.verifier is unset")
        if name not in self._verifiers:
            self._verifiers[name] = get_verifier(name, self.reward_cfg)
        return self._verifiers[name]

    def step(self, episode_id: str, assistant_text: str, tool_calls: list[dict],
             parse_errors: list[str] | tuple[str, ...] = ()) -> EnvStep:
        """The environment's answer to one assistant turn.

        Args:
            episode_id: an open episode.
            assistant_text: the turn's text as sampled.
            tool_calls: the calls parsed from it, ``[{"name": str, "arguments": dict}]``.
            parse_errors: one message per tool call the parser could not read (become observations).

        Returns:
            ``EnvStep``. On an episode already over it is ``done`` with that episode's status and no messages
            (the environment is not called).

        Raises:
            UnknownEpisode: no open episode ``episode_id`` here.
        """
        ep = self._get(episode_id)
        with ep.lock:
            if ep.state != RUNNING:
                return EnvStep([], True, None, ep.state, 0.0, {}, {"error": "EpisodeOver", "method": "step",
                                                                   "message": f"the episode is over ({ep.state})"})
            calls = list(tool_calls)
            errors = {"parse": len(parse_errors)} if parse_errors else {}
            observations = [parse_error_message(str(e)) for e in parse_errors]
            limit = self.cfg.tool_timeout_s
            with_deadline = functools.partial(run_with_tool_deadline, sandbox=self.reward_cfg.sandbox)
            out = _timeouts(self._runner.call(with_deadline, self._runner, limit, ep.env.step, assistant_text, calls,
                                              timeout_s=limit * (len(calls) + 1), method="step"))
            ep.turns += 1
            ep.seconds += out.elapsed_s
            self._count("env/time_s", out.elapsed_s)
            self._count("env/turns", 1)
            if out.status == "ok":
                try:
                    result = _check_step(out.value)
                except TypeError as err:
                    out = _contract("step", err)
            if out.status != "ok":
                self._count_tool_errors(errors)
                self._fail(ep, out)
                return EnvStep([], True, None, out.status, out.elapsed_s, errors, dict(out.detail))
            for kind, n in result.tool_errors.items():
                errors[kind] = errors.get(kind, 0) + n
            self._count_tool_errors(errors)
            done = result.done and not (parse_errors and not calls)
            status = OK
            if not done and ep.turns >= self.cfg.max_turns:
                done, status = True, MAX_TURNS
            if done:
                ep.state = status
            reward = None if result.reward is None else float(result.reward)
            return EnvStep(observations + list(result.messages), done, reward, status, out.elapsed_s, errors)

    def finish(self, episode_id: str) -> EnvOutcome:
        """The episode's reward; the environment is closed and the episode forgotten. May be called before the
        environment said done (status ``cut``: scored as it stands).

        Returns:
            ``EnvOutcome``; an environment failure (now or earlier) gives status ``timeout`` / ``error`` and
            the ``env.on_error`` reward.

        Raises:
            UnknownEpisode: no open episode ``episode_id`` here.
        """
        ep = self._pop(episode_id)
        with ep.lock:
            self._count("env/episodes", 1)
            if ep.state in FAILED:
                return self._failed_outcome(ep)
            status = CUT if ep.state == RUNNING else ep.state
            out = self._runner.call(ep.env.reward, timeout_s=self.cfg.tool_timeout_s, method="reward")
            ep.seconds += out.elapsed_s
            self._count("env/time_s", out.elapsed_s)
            if out.status == "ok":
                try:
                    reward, components = episode_reward(out.value)
                except ValueError as err:
                    out = _contract("reward", err)
            if out.status != "ok":
                self._fail(ep, out)
                return self._failed_outcome(ep)
            detail = self._close(ep)
            self._count(f"env/{status}", 1)
            return EnvOutcome(reward, components, status, detail, ep.turns, ep.seconds, reward >= 1.0)

    def abort(self, episode_id: str) -> bool:
        """Close an episode without a reward and forget it (e.g. its group was cancelled).

        Returns:
            True when it was open here, False when there was no such episode (nothing done).
        """
        try:
            ep = self._pop(episode_id)
        except UnknownEpisode:
            return False
        with ep.lock:
            self._count("env/aborted", 1)
            if ep.env is not None:
                self._close(ep)
        return True

    # ---------------------------------------------------------------------------------------------------------
    # the worker

    def open_episodes(self) -> list[str]:
        """Ids of the episodes open here (started, not yet finished or aborted), in start order."""
        with self._lock:
            return list(self._episodes)

    def pid(self) -> int:
        """OS process id of this worker."""
        return os.getpid()

    def abandoned_threads(self) -> int:
        """Timed-out environment calls whose threads still run here (they cannot be killed; replace the worker
        when this passes ``env.max_abandoned_threads``)."""
        return self._runner.abandoned_alive()

    def metrics(self) -> dict[str, float]:
        """Counters since the last call (then reset): ``env/episodes`` (finished), ``env/ok``,
        ``env/max_turns``, ``env/cut`` (by how they ended), ``env/timeouts``, ``env/errors`` (episodes that ended
        on an environment failure), ``env/aborted``, ``env/turns``, ``env/time_s`` (seconds in environment
        calls), ``env/tool_errors/<kind>``, ``env/close_errors``; and the gauge ``env/abandoned_threads``
        (alive now)."""
        with self._lock:
            out, self._counters = self._counters, {}
        out["env/abandoned_threads"] = float(self.abandoned_threads())
        return out

    def close(self) -> None:
        """Abort every open episode (their environments are closed); stop the OpenEnv server this worker started
        (a later episode starts it again)."""
        for episode_id in self.open_episodes():
            self.abort(episode_id)
        if self._openenv is not None and self._openenv.server is not None:
            self._openenv.server.stop()

    def openenv_server_pid(self) -> int | None:
        """The process id of the OpenEnv server this worker started (``env.openenv.app``) while it runs, else
        None."""
        return None if self._openenv is None or self._openenv.server is None else self._openenv.server.pid()

    # ---------------------------------------------------------------------------------------------------------
    # private

    def _get(self, episode_id: str) -> _Episode:
        with self._lock:
            ep = self._episodes.get(episode_id)
        if ep is None:
            raise UnknownEpisode(f"no open episode {episode_id!r} on this worker (pid {os.getpid()})")
        return ep

    def _pop(self, episode_id: str) -> _Episode:
        with self._lock:
            ep = self._episodes.pop(episode_id, None)
        if ep is None:
            raise UnknownEpisode(f"no open episode {episode_id!r} on this worker (pid {os.getpid()})")
        return ep

    def _count(self, key: str, n: float) -> None:
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + n

    def _count_tool_errors(self, errors: dict[str, int]) -> None:
        for kind, n in errors.items():
            if n:
                self._count(f"env/tool_errors/{kind}", n)

    def _fail(self, ep: _Episode, out: CallOutcome) -> None:
        """End ``ep`` on an environment failure: its status and detail kept for ``finish``; closed now."""
        ep.state = out.status
        ep.detail = dict(out.detail)
        self._count("env/timeouts" if out.status == "timeout" else "env/errors", 1)
        if ep.env is not None:
            close = self._close(ep)
            ep.detail.update(close)

    def _close(self, ep: _Episode) -> dict[str, Any]:
        """Close ``ep``'s environment once, under the deadline; ``{"close": detail}`` when that failed, else {}."""
        env, ep.env = ep.env, None
        if env is None:
            return {}
        out = self._runner.call(env.close, timeout_s=self.cfg.tool_timeout_s, method="close")
        ep.seconds += out.elapsed_s
        self._count("env/time_s", out.elapsed_s)
        if out.status == "ok":
            return {}
        self._count("env/close_errors", 1)
        return {"close": {"status": out.status, **out.detail}}

    def _failed_outcome(self, ep: _Episode) -> EnvOutcome:
        """A failed episode's outcome: a service's failure (``detail["infra"]``) scored by
        ``reward.on_infra_failure``, any other by ``env.on_error``."""
        cause = detail_cause(ep.detail)
        reward = failed_reward(self.cfg, self.reward_cfg, cause)
        return EnvOutcome(reward, {}, ep.state, dict(ep.detail), ep.turns, ep.seconds, False, cause or "")

