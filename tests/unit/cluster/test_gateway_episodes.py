"""An agent program's requests onto its episode (cluster/driver/gateway_episodes.py): continue on the sampled ids,
fork where the history diverges, the errors a request can get, the branch that trains, and a request whose engine
died (503 ``engine_lost``, the episode put back as before it). No Ray: the gateway handle is a stand-in that
records the answers the driver sends."""

from __future__ import annotations

import json
from collections import Counter

import openai
import pytest

from cluster.config import load_config
from cluster.driver.agent_loop import EpisodeRunner
from cluster.driver.episodes import Episode, TurnLoop
from cluster.driver.gateway_episodes import AgentEpisode, GatewayEpisodeRunner
from reward.episode_status import RUNNING
from rollout.contracts import PromptRow, SampledTurn
from rollout.gateway_session import canonical_message, continuation, format_call, render_plain
from rollout.openai_protocol import ProtocolError
from tests.helpers.chat_tokenizers import REASONING_STRIPPING_TEMPLATE, build_bpe_tokenizer
from tests.helpers.gateway_script import play

CALC = [{"type": "function", "function": {"name": "calc", "description": "Add.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


class _Handle:
    """Stands in for the gateway actor's handle: ``exchange.remote(...)`` records what the driver answered."""

    def __init__(self):
        self.sent: list[tuple] = []
        self.exchange = self

    def remote(self, *args):
        self.sent.append(args)
        return f"ref{len(self.sent)}"


def _runner(template: str | None = None, **overrides) -> GatewayEpisodeRunner:
    args = ["env.tools=[]", "env.agent=reward.envs.calc_agent:run", "env.tool_format=hermes",
            "rollout.max_model_len=256"] + [f"{k}={v}" for k, v in overrides.items()]
    cfg = load_config("configs/tiny_agent_calc.yaml", args)
    tok = build_bpe_tokenizer() if template is None else build_bpe_tokenizer(template)
    return GatewayEpisodeRunner(cfg, None, None, tok, _Handle())


def _episode() -> AgentEpisode:
    e = AgentEpisode("u#0@1.0", PromptRow("u", "12+30=", [1], "42"), 0, seed=3, worker=0)
    e.session = {"session_id": "s"}
    return e


def _request(messages, **kw) -> dict:
    return {"messages": messages, "tools": CALC, "max_tokens": None, "stop": [], "temperature": None,
            "top_p": None, **kw}


def _sample(r: GatewayEpisodeRunner, e: AgentEpisode, text: str, version: int = 5) -> dict:
    """The engine samples ``text`` (ending on the EOS token); returns the assistant message the gateway sent."""
    ids = r.tokenizer(text, add_special_tokens=False)["input_ids"] + [r.tokenizer.eos_token_id]
    r._on_turn(e, SampledTurn(e.episode_id, ids, [-0.5] * len(ids), text, "stop", None, version), {})
    reply = r.gateway.sent[-1][1]
    return {"role": "assistant", "content": reply.content or None, "tool_calls": [
        {"id": f"call_{k}", "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for k, c in enumerate(reply.tool_calls)] or None}


USER = {"role": "user", "content": "What is 12+30?"}
CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "12+30"}}</tool_call>'


def test_a_continued_history_appends_only_the_new_messages_after_the_sampled_ids():
    r, e = _runner(), _episode()
    assert r._take_request(e, _request([USER])) is None
    prompt = list(e.prompt_ids)
    assert prompt == r.tokenizer.apply_chat_template([USER], tools=CALC, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
    sent = _sample(r, e, CALL)
    assert r.gateway.sent[-1][1].tool_calls == [{"name": "calc", "arguments": {"expression": "12+30"}}]
    sampled = list(e.sampled)
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "42"}
    assert r._take_request(e, _request([USER, sent, tool])) is None
    assert e.prompt_ids == prompt and e.response_ids[:len(sampled)] == sampled  # nothing re-tokenized
    assert e.mask == [1] * len(sampled) + [0] * (len(e.response_ids) - len(sampled)) and not e.branches
    assert r.forks == 0


def test_an_edited_history_forks_and_the_longest_branch_trains():
    r, e = _runner(), _episode()
    r._take_request(e, _request([USER]))
    sent = _sample(r, e, CALL)
    first = list(e.sampled)
    summary = {"role": "user", "content": "Summary: the calculator said 42. Answer now."}
    assert r._take_request(e, _request([summary])) is None  # the history was replaced: a new branch
    assert r.forks == 1 and e.branches[0]["sampled"] == first and e.sampled == [] and e.response_ids == []
    assert e.prompt_ids == r.tokenizer.apply_chat_template([summary], tools=CALC, add_generation_prompt=True,
                                                           tokenize=True, return_dict=False)
    _sample(r, e, "42")
    e.keep_longest()
    assert e.sampled == first  # the call's branch holds more sampled tokens than the answer's
    assert sent["tool_calls"] and continuation([USER, sent], [summary]) is None


def test_a_template_that_strips_reasoning_forks_every_turn_and_each_turn_keeps_its_sampled_ids():
    r, e = _runner(REASONING_STRIPPING_TEMPLATE), _episode()
    r._take_request(e, _request([USER]))
    sent = _sample(r, e, "<think>\nadd them\n</think>\n\n" + CALL)
    first = list(e.sampled)
    tool = {"role": "tool", "tool_call_id": "call_0", "content": "42"}
    assert r._take_request(e, _request([USER, sent, tool])) is None
    assert r.forks == 1 and e.branches[0]["sampled"] == first  # the delta is not prefix-stable: re-rendered whole
    assert "add them" not in r.tokenizer.decode(e.prompt_ids)  # the template dropped the earlier reasoning


def test_refused_forks_context_limits_and_sampling_overrides():
    r, e = _runner(**{"env.gateway.fork_policy": "refuse"}), _episode()
    r._take_request(e, _request([USER], temperature=0.2))
    assert r.overridden == 1
    _sample(r, e, CALL)
    err = r._take_request(e, _request([{"role": "user", "content": "start again"}]))
    assert isinstance(err, ProtocolError) and err.status == 400 and err.code == "history_diverged"
    small, e2 = _runner(**{"rollout.max_model_len": 48}), _episode()  # the tools alone take more
    err = small._take_request(e2, _request([USER]))
    assert err.code == "context_length_exceeded" and err.param == "messages" and e2.cut


def test_plain_mode_renders_the_rows_prompt_as_its_ids_and_a_history_in_the_tool_format():
    tag = [{"role": "user", "content": "1+2="},
           {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calc",
                                                                               "arguments": '{"expression": "1+2"}'}}]},
           {"role": "tool", "content": "3"}]
    assert render_plain(tag, "tag") == "1+2=<call>calc 1+2</call><result>3</result>"
    raw = {canonical_message(tag[1]): "<call>calc  1+2</call>"}
    assert render_plain(tag, "tag", raw) == "1+2=<call>calc  1+2</call><result>3</result>"
    assert format_call("hermes", "calc", {"expression": "1+2"}) == CALL.replace("12+30", "1+2")
    with pytest.raises(ValueError, match="role 'critic'"):
        render_plain([{"role": "critic", "content": "x"}], "tag")


def test_canonical_messages_ignore_what_clients_rewrite():
    a = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expression":"1+2"}'}}]}
    b = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_zz", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "1+2"}'}}]}
    assert canonical_message(a) == canonical_message(b)
    assert canonical_message(a) != canonical_message({**b, "content": "x"})
    assert continuation([USER, a], [USER, b, {"role": "tool", "content": "3"}]) == [{"role": "tool", "content": "3"}]
    assert continuation([USER, a], [USER, b]) is None  # nothing new
    assert continuation([USER, a], [USER, b, {"role": "assistant", "content": "x"}]) is None  # not a reply


@pytest.mark.parametrize("on_error, want", [("zero", 0.0), ("drop", float("nan"))])
def test_an_agent_that_fails_or_times_out_ends_its_episode_scored_by_on_error(on_error, want):
    import math

    r = _runner(**{"env.on_error": on_error})
    for event, status in [({"kind": "timeout"}, "timeout"),
                          ({"kind": "end", "reward": None, "status": "error", "error": "ValueError: boom"}, "error")]:
        e = _episode()
        assert r._on_event(e, event) is False and e.status == status
        detail: dict = {}
        score, correct, got = r._score(e, {}, detail)
        assert got == status and not correct and (math.isnan(score) if math.isnan(want) else score == want)
        assert detail["error"]


def test_an_agent_reward_is_taken_as_returned_and_named_components_are_summed():
    r, e = _runner(), _episode()
    assert r._on_event(e, {"kind": "end", "reward": {"found": 1.0, "speed": 0.25}, "status": "ok"}) is False
    detail: dict = {}
    assert r._score(e, {}, detail) == (1.25, True, "ok") and detail["components"] == {"found": 1.0, "speed": 0.25}
    e2 = _episode()
    e2.cut = e2.truncated = True  # its last request got context_length_exceeded and the agent raised on it
    r._on_event(e2, {"kind": "end", "reward": None, "status": "error", "error": "BadRequestError"})
    assert e2.status == "cut_tokens" and e2.end["reward"] is None  # scored as it stands, by the verifier


# -- an engine that dies with turns open (EpisodeRunner.engine_lost, called by pump when an advance_turns call
# raises RayActorError): signalled here by calling engine_lost as pump does, a fake fleet records the replacement


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


@pytest.mark.parametrize("policy", ["longest", "all"])
def test_fork_policy_all_hands_every_earlier_branch_to_the_trainer(monkeypatch, policy):
    from cluster.driver import gateway_episodes

    monkeypatch.setattr(gateway_episodes.ray, "get", lambda x, timeout=None: x)
    r, e = _runner(**{"env.gateway.fork_policy": policy}), _episode()
    r.gateway.close_many = r.gateway  # close_many.remote(...) recorded like exchange's
    r._take_request(e, _request([USER]))
    _sample(r, e, CALL)
    first = list(e.sampled)
    r._take_request(e, _request([{"role": "user", "content": "Summary: 42. Answer now."}]))
    _sample(r, e, "42")
    last = list(e.sampled)
    e.status, e.end = "ok", {"kind": "end", "reward": 1.0, "status": "ok"}
    [result] = r.finish_episodes([e])
    branches = r.take_branches()
    assert result.score == 1.0 and result.detail["forks"] == 1 and r.take_branches() == {}
    if policy == "all":  # the last branch is the episode's completion, the earlier one beside it
        assert e.sampled == last and result.detail["branch"] == 1
        [(number, comp)] = branches[e.episode_id]
        assert number == 0 and [t for t, m in zip(comp.response_token_ids, comp.response_mask) if m] == first
    else:  # the longest branch (the call's) alone
        assert e.sampled == first and result.detail["branch"] == 0 and branches == {}
