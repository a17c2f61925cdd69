"""Agent programs' episodes (``env.agent``): the agent loop with the session gateway in place of the environment
(docs/agents.md "Agent programs").

``GatewayEpisodeRunner`` is ``EpisodeRunner`` with the other implementation of the environment's side: an episode
opens a gateway session (``cluster.runtime.gateway``), its env worker runs the user's agent against it
(``reward.agent_runner``), and where an environment would step, the agent's next request comes in. The engines,
the turn loop (continuous batching, a group's episodes on one engine), evaluation and the overlapped collection
are the agent loop's own.

Per request: the first renders the request's messages with the chat template and its tools (or plain mode's
text) as the prompt; a later one that continues the branch (``rollout.gateway_session.continuation``) appends only
the new messages, as the template's delta after the sampled turn (the sampled ids stay as sampled); one that does
not forks: the messages rendered whole start a new branch. At the episode's end ``env.gateway.fork_policy`` picks
the branch that trains (``longest``: the most sampled tokens; ``all``: every branch, the earlier ones handed to the
trainer by ``take_branches`` to train with their episode's reward and advantage); ``refuse`` answers a diverging request with 400
``history_diverged``. A request whose context and turn would not fit ``rollout.max_model_len`` gets 400
``context_length_exceeded``. The run's temperature and top-p always apply; a request asking for others is served
at the run's and counted (``agent/sampling_overridden``).

The episode's reward: what the agent returned (a float or named components), or, when it returned None, the row's
verifier on the last assistant message; an agent that raised, closed its session with an error, or passed
``env.episode_timeout_s`` ends its episode with status ``error`` / ``timeout``, scored by ``env.on_error``; one
whose env worker (or the gateway) died, or whose agent raised ``reward.infra.InfraFailure`` (a service it needs
failed), is the service's failure: scored by ``reward.on_infra_failure`` (invalid by default) and counted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.driver.agent_loop import EpisodeRunner
from cluster.driver.episodes import Episode, _row_dict, tool_call_dicts
from cluster.runtime import deadlines
from reward.contracts import RewardResult
from reward.infra import failed_reward
from reward.episode_status import CUT_TOKENS, ERROR, OK, SCORED, TIMEOUT
from reward.infra import DETAIL_KEY, Cause
from rollout.chat_delta import ChatDeltaError, TurnEnd, reply_ids
from rollout.contracts import Completion, SampledTurn, TurnRequest
from rollout.gateway_session import canonical_message, continuation, render_chat, render_plain
from rollout.openai_protocol import ProtocolError, Reply
from rollout.tool_calls import parse

log = logging.getLogger("cluster.train")


@dataclass
class AgentEpisode(Episode):
    """An ``Episode`` played by an agent program: its session, the branch's messages (``known``), the request
    under way, the branches it left (``branches``: ``Episode`` snapshots, for ``fork_policy``) and how it ended."""

    session: dict = field(default_factory=dict)
    known: list[dict] = field(default_factory=list)
    raw_text: dict = field(default_factory=dict)  # canonical assistant message -> the text the engine sampled
    request: dict = field(default_factory=dict)
    branches: list[dict] = field(default_factory=list)  # earlier branches (Episode.trajectory)
    end: dict = field(default_factory=dict)
    opened: float = 0.0
    cut: bool = False  # a request was refused for want of room (context_length_exceeded)
    forked_last: bool = False  # the request under way forked the episode
    before: tuple = ()  # the episode before the request under way (mark / undo_request)

    def fork(self, prompt_ids: list[int]) -> None:
        """Keep the branch so far in ``branches`` and start a new one from ``prompt_ids`` (nothing sampled)."""
        self.branches.append(self.trajectory())
        self.restart(None, prompt_ids, branch=len(self.branches))  # its turns told apart in the token records

    def undo_request(self) -> None:
        """Put the episode back as it was before the request under way was applied (``mark``): its turn was
        lost with its engine, so the agent's retry of the same messages continues the branch."""
        if self.before:
            snapshot, self.known, branches = self.before
            self.rewind(snapshot)
            del self.branches[branches:]
            self.before = ()

    def mark(self) -> None:
        """Remember the episode before a request is applied (``undo_request``)."""
        self.before = (self.snapshot(), self.known, len(self.branches))

    def branch_completions(self) -> list[tuple[int, Completion]]:
        """Each earlier branch as a ``Completion`` (``fork_policy=all``): ``(branch number, completion)``."""
        now, out = self.trajectory(), []
        for b in self.branches:
            self.restart(b)
            out.append((self.branch, self.completion()))
        self.restart(now)
        return out

    def keep_longest(self) -> None:
        """Make the branch with the most sampled tokens the episode's (ties: the latest)."""
        best = max(self.branches, key=lambda b: len(b["sampled"]), default=None)
        if best is not None and len(best["sampled"]) > len(self.sampled):
            self.restart(best)


class GatewayEpisodeRunner(EpisodeRunner):
    """``EpisodeRunner`` whose episodes are agent programs behind the gateway (module docstring).

    Args:
        cfg, fleet, pool, tokenizer: as ``EpisodeRunner``'s.
        gateway: the ``cluster.runtime.gateway.Gateway`` actor, serving.
    """

    episode_cls = AgentEpisode

    def __init__(self, cfg, fleet, pool, tokenizer, gateway):
        super().__init__(cfg, fleet, pool, tokenizer)
        self.gateway = gateway
        self.forks = 0
        self.overridden = 0
        self.harness: subprocess.Popen | None = None  # env.gateway.harness: the program (start_gateway_runner)
        self.branches: dict[str, list[tuple[int, Completion]]] = {}  # fork_policy=all: the last round's others

    def stop_gateway(self, timeout_s: float = 10.0) -> None:
        """Stop the gateway (requests under way get 409, a harness's claims 410), then end the harness program:
        SIGTERM, SIGKILL after ``timeout_s``."""
        try:
            ray.get(self.gateway.stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - shutting down: a gateway already gone has nothing to stop
            log.warning("the session gateway did not stop cleanly", exc_info=True)
        if self.harness is None or self.harness.poll() is not None:
            return
        self.harness.terminate()
        try:
            self.harness.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.harness.kill()
            self.harness.wait()

    def run(self, rows, G, seed, temperature=None):
        """``EpisodeRunner.run``, with ``agent/forks`` (requests that forked their episode) and
        ``agent/sampling_overridden`` (requests that asked for another temperature or top-p) added."""
        self.forks = self.overridden = 0
        self.branches = {}
        if self.harness is not None and self.harness.poll() is not None:
            log.warning("the harness program exited (status %s): its episodes will end at env.episode_timeout_s",
                        self.harness.returncode)
        comps, results, metrics, sampled = super().run(rows, G, seed, temperature)
        metrics.update({"agent/forks": float(self.forks), "agent/sampling_overridden": float(self.overridden)})
        metrics.update(ray.get(self.gateway.take_counters.remote(), timeout=60))
        return comps, results, metrics, sampled

    # -- the environment's side, played by the agent --------------------------------------------------------
    def _remaining(self, e: AgentEpisode) -> float:
        return max(self.cfg.env.episode_timeout_s - (time.monotonic() - e.opened), 0.05)

    def start_episodes(self, episodes: list[AgentEpisode]) -> dict:
        """Open the episodes' sessions (one gateway call) and start their agents (one call per env worker;
        with ``env.gateway.harness`` none: the sessions wait for the program to claim them); returns the
        waits for their first requests (ref -> episode), which the loop applies as each comes, so the engines
        sample the first agents' turns while later agents still start."""
        harness = self.cfg.env.gateway.harness is not None
        sids = [hashlib.sha256(e.episode_id.encode()).hexdigest()[:20] for e in episodes]
        sessions = ray.get(self.gateway.open_many.remote(
            [(sid, _row_dict(e.row) if harness else None) for sid, e in zip(sids, episodes)]), timeout=60)
        for e, session in zip(episodes, sessions):
            e.session, e.opened = session, time.monotonic()
        if not harness:  # one call per env worker: a Ray call costs the driver about 1 ms here
            for worker in sorted({e.worker for e in episodes}):
                self.pool.workers[worker].start_agents.remote(
                    [(e.episode_id, _row_dict(e.row), e.session) for e in episodes if e.worker == worker])
        return {self.first_request(e): e for e in episodes}

    def first_request(self, e: AgentEpisode):
        """The wait for the first request of a started episode's agent (a ref; ``_on_start`` applies it)."""
        return self.gateway.exchange.remote(e.session["session_id"], None, self._remaining(e))

    def _on_start(self, e: AgentEpisode, ref) -> bool:
        ev = self._env(e, ref)
        return ev is not None and self._on_event(e, ev)

    def _on_step(self, e: AgentEpisode, ev) -> bool:
        return self._on_event(e, ev)

    def _on_event(self, e: AgentEpisode, ev: dict) -> bool:
        """Apply the agent's next event; True when a turn is to be sampled for it. A request that cannot be
        served is answered with its error here and the agent's next event applied in its place."""
        while ev["kind"] == "request":
            error = self._take_request(e, ev["request"])
            if error is None:
                return True
            wait = self._remaining(e)  # the gateway answers within it; past it and deadlines.env_s, the run stops
            ev = deadlines.get([self.gateway.exchange.remote(e.session["session_id"], error, wait)], [self.gateway],
                               "env", wait + self.cfg.deadlines.env_s, "deadlines.env_s")[0]
        e.end = ev
        if ev["kind"] == "timeout":
            e.status = TIMEOUT
        elif ev.get("status") == OK or e.cut:  # an agent stopped by a context error is scored as it stands
            e.status = CUT_TOKENS if e.truncated else OK  # a turn cut at its limit, or no room: as env episodes
            e.end = ev if ev.get("status") == OK else {**ev, "reward": None}
        else:
            e.status = ERROR
        return False

    def _take_request(self, e: AgentEpisode, req: dict) -> ProtocolError | None:
        """The request's messages onto the episode (continued or forked); the error to answer it with, or None."""
        if req.get("temperature") not in (None, self.cfg.rollout.temperature) or req.get("top_p") not in (None, 1.0):
            self.overridden += 1  # served at the run's temperature and top-p 1 all the same
        messages, ids, first = req["messages"], None, not e.known
        e.mark()
        e.forked_last = False
        new = None if first else continuation(e.known, messages)
        if new is not None:
            try:
                ids = reply_ids(self.tokenizer, new, e.turn_end or TurnEnd("stop"), tools=e.tools or None,
                                chat=self.chat)
            except (ChatDeltaError, ValueError):
                ids = None  # a template that re-renders history here: a fork
        if ids is None:
            if not first and self.cfg.env.gateway.fork_policy == "refuse":
                return ProtocolError(400, "the messages do not continue this session's history (env.gateway."
                                     "fork_policy=refuse)", param="messages", code="history_diverged")
            try:
                prompt = self._render(e, messages, req.get("tools") or e.tools)
            except ValueError as err:
                return ProtocolError(400, str(err), param="messages")
        room = self.cfg.rollout.max_model_len - len(prompt if ids is None else e.prompt_ids + e.response_ids + ids)
        if room < 2:
            e.cut = e.truncated = True
            return ProtocolError(400, f"the messages take {self.cfg.rollout.max_model_len - room} tokens; the "
                                 f"model's context is {self.cfg.rollout.max_model_len} (rollout.max_model_len)",
                                 param="messages", code="context_length_exceeded")
        if ids is None:
            if not first:
                self.forks += 1
                e.fork(prompt)
                e.forked_last = True
            else:
                e.prompt_ids, e.tools = prompt, list(req.get("tools") or [])
        else:
            e.add_reply(ids)
        e.known, e.request = [dict(m) for m in messages], req
        return None

    def _render(self, e: AgentEpisode, messages: list[dict], tools: list[dict]) -> list[int]:
        """A whole history as prompt ids: the chat template, or plain mode (the row's own prompt ids when the
        history is the row's prompt alone, as for single answers)."""
        if self.chat:
            return render_chat(self.tokenizer, messages, tools)
        if len(messages) == 1 and messages[0].get("role") == "user" and messages[0].get("content") == e.row.prompt:
            return list(e.row.prompt_token_ids)
        return list(self.tokenizer(render_plain(messages, self.cfg.env.tool_format, e.raw_text))["input_ids"])

    def _request(self, e: AgentEpisode, turn_seed) -> TurnRequest:
        """The turn of the request under way: the run's limits, the request's own ``max_tokens`` and ``stop``."""
        r = super()._request(e, turn_seed)
        asked = e.request.get("max_tokens")
        return TurnRequest(r.episode_id, r.context_ids, min(r.max_tokens, asked) if asked else r.max_tokens,
                           r.stop + [s for s in e.request.get("stop") or [] if s not in r.stop], r.seed, r.branch)

    def _on_turn(self, e: AgentEpisode, turn: SampledTurn, stepping: dict) -> None:
        """A sampled turn: onto the episode (exact ids, log-probs, version, routing), parsed into the reply."""
        context = len(e.prompt_ids) + len(e.response_ids)
        e.take_turn(turn)
        parsed = parse(self.cfg.env.tool_format, turn.text)
        calls = tool_call_dicts(parsed.calls, e.tools)
        content = parsed.content if calls else turn.text
        e.tool_calls, e.final_text = e.tool_calls + len(calls), content
        e.truncated = e.truncated or turn.finish_reason == "length"
        message = {"role": "assistant", "content": content, "tool_calls": [
            {"type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for c in calls]}
        e.known.append(message)
        e.raw_text[canonical_message(message)] = turn.text
        reply = Reply(content=content, tool_calls=calls, finish_reason=turn.finish_reason, prompt_tokens=context,
                      completion_tokens=len(turn.token_ids))
        stepping[self.gateway.exchange.remote(e.session["session_id"], reply, self._remaining(e))] = e

    def take_branches(self) -> dict[str, list[tuple[int, Completion]]]:
        """``fork_policy=all``: the last round's earlier branches by episode id (taken: the next call gives {})."""
        out, self.branches = self.branches, {}
        return out

    def on_engine_lost(self, e: AgentEpisode, loop) -> None:
        """The engine died with this episode's turn open: its request fails with 503 (``engine_lost``; a client's
        retry is served by the replacement engine, continuing as if the request had not come) and the agent's next
        event is awaited."""
        if e.forked_last:
            self.forks -= 1
        e.undo_request()
        error = ProtocolError(503, "the rollout engine serving this request died; it is being replaced: retry",
                              type="server_error", code="engine_lost")
        loop.stepping[self.gateway.exchange.remote(e.session["session_id"], error, self._remaining(e))] = e

    # -- the end ----------------------------------------------------------------------------------------------
    def finish_episodes(self, episodes: list[AgentEpisode]) -> list[RewardResult]:
        """Close every session; each episode's branch (``fork_policy``) and verdict (module docstring)."""
        ray.get(self.gateway.close_many.remote([e.session["session_id"] for e in episodes if e.session]), timeout=60)
        verify = self._verify([e for e in episodes if e.status in SCORED and e.end.get("reward") is None
                               and not e.worker_lost])
        results = []
        every = self.cfg.env.gateway.fork_policy == "all"
        for e in episodes:
            if every and e.branches:
                self.branches[e.episode_id] = e.branch_completions()  # beside the last branch, the episode's
            elif not every:
                e.keep_longest()
            detail = {"episode_id": e.episode_id, "episode": e.status, "turns": e.turns, "forks": len(e.branches),
                      "branch": e.branch}  # the (last) branch that trains (the token check)
            score, correct, status = self._score(e, verify, detail)
            results.append(RewardResult(score=score, correct=correct, status=status, detail=detail,
                                        elapsed_s=time.monotonic() - e.opened, infra_failed=detail.get(DETAIL_KEY, "")))
        return results

    def _verify(self, episodes: list[AgentEpisode]) -> dict[str, tuple[float, bool] | Exception]:
        """The row's verifier on each episode's last assistant message, by episode id: one call per env worker; a
        worker that died or did not answer in time gives its episodes the Ray error instead."""
        refs = {w: self.pool.workers[w].verify_many.remote([(_row_dict(e.row), e.final_text) for e in episodes
                                                            if e.worker == w])
                for w in sorted({e.worker for e in episodes})}
        out = {}
        for w, ref in refs.items():
            ids = [e.episode_id for e in episodes if e.worker == w]
            try:
                out.update(zip(ids, ray.get(ref, timeout=self.cfg.env.tool_timeout_s * (len(ids) // 8 + 1) + 30)))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:  # the verifier's worker
                out.update((i, err) for i in ids)  # each of its episodes is the service's failure (``_score``)
        return out

    def _score(self, e: AgentEpisode, verify: dict, detail: dict) -> tuple[float, bool, str]:
        """``(score, correct, status)`` of an ended episode; a failed one's cause, when it was a service's, goes in
        ``detail["infra"]`` (a worker or the gateway lost: ``worker_lost``; an agent that raised ``InfraFailure``:
        its cause) and its score is ``reward.on_infra_failure``'s, else ``env.on_error``'s."""
        if e.status not in SCORED:
            cause = Cause.WORKER_LOST.value if e.worker_lost else e.end.get(DETAIL_KEY) if e.status == ERROR else None
            detail["error"] = e.end.get("error") or ("agent past env.episode_timeout_s" if e.status == TIMEOUT
                                                     else "the agent's env worker or the gateway died")
            if cause:
                detail[DETAIL_KEY] = cause
            log.warning("episode %s (row %s): agent %s%s: %s", e.episode_id, e.row.uid, e.status,
                        f" (the service's: {cause})" if cause else "", detail["error"])
            return failed_reward(self.cfg.env, self.cfg.reward, cause), False, e.status
        if e.episode_id in verify:
            got = verify[e.episode_id]
            if isinstance(got, Exception):
                lost = isinstance(got, ray.exceptions.RayActorError)
                detail[DETAIL_KEY] = (Cause.WORKER_LOST if lost else Cause.SERVICE_TIMEOUT).value
                detail["error"] = f"the row's verifier got no answer from the env worker: {type(got).__name__}"
                return failed_reward(self.cfg.env, self.cfg.reward, detail[DETAIL_KEY]), False, ERROR
            score, correct = got
            return score, correct, OK
        reward = e.end["reward"]
        if isinstance(reward, dict):
            detail["components"] = reward
            reward = math.fsum(reward.values())
        return float(reward), float(reward) >= 1.0, OK


def start_harness(command: str, env: dict[str, str], log_path) -> subprocess.Popen:
    """Start ``env.gateway.harness`` (split as a shell does; no shell; a first word ``python`` or ``python3`` is
    the driver's own interpreter, ``sys.executable``) with ``env`` (``Gateway.harness_env``) added to the driver's
    environment, its output to ``log_path``.

    Raises:
        OSError: the program cannot be started (not found, not executable).
    """
    argv = shlex.split(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def start_gateway_runner(cfg, fleet, pool, tokenizer):
    """The gateway actor and the runner that plays ``env.agent`` episodes through it: ``(runner, gateway)``;
    with ``env.gateway.harness`` the program is started here (``runner.harness``, ended by ``stop_gateway``)."""
    from cluster.runtime.gateway import start_gateway

    g = cfg.env.gateway
    gateway, url = start_gateway(g.host, g.port, g.model_name)
    log.info("session gateway at %s (one base URL per episode: %s/s/<session>/v1)", url, url)
    runner = GatewayEpisodeRunner(cfg, fleet, pool, tokenizer, gateway)
    if g.harness is not None:
        path = cfg.run_dir / "logs" / "harness.log"
        runner.harness = start_harness(g.harness, ray.get(gateway.harness_env.remote(), timeout=60), path)
        log.info("harness %r started (pid %d; output in %s): it takes episodes at %s/sessions", g.harness,
                 runner.harness.pid, path, url)
    return runner, gateway


__all__ = ["AgentEpisode", "GatewayEpisodeRunner", "start_gateway_runner"]
