"""OpenEnv environments (``env.openenv``) against real servers: an env worker serving the example game
(``reward.envs.openenv_guess``) in a subprocess, one WebSocket session per episode (reset with the seed and the
row's meta, steps as tool calls, closed at the end), the model's mistakes back to it as tool errors, a server
killed mid-episode or answering too slowly ending only its episode (the service's failure: invalid and counted,
also under a group played by an env worker actor), the dead server started again for the next one, a running
server by URL, and a server that will not start stopping the run before any service starts, named."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch

from reward.config import EnvConfig
from reward.env_worker import EnvWorker
from reward.openenv_server import OpenEnvServer, OpenEnvStartError
from tests.helpers import REPO_ROOT

GAME = "reward.envs.openenv_guess:app"
APPS = "tests.helpers.openenv_apps"
META = {"low": 1, "high": 9, "guess_bonus": 0.2}


def config(**openenv) -> EnvConfig:
    settings = {"app": GAME, "tool_name": "guess", "reset_meta_keys": ["low", "high", "secret", "guess_bonus"],
                "start_timeout_s": 120.0, **openenv}
    return EnvConfig(openenv=settings, tool_timeout_s=5.0, tool_format="tag", max_turns=10)


def row(uid: str, **meta) -> dict:
    return {"uid": uid, "prompt": "Guess my number in 1..9.", "answer": "", "verifier": "exact",
            "meta": {**META, **meta}}


def guess(n) -> list[dict]:
    return [{"name": "guess", "arguments": {"number": n}}]


@pytest.fixture(scope="module")
def worker():
    w = EnvWorker(config())
    try:
        yield w
    finally:
        w.close()


def test_an_episode_is_one_session_from_reset_to_close(worker):
    w = worker
    assert w.openenv_server_pid() is not None
    start = w.start("e1", row("r1", secret=6), seed=3)
    assert start.status == "ok", start
    assert start.messages == [{"role": "user", "content": (
        "I am thinking of an integer between 1 and 9. Find it with the guess tool: each guess is answered "
        "'higher', 'lower' or 'correct'.")}]
    assert [s["function"]["name"] for s in start.tool_schemas] == ["guess"]
    assert start.tool_schemas[0]["function"]["parameters"]["properties"]["number"]["type"] == "integer"
    first = w.step("e1", "<call>guess 5</call>", guess("5"))  # the tag format's text argument, coerced by the server
    assert (first.messages, first.done, first.status) == ([{"role": "tool", "name": "guess", "content": "higher"}],
                                                          False, "ok")
    bad = w.step("e1", "<call>guess x</call>", guess("x"))  # the model's mistake: back to it, the episode goes on
    assert not bad.done and bad.tool_errors == {"raised": 1}
    assert bad.messages[0]["content"].startswith("Error: ValueError: Invalid message: number: Input should be a "
                                                 "valid integer")
    unknown = w.step("e1", "", [{"name": "guess", "arguments": {"number": 7, "colour": "red"}}])
    assert unknown.tool_errors == {"bad_arguments": 1} and not unknown.done
    last = w.step("e1", "<call>guess 6</call>", guess(6))
    assert last.messages[0]["content"] == "correct" and last.done and last.status == "ok"
    out = w.finish("e1")
    # 2 guesses reached the game (the server refused "x", the worker the unknown argument): 1 + 0.2 x (9 - 2)
    assert (out.status, out.reward, out.turns, out.correct) == ("ok", pytest.approx(2.4), 4, True)
    answered = w.start("e2", row("r2", secret=2), seed=3)
    assert answered.status == "ok"
    assert w.step("e2", "It is 5.", []).done  # a turn without a call is the answer: done
    assert w.finish("e2").reward == 0.0  # the server gave no reward
    m = w.metrics()
    assert m["env/episodes"] == 2 and m["env/ok"] == 2 and m["env/tool_errors/raised"] == 1
    assert m.get("env/errors", 0) == 0 and m["env/openenv_restarts"] == 0 and m["env/abandoned_threads"] == 0


def test_a_group_shares_its_seed_and_so_its_secret(worker):
    secrets = []
    for k, seed in enumerate((11, 11, 13)):
        w = worker
        assert w.start(f"s{k}", row(f"s{k}"), seed).status == "ok"
        n = 1
        while not w.step(f"s{k}", "", guess(n)).done:  # a scan: the episode ends on the secret
            n += 1
        assert w.finish(f"s{k}").correct
        secrets.append(n)
    assert secrets == [8, 8, 5]  # GuessNumber's secrets for these seeds: random.Random(seed).randint(1, 9)


def test_sessions_are_closed_at_the_end():
    """A server that holds one session at a time refuses a second: every episode's session must be closed for
    the next one (finished, aborted, or failed) to open."""
    w = EnvWorker(config(app=f"{APPS}:one_session"))
    try:
        for i in range(3):
            assert w.start(f"o{i}", row(f"o{i}", secret=5), seed=i).status == "ok"
            assert w.step(f"o{i}", "", guess(5)).done
            assert w.finish(f"o{i}").status == "ok"
        assert w.start("a", row("a"), seed=0).status == "ok"
        w.abort("a")
        assert w.start("b", row("b"), seed=0).status == "ok"
        second = w.start("c", row("c"), seed=0)  # b's session is open: this one is refused, its episode ends
        assert second.status == "error" and "CAPACITY_REACHED" in second.detail["message"], second
        assert second.detail["infra"] == "service_error"  # the server refused the session: not the model's doing
        assert w.finish("c").status == "error"
        w.abort("b")
        assert w.metrics()["env/errors"] == 1
    finally:
        w.close()


@pytest.mark.matrix  # a failure case: the default set keeps the server that will not start
def test_a_server_killed_mid_episode_ends_it_and_is_started_again():
    w = EnvWorker(config())
    try:
        assert w.start("k1", row("k1", secret=7), seed=1).status == "ok"
        assert w.step("k1", "", guess(5)).messages[0]["content"] == "higher"
        pid = w.openenv_server_pid()
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):  # gone (reaped) within seconds
            if w.openenv_server_pid() is None:
                break
            time.sleep(0.05)
        assert w.openenv_server_pid() is None
        dead = w.step("k1", "", guess(7))
        assert dead.done and dead.status == "error" and dead.messages == []
        assert dead.detail["error"] == "OpenEnvServerError" and dead.detail["infra"] == "server_died"
        out = w.finish("k1")  # the server's failure, not the model's: invalid (reward.on_infra_failure)
        assert (out.status, out.infra_failed, out.correct) == ("error", "server_died", False) and math.isnan(out.reward)
        again = w.start("k2", row("k2", secret=7), seed=1)  # the next episode starts the server again
        assert again.status == "ok" and w.openenv_server_pid() not in (None, pid)
        assert w.step("k2", "", guess(7)).done and w.finish("k2").status == "ok"
        m = w.metrics()
        assert (m["env/errors"], m["env/openenv_restarts"], m["env/ok"]) == (1, 1, 1)
    finally:
        w.close()
    assert w.openenv_server_pid() is None


@pytest.mark.matrix  # a failure case: the default set keeps the server that will not start
def test_a_server_answering_too_slowly_ends_the_episode_as_a_timeout():
    w = EnvWorker(EnvConfig(openenv={"app": f"{APPS}:slow", "tool_name": "guess", "start_timeout_s": 120.0},
                            tool_timeout_s=1.0))
    try:
        assert w.start("t1", row("t1"), seed=1).status == "ok"
        slow = w.step("t1", "", guess(999))
        assert slow.done and slow.status == "timeout" and "did not answer step within 0.9 s" in \
            slow.detail["message"]
        out = w.finish("t1")
        assert out.status == "timeout" and out.reward != out.reward  # NaN, an invalid sample
        assert out.infra_failed == "service_timeout"
        m = w.metrics()
        assert m["env/timeouts"] == 1 and m["env/abandoned_threads"] == 0  # the call was cancelled, no thread left
        assert w.start("t2", row("t2"), seed=1).status == "ok"  # the server itself is fine
        w.abort("t2")
    finally:
        w.close()


def test_a_running_server_by_url():
    server = OpenEnvServer(GAME, start_timeout_s=120.0)
    url = server.start()
    try:
        w = EnvWorker(config(app=None, url=url, prompt="row_and_observation"))
        start = w.start("u1", row("u1", secret=3), seed=0)
        assert start.status == "ok" and start.messages[0]["content"].startswith("Guess my number in 1..9.\n\nI am")
        assert w.step("u1", "", guess(3)).done and w.finish("u1").reward == pytest.approx(1.0 + 0.2 * 8)
        w.close()
        assert server.running()  # not the worker's to stop
    finally:
        server.stop()
    assert not server.running()


def test_a_server_that_will_not_start_stops_the_run_before_any_service(monkeypatch):
    from cluster.config import ConfigError, load_config
    from cluster.runtime.user_code import check_user_env

    with pytest.raises(OpenEnvStartError, match=r"(?s)app='tests.helpers.openenv_apps:missing'.*exited with status 2"
                                                r".*has no attribute 'missing'"):
        EnvWorker(config(app=f"{APPS}:missing"))
    monkeypatch.chdir(REPO_ROOT)
    cfg = load_config(REPO_ROOT / "configs" / "tiny_openenv_guess.yaml", [f"env.openenv.app={APPS}:not_an_app"])
    with pytest.raises(ConfigError, match=r"(?s)the run stops before any service starts: env.openenv.app="
                                          r"'tests.helpers.openenv_apps:not_an_app': the server exited with status 2"
                                          r".*is 42, not an ASGI app"):
        check_user_env(cfg)
    cfg = load_config(REPO_ROOT / "configs" / "tiny_openenv_guess.yaml",
                      ["env.openenv.app=null", "env.openenv.url=http://127.0.0.1:9", "env.openenv.start_timeout_s=2"])
    with pytest.raises(ConfigError, match=r"env.openenv.url='http://127.0.0.1:9': no action schema"):
        check_user_env(cfg)
    assert check_user_env(load_config(REPO_ROOT / "configs" / "tiny_openenv_guess.yaml")) == []  # in the repo


def test_a_server_killed_under_a_group_leaves_its_episodes_out_of_the_group_and_counts_them(ray_cluster):
    """A real service dies mid-step: the OpenEnv server of configs/tiny_openenv_guess.yaml, under the env worker
    actor that started it, killed while two of a group's four episodes are under way. Those two are the
    service's failures (``server_died``): invalid (NaN, ``reward.on_infra_failure: invalid``), counted in the
    step's ``reward/infra_failed``, and the group's advantages come from the two that ended."""
    import ray

    from cluster.config import load_config
    from cluster.driver.agent_loop import EpisodeRunner
    from cluster.driver.collect import Collected
    from cluster.driver.env_pool import EnvPool
    from cluster.driver.episodes import Episode
    from cluster.driver.step_metrics import rollout_metrics
    from learner.advantages import group_advantages
    from rollout.contracts import PromptRow

    cfg = load_config(REPO_ROOT / "configs" / "tiny_openenv_guess.yaml",
                      ["trainer.group_size=4", "learner.micro_batch_size=16", "trainer.length_buckets=0"])
    pool = EnvPool(cfg, lambda slot: "DEFAULT")
    try:
        runner = EpisodeRunner(cfg, None, pool, None)
        r = PromptRow("g", "Guess my number in 1..9.", [3, 4], "", verifier="exact", meta={**META, "secret": 6})
        group = [Episode(f"g#{k}@1.0", r, k, seed=7, worker=0) for k in range(4)]
        runner.start_episodes(group)  # four sessions on the worker's server
        assert [e.status for e in group] == ["running"] * 4 and group[0].prompt_ids == [3, 4]
        worker = pool.workers[0]

        def step(e: Episode, text: str, calls: list[dict]):
            s = ray.get(worker.step.remote(e.episode_id, text, calls, []))
            if s.done:
                runner._on_step(e, s)
            return s

        assert step(group[0], "", guess(6)).done  # correct at the first guess: 1 + 0.2 x 8
        assert step(group[1], "It is 5.", []).done  # an answer without a guess: 0
        for e in group[2:]:
            assert step(e, "", guess(5)).messages[0]["content"] == "higher"
        pid = ray.get(worker.openenv_server_pid.remote())
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            if ray.get(worker.openenv_server_pid.remote()) is None:
                break
            time.sleep(0.05)
        for e in group[2:]:
            dead = step(e, "", guess(6))
            assert dead.status == "error" and dead.detail["infra"] == "server_died", dead
        results = runner.finish_episodes(group)
        assert [x.infra_failed for x in results] == ["", "", "server_died", "server_died"]
        assert results[0].score == pytest.approx(2.6) and results[1].score == 0.0
        assert all(math.isnan(x.score) and x.status == "error" for x in results[2:])
        c = Collected(completions=[e.completion() for e in group], results=results, reward_metrics=pool.take_metrics())
        rewards = torch.tensor([x.score for x in results], dtype=torch.float32)
        m = rollout_metrics(cfg, c, rewards)
        assert (m["reward/infra_failed"], m["reward/infra_failed/server_died"], m["reward/invalid"]) == (2, 2, 2)
        assert m["reward/mean"] == pytest.approx(1.3)  # the two that ended
        adv = group_advantages(rewards, 4)
        assert adv[2:].tolist() == [0.0, 0.0]  # out of the group's statistics
        assert torch.allclose(adv[:2], group_advantages(rewards[:2], 2))
    finally:
        pool.shutdown()
