"""A rollout engine that dies with turns open (``EpisodeRunner.engine_lost``, called by ``pump`` when an
``advance_turns`` call raises ``RayActorError``): the engine is replaced, an environment's episode samples its
turn again, an agent program's request fails with 503 ``engine_lost`` and the episode is put back as it was
before that request, so a retry continues. The death is signalled by calling ``engine_lost`` as ``pump`` does
(a fake fleet records the replacement; no Ray, no real engine); the 503 body through the real gateway and an
``openai`` client is checked with the scripted driver."""

from __future__ import annotations

from collections import Counter

import openai

from cluster.driver.agent_loop import EpisodeRunner
from cluster.driver.episodes import Episode, TurnLoop
from reward.episode_status import RUNNING
from rollout.contracts import PromptRow
from rollout.openai_protocol import ProtocolError
from tests.helpers.gateway_script import play
from tests.unit.cluster.test_gateway_episodes import CALL, USER, _episode, _request, _runner, _sample


class _Fleet:
    def __init__(self, n: int = 2):
        self.engines, self.replaced = [object() for _ in range(n)], []

    def replace(self, slot: int) -> None:
        self.replaced.append(slot)


def _loop(lost, others=()) -> TurnLoop:
    """A loop with ``lost`` episodes' turns open on engine 0 (two calls queued there, one on engine 1)."""
    loop = TurnLoop(by_id={e.episode_id: e for e in [*lost, *others]})
    loop.calls, loop.open_turns = {"call-a": 0, "call-b": 0, "call-c": 1}, Counter({0: len(lost), 1: 1})
    return loop


def test_an_agent_programs_request_fails_with_503_and_its_retry_continues_the_branch():
    r, e = _runner(), _episode()
    r.fleet = _Fleet()
    assert r._take_request(e, _request([USER])) is None
    sent = _sample(r, e, CALL)
    after_turn = (list(e.response_ids), list(e.mask), [dict(m) for m in e.known])
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "42"}
    retried = _request([USER, sent, tool])
    assert r._take_request(e, retried) is None
    continued = list(e.response_ids)
    loop = _loop([e])
    r.engine_lost(loop, 0)
    assert r.fleet.replaced == [0] and loop.calls == {"call-c": 1} and loop.open_turns[0] == 0
    sid, answer, _ = r.gateway.sent[-1]
    assert sid == "s" and isinstance(answer, ProtocolError) and (answer.status, answer.code) == (503, "engine_lost")
    assert list(loop.stepping.values()) == [e] and e.status == RUNNING  # the agent's next event is awaited
    assert (e.response_ids, e.mask, e.known) == after_turn  # as before the failed request
    assert r._take_request(e, retried) is None  # the client's retry continues the branch: no fork
    assert e.response_ids == continued and r.forks == 0 and not e.branches


def test_a_lost_request_that_had_forked_is_undone_with_its_fork():
    r, e = _runner(), _episode()
    r.fleet = _Fleet(1)
    r._take_request(e, _request([USER]))
    _sample(r, e, CALL)
    sampled = list(e.sampled)
    r._take_request(e, _request([{"role": "user", "content": "Summary: 42. Answer now."}]))
    assert r.forks == 1 and e.branches
    r.engine_lost(_loop([e]), 0)
    assert r.forks == 0 and not e.branches and e.sampled == sampled and e.branch == 0


def test_an_environments_episode_samples_its_turn_again_on_the_new_engine():
    runner = EpisodeRunner.__new__(EpisodeRunner)  # only engine_lost's state: the fleet
    runner.fleet = _Fleet()
    row = PromptRow("u", "1+1=", [1], "2")
    lost, waiting, other = (Episode(f"u#{k}@1.0", row, k, seed=1, worker=0, group=g)
                            for k, g in ((0, 0), (1, 0), (2, 1)))
    loop = _loop([lost], others=[waiting, other])
    loop.stepping["step-ref"] = waiting  # its environment is answering: nothing open on the engine
    runner.engine_lost(loop, 0)
    assert runner.fleet.replaced == [0] and loop.ready == [lost]  # engine 1's episode and the stepping one stay


def test_the_agent_gets_openais_503_error_body():
    seen = {}

    def agent(row, client):
        try:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        except openai.APIStatusError as err:
            seen["status"], seen["body"] = err.status_code, err.body
        return 0.0

    lost = ProtocolError(503, "the rollout engine serving this request died; it is being replaced: retry",
                         type="server_error", code="engine_lost")
    played = play(agent, {"prompt": "1+1="}, [lost])
    assert seen["status"] == 503
    assert seen["body"]["code"] == "engine_lost" and seen["body"]["type"] == "server_error"
    assert played.end["status"] == "ok" and played.counters["gateway/errors/503"] == 1
