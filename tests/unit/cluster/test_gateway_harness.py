"""A separate program takes its episodes from the gateway itself (``env.gateway.harness``): ``POST /sessions`` with
the run key gives a waiting episode's row, base URL and key; the program plays it and closes it with a reward.
The real ``Gateway`` served in-process, the driver's side a script (``tests/helpers/gateway_script.drive``), the
program a real subprocess (``python -m reward.envs.calc_harness``). No Ray, no engine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cluster.runtime.gateway import Gateway
from tests.helpers.gateway_script import Played, _stop, call_reply, drive, text_reply

ROOT = Path(__file__).resolve().parents[3]
ROW = {"uid": "r7", "prompt": "What is 6*7?", "answer": "42", "verifier": None, "meta": {}}


def test_a_separate_program_claims_plays_and_closes_its_episode_with_a_reward():
    played, out = Played(), {}

    async def main() -> None:
        gateway = Gateway()
        await gateway.start()
        try:
            await gateway.open("other", dict(ROW, uid="r1"))  # waits first: claimed by uid it stays waiting
            played.session = await gateway.open("s1", ROW)
            env = {**os.environ, **await gateway.harness_env(), "PYTHONPATH": str(ROOT)}
            proc = subprocess.Popen([sys.executable, "-m", "reward.envs.calc_harness", "--max-sessions", "1",
                                     "--parallel", "1", "--uid", "r7", "--wait-s", "20"], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            await drive(gateway, "s1", [call_reply("calc", expression="6*7"), text_reply("It is 42.")], played, 60)
            for _ in range(600):  # the program exits after its one episode
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.05)
            out["rc"], out["log"] = proc.wait(5), proc.stdout.read()
            out["waiting"] = [sid for sid, _ in gateway.waiting]
            played.counters = await gateway.take_counters()
        finally:
            await _stop(gateway)

    asyncio.run(main())
    assert out["rc"] == 0, out["log"]
    assert played.end == {"kind": "end", "reward": 1.0, "status": "ok", "error": None}, out["log"]
    # it played the row it was given: the prompt, then the tool's answer to the call the script sampled
    assert played.requests[0]["messages"] == [{"role": "user", "content": "What is 6*7?"}]
    assert played.requests[1]["messages"][-1]["role"] == "tool" and "42" in played.requests[1]["messages"][-1]["content"]
    assert out["waiting"] == ["other"] and played.counters["gateway/claims"] == 1
    assert "s1 r7 reward 1.0" in out["log"]


def test_claims_need_the_run_key_wait_for_an_episode_and_end_with_the_run():
    seen = {}

    async def main() -> None:
        gateway = Gateway()
        root = await gateway.start()
        url, auth = root + "/sessions", {"Authorization": f"Bearer {gateway.run_key}"}
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                session = await gateway.open("s1", ROW)
                seen["other_key"] = (await http.post(url, json={}, headers={
                    "Authorization": f"Bearer {session['api_key']}"})).status_code  # a session's key is not the run's
                seen["no_key"] = (await http.post(url, json={})).status_code
                seen["bad_body"] = (await http.post(url, json={"wait_s": "soon"}, headers=auth)).json()["error"]
                seen["other_row"] = (await http.post(url, json={"uid": "r9", "wait_s": 0}, headers=auth)).status_code
                await gateway.close("s1")  # its episode ended while it waited: never given out
                seen["closed"] = (await http.post(url, json={"wait_s": 0}, headers=auth)).status_code
                later = asyncio.create_task(http.post(url, json={"wait_s": 20}, headers=auth))
                await asyncio.sleep(0.2)
                await gateway.open("s2", dict(ROW, uid="r2"))  # a waiting claim takes it as it is opened
                claimed = (await later).json()
                seen["claimed"] = claimed["session_id"], claimed["row"]["uid"], claimed["api_key"] == (
                    gateway.sessions["s2"].key)
                seen["session_works"] = (await http.get(claimed["base_url"] + "/models", headers={
                    "Authorization": f"Bearer {claimed['api_key']}"})).status_code
                ending = asyncio.create_task(http.post(url, json={"wait_s": 20}, headers=auth))
                await asyncio.sleep(0.2)
                await gateway.stop()
                seen["stopped"] = (await ending).json()["error"]["code"]
        finally:
            await _stop(gateway)

    asyncio.run(main())
    assert seen["other_key"] == seen["no_key"] == 401
    assert seen["bad_body"]["param"] == "wait_s"
    assert seen["other_row"] == seen["closed"] == 204
    assert seen["claimed"] == ("s2", "r2", True) and seen["session_works"] == 200
    assert seen["stopped"] == "gateway_stopped"


def test_the_harness_without_its_environment_says_so():
    done = subprocess.run([sys.executable, "-m", "reward.envs.calc_harness"], cwd=ROOT, capture_output=True,
                          text=True, env={k: v for k, v in os.environ.items() if not k.startswith("GSPO_GATEWAY")}
                          | {"PYTHONPATH": str(ROOT)}, timeout=60)
    assert done.returncode == 2 and "GSPO_GATEWAY_URL" in done.stderr


@pytest.mark.parametrize("overrides, error", [
    (["env.tools=[]", "env.gateway.harness=python -m x", "env.agent=reward.envs.calc_agent:run"], "harness"),
    (["env.gateway.harness=python -m x"], "harness"),  # beside env.tools
])
def test_a_harness_is_the_only_way_an_episode_is_defined(overrides, error):
    from cluster.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match=error):
        load_config("configs/tiny_agent_calc.yaml", overrides)


def test_a_harness_run_is_an_agent_program_run():
    from cluster.config import load_config

    cfg = load_config("configs/tiny_agent_calc.yaml", ["env.tools=[]", "env.gateway.harness=python -m x"])
    assert cfg.env.enabled and cfg.env.agent_program and cfg.env.agent is None


class _FakeGateway:
    """The gateway actor's handle as the runner calls it (``x.remote(...)`` answers at once; an exchange's answer
    is a ref the patched ``ray.get`` reads as a timeout)."""

    def __init__(self):
        self.opened, self.exchanged = [], []
        outer = self

        class _Call:
            def __init__(self, fn):
                self.remote = fn

        self.open_many = _Call(lambda reqs: outer.opened.extend(reqs) or [
            {"session_id": sid, "base_url": f"http://h/s/{sid}/v1", "api_key": "k"} for sid, _ in reqs])
        self.exchange = _Call(lambda sid, answer, timeout: outer.exchanged.append(sid) or ("timeout", sid))


class _FakePool:
    def __init__(self):
        self.started = []
        pool = self

        class _Worker:
            class start_agents:  # noqa: N801 - stands in for a Ray method
                @staticmethod
                def remote(jobs):
                    pool.started.extend(jobs)

        self.workers = [_Worker()]


@pytest.mark.parametrize("harness", [None, "python -m reward.envs.calc_harness"])
def test_the_driver_opens_each_episode_with_its_row_for_a_harness_and_starts_no_agent(monkeypatch, harness):
    from cluster.config import load_config
    from cluster.driver import gateway_episodes
    from cluster.driver.gateway_episodes import AgentEpisode, GatewayEpisodeRunner
    from rollout.contracts import PromptRow
    from tests.helpers.chat_tokenizers import build_bpe_tokenizer

    monkeypatch.setattr(gateway_episodes.ray, "get",  # an exchange's ref: nothing came before the deadline
                        lambda x, timeout=None: {"kind": "timeout"} if isinstance(x, tuple) else x)
    way = [f"env.gateway.harness={harness}"] if harness else ["env.agent=reward.envs.calc_agent:run"]
    cfg = load_config("configs/tiny_agent_calc.yaml", ["env.tools=[]", *way])
    runner = GatewayEpisodeRunner(cfg, None, _FakePool(), build_bpe_tokenizer(), _FakeGateway())
    rows = [PromptRow("u", "1+1=", [1], "2"), PromptRow("v", "2+2=", [1], "4")]
    episodes = [AgentEpisode(f"{r.uid}#{k}@1.0", r, k, seed=3, worker=0) for r in rows for k in range(2)]
    for ref, e in runner.start_episodes(episodes).items():  # the loop applies each first event as it comes
        runner._on_start(e, ref)
    opened = runner.gateway.opened
    assert len(opened) == 4 and len({sid for sid, _ in opened}) == 4  # one session per episode, G per row
    assert [row and row["uid"] for _, row in opened] == (["u", "u", "v", "v"] if harness else [None] * 4)
    assert len(runner.pool.started) == (0 if harness else 4)
    # an episode no program claimed ends at its deadline: status timeout, scored by env.on_error
    assert [e.status for e in episodes] == ["timeout"] * 4


def test_the_harness_command_runs_with_the_drivers_python_and_the_run_key(tmp_path):
    from cluster.driver.gateway_episodes import start_harness

    log = tmp_path / "logs" / "harness.log"
    proc = start_harness("python -c 'import os, sys; print(sys.executable, os.environ[\"GSPO_GATEWAY_KEY\"])'",
                         {"GSPO_GATEWAY_KEY": "k1"}, log)
    assert proc.wait(60) == 0 and log.read_text().split() == [sys.executable, "k1"]
