"""Multi-turn episodes: the loop that interleaves the rollout engines and the env workers (docs/agents.md).

``EpisodeRunner.run`` plays the G episodes of each prompt to their end and returns them as ``Completion``s with
their verdicts, the seam where single answers come from ``EngineFleet.generate_stream`` and the reward pool.

One episode: the env worker ``start``s its environment (the G episodes of a group share a seed, so the same
initial state); the first ids are the task's prompt ids (an environment that starts from the row's prompt) or
the environment's first messages rendered (the chat template with the tools' schemas, or plain text); then
turns: an engine samples an assistant turn from the episode's exact ids (``RolloutEngine.sample_turns``, the
tool-call format's closing tag as a stop string), the turn is parsed (``rollout.tool_calls``) and goes to the
env worker's ``step`` with its calls and malformed calls; the environment's reply is rendered as the chat
template's delta after the turn (``rollout.chat_delta``) and appended with loss mask 0. The episode ends when
the environment says done (a turn without a call is a final answer), fails, or reaches ``env.max_turns``, or
when a turn is cut at its token limit or the next one has no room left in ``rollout.max_model_len``; ``finish``
gives its reward.

Engines never wait on tools: whenever an engine is idle it samples every episode that is ready, while others
wait for their environment; the loop waits on whichever call ends first. The share of the rollout's wall time
the engines spent sampling is ``agent/engine_busy_share``. An engine that dies with turns open is replaced and
those turns are sampled again on the new one (``engine_lost``; the gateway's runner fails the request with 503).

The ids trained on are the ids sampled: each engine keeps a digest of every turn's context and sampled ids, each
learner rank digests the turns it trained, and the driver compares the two (``cluster.driver.token_check``,
``agent/token_mismatch``, which must be 0). ``env.debug_rerender`` (debug only) samples later turns on a
re-rendered history instead (``episodes.rerendered_context``), so that the check fails.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections import Counter

import ray

from cluster.config import Config
from cluster.driver.env_pool import EnvPool
from cluster.driver.episodes import (Episode, TurnLoop, _row_dict, episode_metrics, fill_missing_routing,
                                     rerendered_context, tool_call_dicts)
from cluster.runtime import deadlines
from reward.contracts import RewardResult
from reward.env_worker import EnvOutcome
from reward.infra import failed_reward
from reward.episode_status import CUT_TOKENS, ERROR, FAILED, MAX_TURNS, OK, RUNNING
from reward.infra import DETAIL_KEY, Cause
from rollout.chat_delta import reply_ids
from rollout.contracts import Completion, PromptRow, SampledTurn, TurnRequest
from rollout.tool_calls import error_observation, parse, stop_strings

log = logging.getLogger("cluster.train")


class EpisodeRunner:
    """Plays episodes on the engines of ``fleet`` and the env workers of ``pool`` (module docstring).

    Args:
        cfg: the run config (``env`` enabled).
        fleet: the ``cluster.runtime.services.EngineFleet``.
        pool: the ``EnvPool``.
        tokenizer: the model's tokenizer (renders the environment's replies and first messages).
    """

    episode_cls = Episode  # the record of one episode (the gateway's runner keeps more)

    def __init__(self, cfg: Config, fleet, pool: EnvPool, tokenizer):
        self.cfg, self.fleet, self.pool, self.tokenizer = cfg, fleet, pool, tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.stops = stop_strings(cfg.env.tool_format)
        self.rounds = itertools.count(1)  # rounds played: episode ids stay unique (a prompt may come twice)
        self.slice_s = 0.05  # an engine call returns after this long even when no turn ended (advance_turns)
        self.depth = 2  # advance_turns calls queued per engine
        self.rerender = cfg.env.debug_rerender  # debug only: later turns sampled on a re-rendered history
        self.rerendered = 0  # turns sampled on a re-rendered history (env.debug_rerender)
        self.since: dict = {}  # a call under way in the loop -> when the loop first waited on it (its deadline's start)
        self.stuck_workers: set[int] = set()  # env workers past deadlines.env_s this round (replaced after it)

    def run(self, rows: list[PromptRow], G: int, seed: int, temperature: float | None = None) -> tuple[
            list[Completion], list[RewardResult], dict[str, float], dict[str, list[int]]]:
        """The G episodes of every row in ``rows``, in prompt order: their completions and verdicts, the
        ``agent/*`` metrics of the round, and each episode's sampled ids by episode id (``<uid>#<k>@<round>.<i>``,
        unique in a run; also in its verdict's ``detail["episode_id"]``, which the token check goes by). ``seed`` seeds
        the environments (one seed per group) and the sampling; ``temperature``: None = ``rollout.temperature``,
        0 = greedy (evaluation)."""
        self.fleet.settle()
        round_ = next(self.rounds)
        episodes = [self.episode_cls(f"{row.uid}#{k}@{round_}.{i}", row, k, seed * 1_000_003 + i,
                            (i * G + k) % len(self.pool), group=i) for i, row in enumerate(rows) for k in range(G)]
        t0 = time.perf_counter()
        starting = self.start_episodes(episodes)
        busy = self._play(episodes, temperature, starting)
        if lost := [e.episode_id for e in episodes if e.status == RUNNING]:
            raise RuntimeError(f"agent loop: {len(lost)} episodes left without an end, e.g. {lost[:3]}")
        restarts = self.pool.restarts
        results = self.finish_episodes(episodes)
        self.repair_pool({e.worker for e in episodes if e.worker_lost})
        fill_missing_routing(episodes)
        wall = time.perf_counter() - t0
        metrics = episode_metrics(episodes, busy / max(wall * len(self.fleet.engines), 1e-9))
        metrics["agent/env_worker_restarts"] = float(self.pool.restarts - restarts)
        metrics.update(self.pool.take_metrics())
        return [e.completion() for e in episodes], results, metrics, {e.episode_id: e.sampled for e in episodes}

    def take_branches(self) -> dict[str, list[tuple[int, Completion]]]:
        """Episodes' other branches to train beside them, by episode id (an environment's episode has one branch:
        {}; the gateway's runner with ``env.gateway.fork_policy=all`` keeps them)."""
        return {}

    # -- the episode's phases ---------------------------------------------------------------------------------
    def _env(self, e: Episode, ref):
        """``ray.get(ref)`` of an env worker call for episode ``e``; None when the worker's process died (the
        episode then ends with status ``error``, its worker is replaced after the round)."""
        if e.worker in self.stuck_workers:  # an earlier call of this round found the worker stuck
            e.status, e.worker_lost = ERROR, True
            return None
        try:
            return ray.get(ref, timeout=self.cfg.deadlines.env_s)
        except ray.exceptions.GetTimeoutError:
            self.env_stuck(e)
            return None
        except ray.exceptions.RayActorError:
            e.status, e.worker_lost = ERROR, True
            return None

    def env_stuck(self, e: Episode) -> None:
        """Episode ``e``'s env worker is past ``deadlines.env_s``: its ``PhaseTimeout`` is logged with its stacks
        (once per worker and round) and the episode ends as if the worker had died (it is replaced after the
        round, ``repair_pool``)."""
        if e.worker not in self.stuck_workers:
            self.stuck_workers.add(e.worker)
            deadlines.stuck("env", self.pool.workers[e.worker], self.cfg.deadlines.env_s, "deadlines.env_s",
                            f"env worker {e.worker}, episode {e.episode_id}; replaced after the round")
        e.status, e.worker_lost = ERROR, True

    def start_episodes(self, episodes: list[Episode]) -> dict:
        """Open ``episodes`` in their env workers: their first ids and tools, or their end (status ``timeout`` /
        ``error`` when the environment failed to start, ``error`` when its worker died). Returns the starts still
        under way (ref -> episode; the loop applies them as they end): none here, all were applied."""
        refs = [self.start_ref(e) for e in episodes]
        for e, ref in zip(episodes, refs):
            self._on_start(e, ref)
        return {}

    def start_ref(self, e: Episode):
        """The env worker's ``start`` call of ``e`` (a Ray ref; ``_on_start`` applies its answer)."""
        return self.pool.workers[e.worker].start.remote(e.episode_id, _row_dict(e.row), e.seed)

    def _on_start(self, e: Episode, ref) -> bool:
        """Apply the environment's start; True when the episode is ready for its first turn."""
        s = self._env(e, ref)
        if s is None:
            return False
        e.env_s += s.seconds
        if s.status in FAILED:
            e.status = s.status
            return False
        e.tools = list(s.tool_schemas)
        e.prompt_ids = self._first_ids(e.row, s.messages, e.tools)
        return True

    def _first_ids(self, row: PromptRow, messages: list[dict], tools: list[dict]) -> list[int]:
        """The environment's first messages rendered: with the chat template and the tools' schemas, or, for a
        tokenizer without a template, the task's own prompt ids when the environment starts from the row's prompt
        (the ids single answers train on) and else the messages' text."""
        if self.chat:
            return list(self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                           tokenize=True, return_dict=False))
        if len(messages) == 1 and messages[0].get("role") == "user" and messages[0].get("content") == row.prompt:
            return list(row.prompt_token_ids)
        return self.tokenizer("".join(str(m.get("content", "")) for m in messages))["input_ids"]

    def _play(self, episodes: list[Episode], temperature: float | None, starting: dict | None = None) -> float:
        """Turns until every episode ended, sampled at ``temperature`` (None: ``rollout.temperature``), the
        episodes in ``starting`` (ref -> episode) joining as their start ends; returns the engines' busy seconds
        (summed over engines).

        Continuous batching: each engine has ``depth`` (2) ``advance_turns`` calls queued while it has open turns
        (the next starts as the last returns, so the engine does not wait while the driver reads a result); an
        episode whose environment answered joins its engine's running batch at the next call (a group's
        episodes stay on one engine, whose prefix cache holds their prompt and earlier turns). On an error the
        engines' open turns are aborted, so the engines are left clean.
        """
        starting = starting or {}
        waiting = {id(e) for e in starting.values()}
        loop = TurnLoop(ready=[e for e in episodes if e.status == RUNNING and id(e) not in waiting],
                        starting=dict(starting), by_id={e.episode_id: e for e in episodes})
        with self.aborting_on_error():
            while not loop.idle():
                self.pump(loop, temperature)
        return loop.busy

    @contextlib.contextmanager
    def aborting_on_error(self):
        """Abort every engine's open turns when the body raises (the engines are left clean), then re-raise."""
        try:
            yield
        except BaseException:
            try:
                ray.get([engine.abort_turns.remote() for engine in self.fleet.engines], timeout=60)
            except Exception:  # noqa: BLE001 - a dead engine has nothing open; the first error is the one to raise
                log.warning("agent loop: could not abort the engines' open turns", exc_info=True)
            raise

    def pump(self, loop: TurnLoop, temperature: float | None, submit: bool = True) -> None:
        """One turn of the loop: queue ``advance_turns`` calls (up to ``depth`` per engine, with the ready
        episodes of that engine when ``submit``; without, only the open turns advance: a drain), wait for the
        first engine or env call to end, and apply every call that has ended (turns to their environments,
        answers to the ready list). Returns at once when nothing is under way."""
        engines = list(self.fleet.engines)
        in_flight, sent = Counter(loop.calls.values()), set()
        for j in range(len(engines)):  # up to `depth` calls queued: the engine never waits on the driver
            mine = [e for e in loop.ready if e.group % len(engines) == j] if submit else []
            if in_flight[j] < self.depth and (mine or loop.open_turns[j]):
                reqs = [self._request(e, loop.turn_seed) for e in mine]
                loop.open_turns[j] += len(reqs)
                loop.on_engine.update((e.episode_id, j) for e in mine)
                sent.update(id(e) for e in mine)
                loop.calls[engines[j].advance_turns.remote(reqs, temperature, self.slice_s)] = j
        loop.ready = [e for e in loop.ready if id(e) not in sent]
        waiting = list(loop.calls) + list(loop.stepping) + list(loop.starting)
        if not waiting:
            return
        self.wait_first(loop, waiting, engines)
        done, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
        for ref in done:
            if ref in loop.calls:
                j = loop.calls.pop(ref)
                try:
                    turns, seconds = ray.get(ref)
                except ray.exceptions.RayActorError:
                    self.engine_lost(loop, j)
                    continue
                loop.busy += seconds
                loop.open_turns[j] -= len(turns)
                for turn in turns:
                    loop.on_engine.pop(turn.episode_id, None)
                    if turn.episode_id in loop.by_id:  # else its episode was restarted meanwhile (partial episodes)
                        self._on_turn(loop.by_id[turn.episode_id], turn, loop.stepping)
            elif ref in loop.starting:
                e = loop.starting.pop(ref)
                if self._on_start(e, ref):
                    loop.ready.append(e)
            else:
                e = loop.stepping.pop(ref)
                s = self._env(e, ref)
                if s is not None and self._on_step(e, s):
                    loop.ready.append(e)

    def engine_lost(self, loop: TurnLoop, j: int) -> None:
        """Engine slot ``j`` died under its turns: replace it (``EngineFleet.replace``, the current weights) and
        hand each episode whose turn it had open to ``on_engine_lost``. The dead engine's other queued calls are
        dropped (they fail the same way)."""
        for ref in [r for r, slot in loop.calls.items() if slot == j]:
            del loop.calls[ref]
        loop.open_turns[j] = 0
        n = len(self.fleet.engines)
        elsewhere = {id(e) for e in [*loop.ready, *loop.stepping.values(), *loop.starting.values()]}
        lost = [e for e in loop.by_id.values()
                if e.status == RUNNING and e.group % n == j and id(e) not in elsewhere]
        log.warning("rollout engine %d died with %d turns open: replacing it", j, len(lost))
        self.fleet.replace(j)
        for e in lost:
            self.on_engine_lost(e, loop)

    def on_engine_lost(self, e: Episode, loop: TurnLoop) -> None:
        """An episode whose turn was open on an engine that died: nothing of the turn was kept, so it is sampled
        again (on the engine that replaced it)."""
        loop.ready.append(e)

    def wait_first(self, loop: TurnLoop, waiting: list, engines: list) -> None:
        """Wait for the first of ``waiting`` (the loop's engine and env calls) within their deadlines, each from
        when the loop first waited on it: ``deadlines.generation_s`` for an engine's ``advance_turns``,
        ``deadlines.env_s`` for an env worker's call. An env call past its deadline ends its episode as if its
        worker had died (``env_stuck``).

        Raises:
            cluster.runtime.deadlines.PhaseTimeout: an engine call past its deadline (the run stops: the open
                turns of an engine cannot be moved to another).
        """
        dc, now = self.cfg.deadlines, time.monotonic()
        self.since = {ref: self.since.get(ref, now) for ref in waiting}
        limit = {ref: dc.generation_s if ref in loop.calls else dc.env_s for ref in waiting}
        due = min(self.since[ref] + limit[ref] for ref in waiting)
        if ray.wait(waiting, num_returns=1, timeout=max(0.0, due - now))[0]:
            return
        for ref in [r for r in waiting if self.since[r] + limit[r] <= time.monotonic()]:
            if ref in loop.calls:
                raise deadlines.stuck("generation", engines[loop.calls[ref]], dc.generation_s,
                                      "deadlines.generation_s", f"rollout engine {loop.calls[ref]}'s turns")
            self.env_stuck(loop.stepping.pop(ref, None) or loop.starting.pop(ref))

    def _request(self, e: Episode, turn_seed: Counter) -> TurnRequest:
        """The episode's next turn: its exact ids (or, with ``env.debug_rerender``, after its first turn and where
        it fits, its re-rendered history), the room left, the tool format's stops, the turn's seed, its branch."""
        turn_seed[e.episode_id] += 1
        context = e.prompt_ids + e.response_ids
        if self.rerender and e.turns:  # debug only: the history re-rendered, the ids trained stay the sampled ones
            again = rerendered_context(self.tokenizer, e, self.chat)
            if len(again) < self.cfg.rollout.max_model_len:
                context, self.rerendered = again, self.rerendered + 1
        room = self.cfg.rollout.max_model_len - len(context)
        return TurnRequest(e.episode_id, context, max_tokens=min(self.cfg.rollout.max_response_tokens, room),
                           stop=list(self.stops), seed=(e.seed * 64 + e.sample_index) * 64 + turn_seed[e.episode_id],
                           branch=e.branch)

    def _on_turn(self, e: Episode, turn: SampledTurn, stepping: dict) -> None:
        e.take_turn(turn)
        parsed = parse(self.cfg.env.tool_format, turn.text)
        e.tool_calls += len(parsed.calls)
        e.final_text = parsed.content if parsed.calls or parsed.errors else turn.text
        if turn.finish_reason == "length":
            e.status, e.truncated = CUT_TOKENS, True
            return
        # every turn goes to the environment, the final answer too (a turn without a call: it says done)
        calls = tool_call_dicts(parsed.calls, e.tools)
        errors = [error_observation(err) for err in parsed.errors]
        ref = self.pool.workers[e.worker].step.remote(e.episode_id, turn.text, calls, errors)
        stepping[ref] = e

    def _on_step(self, e: Episode, s) -> bool:
        """Apply the environment's answer; True when the episode goes on to another turn."""
        e.env_s += s.seconds
        e.tool_errors.update(s.tool_errors)
        if s.status in FAILED:
            e.status = s.status
            return False
        if s.reward is not None:
            e.turn_rewards[-1] = float(s.reward)
        if s.done:
            e.status = MAX_TURNS if s.status == MAX_TURNS else OK
            return False
        ids = reply_ids(self.tokenizer, s.messages, e.turn_end, tools=e.tools or None, chat=self.chat)
        if len(e.prompt_ids) + len(e.response_ids) + len(ids) + 1 >= self.cfg.rollout.max_model_len:
            e.status, e.truncated = CUT_TOKENS, True  # no room for the reply and one more sampled token
            return False
        e.add_reply(ids)
        return True

    def finish_episodes(self, episodes: list[Episode]) -> list[RewardResult]:
        """The verdicts of ended episodes, in order, from their environments' ``finish`` (which closes them); an
        episode whose env worker died is the service's failure (``infra_failed="worker_lost"``, status ``error``),
        scored by ``reward.on_infra_failure``."""
        refs = {e.episode_id: self.pool.workers[e.worker].finish.remote(e.episode_id)
                for e in episodes if not e.worker_lost}
        outcomes = [self._env(e, refs[e.episode_id]) if e.episode_id in refs else None for e in episodes]
        results = []
        for e, o in zip(episodes, outcomes):
            if o is None:  # its worker died
                lost = Cause.WORKER_LOST.value
                o = EnvOutcome(reward=failed_reward(self.cfg.env, self.cfg.reward, lost), status=ERROR,
                               detail={"error": "EnvWorkerLost", "message": "the env worker's process died",
                                       DETAIL_KEY: lost}, infra_failed=lost)
            e.env_s += o.seconds
            detail = {"episode_id": e.episode_id, "episode": e.status, "env": o.status, "turns": e.turns, **o.detail}
            results.append(RewardResult(score=float(o.reward), correct=bool(o.correct),
                                        status=OK if o.status not in FAILED else o.status, detail=detail,
                                        elapsed_s=e.env_s, infra_failed=o.infra_failed))
            if o.status in FAILED:
                log.warning("episode %s (row %s): environment %s%s: %s", e.episode_id, e.row.uid, o.status,
                            f" (the service's: {o.infra_failed})" if o.infra_failed else "", o.detail)
        return results

    def repair_pool(self, dead: set[int]) -> None:
        """Replace the env workers of the slots in ``dead`` (their process died under an episode) and those
        holding too many abandoned threads (``EnvPool.maintain``)."""
        for slot in sorted(dead):
            if slot < len(self.pool):
                log.warning("env worker %d died or was stuck: its episodes end with status error "
                            "(infra_failed worker_lost); replaced", slot)
                self.pool.replace(slot)
        self.stuck_workers.clear()
        self.pool.maintain()
