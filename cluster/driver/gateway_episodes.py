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
the branch that trains (``longest``: the most sampled tokens); ``refuse`` answers a diverging request with 400
``history_diverged``. A request whose context and turn would not fit ``rollout.max_model_len`` gets 400
``context_length_exceeded``. The run's temperature and top-p always apply; a request asking for others is served
at the run's and counted (``agent/sampling_overridden``).

The episode's reward: what the agent returned (a float or named components), or, when it returned None, the row's
verifier on the last assistant message; an agent that raised, closed its session with an error, or passed
``env.episode_timeout_s`` ends its episode with status ``error`` / ``timeout``, scored by ``env.on_error``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.driver.agent_loop import EpisodeRunner
from cluster.driver.episodes import Episode, _row_dict, tool_call_dicts
from cluster.runtime import deadlines
from reward.contracts import RewardResult
from reward.episode_status import CUT_TOKENS, ERROR, OK, SCORED, TIMEOUT
from rollout.chat_delta import ChatDeltaError, TurnEnd, reply_ids
from rollout.contracts import SampledTurn, TurnRequest
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

    def fork(self, prompt_ids: list[int]) -> None:
        """Keep the branch so far in ``branches`` and start a new one from ``prompt_ids`` (nothing sampled)."""
        self.branches.append(self.trajectory())
        self.restart(None, prompt_ids, branch=len(self.branches))  # its turns told apart in the token records

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

    def run(self, rows, G, seed, temperature=None):
        """``EpisodeRunner.run``, with ``agent/forks`` (requests that forked their episode) and
        ``agent/sampling_overridden`` (requests that asked for another temperature or top-p) added."""
        self.forks = self.overridden = 0
        comps, results, metrics, sampled = super().run(rows, G, seed, temperature)
        metrics.update({"agent/forks": float(self.forks), "agent/sampling_overridden": float(self.overridden)})
        metrics.update(ray.get(self.gateway.take_counters.remote(), timeout=60))
        return comps, results, metrics, sampled

    # -- the environment's side, played by the agent --------------------------------------------------------
    def _remaining(self, e: AgentEpisode) -> float:
        return max(self.cfg.env.episode_timeout_s - (time.monotonic() - e.opened), 0.05)

    def start_ref(self, e: AgentEpisode):
        """Open the episode's session, start its agent on its env worker, and wait for the agent's first request."""
        sid = hashlib.sha256(e.episode_id.encode()).hexdigest()[:20]
        e.session, e.opened = ray.get(self.gateway.open.remote(sid), timeout=60), time.monotonic()
        self.pool.workers[e.worker].start_agent.remote(e.episode_id, _row_dict(e.row), e.session)
        return self.gateway.exchange.remote(sid, None, self._remaining(e))

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

    # -- the end ----------------------------------------------------------------------------------------------
    def finish_episodes(self, episodes: list[AgentEpisode]) -> list[RewardResult]:
        """Close every session; each episode's branch (``fork_policy``) and verdict (module docstring)."""
        ray.get([self.gateway.close.remote(e.session["session_id"]) for e in episodes if e.session], timeout=60)
        verify = {e.episode_id: self.pool.workers[e.worker].verify.remote(_row_dict(e.row), e.final_text)
                  for e in episodes if e.status in SCORED and e.end.get("reward") is None and not e.worker_lost}
        results = []
        for e in episodes:
            e.keep_longest()
            detail = {"episode_id": e.episode_id, "episode": e.status, "turns": e.turns, "forks": len(e.branches),
                      "branch": e.branch}  # the branch that trains (the token check)
            score, correct, status = self._score(e, verify, detail)
            results.append(RewardResult(score=score, correct=correct, status=status, detail=detail,
                                        elapsed_s=time.monotonic() - e.opened))
        return results

    def _score(self, e: AgentEpisode, verify: dict, detail: dict) -> tuple[float, bool, str]:
        failed = 0.0 if self.cfg.env.on_error == "zero" else math.nan
        if e.status not in SCORED:
            detail["error"] = e.end.get("error") or ("agent past env.episode_timeout_s" if e.status == TIMEOUT
                                                     else "the agent's env worker died")
            log.warning("episode %s (row %s): agent %s: %s", e.episode_id, e.row.uid, e.status, detail["error"])
            return failed, False, e.status
        if e.episode_id in verify:
            score, correct = ray.get(verify[e.episode_id], timeout=self.cfg.env.tool_timeout_s + 30)
            return score, correct, OK
        reward = e.end["reward"]
        if isinstance(reward, dict):
            detail["components"] = reward
            reward = math.fsum(reward.values())
        return float(reward), float(reward) >= 1.0, OK


def start_gateway_runner(cfg, fleet, pool, tokenizer):
    """The gateway actor and the runner that plays ``env.agent`` episodes through it: ``(runner, gateway)``."""
    from cluster.runtime.gateway import start_gateway

    g = cfg.env.gateway
    gateway, url = start_gateway(g.host, g.port, g.model_name)
    log.info("session gateway at %s (one base URL per episode: %s/s/<session>/v1)", url, url)
    return GatewayEpisodeRunner(cfg, fleet, pool, tokenizer, gateway), gateway


__all__ = ["AgentEpisode", "GatewayEpisodeRunner", "start_gateway_runner"]
