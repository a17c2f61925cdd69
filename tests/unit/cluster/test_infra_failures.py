"""A failed service is not a wrong answer, on the driver's side (``reward.infra``): an env worker lost under its
episodes, an agent program's service failure or its worker lost (the gateway's episodes), the LLM judge's engine
failing, the distillation teacher's failing: each sample invalid by default (``reward.on_infra_failure``), marked
with its cause and counted in the step's ``reward/infra_failed/<cause>`` (dynamic sampling's dropped groups too),
left out of its group's statistics; an agent that raised on the model's output keeps ``env.on_error``'s score.
No Ray: the judge's and teacher's engines are stand-ins that answer with ``CallFailure`` (their real failures:
tests/integration/test_llm_judge.py, tests/integration/test_distill.py)."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.config import load_config
from cluster.driver.agent_loop import EpisodeRunner
from cluster.driver.collect import Collected
from cluster.driver.distill import Distiller
from cluster.driver.episodes import Episode
from cluster.driver.gateway_episodes import AgentEpisode, GatewayEpisodeRunner
from cluster.driver.step_metrics import infra_metrics, rollout_metrics
from cluster.runtime.gateway import close_event
from cluster.runtime.judge import JudgedRewards, PendingJudgements
from cluster.runtime.model_fleet import CallFailure
from learner.advantages import group_advantages
from reward.config import JudgeConfig
from reward.contracts import RewardRequest, RewardResult
from rollout.contracts import Completion, PromptRow
from rollout.openai_protocol import ProtocolError

ROW = PromptRow("u", "12+30=", [1], "42")


def _cfg(**overrides):
    args = [f"{k}={v}" for k, v in overrides.items()]
    return load_config("configs/tiny_agent_calc.yaml", args)


def _comp(k: int, n: int = 2) -> Completion:
    return Completion("u", k, [1], [5] * n, [-0.5] * n, "x", "stop", 0)


@pytest.mark.parametrize("policy", ["invalid", "zero"])
def test_an_env_worker_lost_under_its_episodes_is_worker_lost(policy):
    runner = EpisodeRunner(_cfg(**{"reward.on_infra_failure": policy}), None, None, None)
    episodes = [Episode(f"u#{k}@1.0", ROW, k, seed=1, worker=0) for k in range(2)]
    for e in episodes:
        e.status, e.worker_lost = "error", True
    results = runner.finish_episodes(episodes)  # nothing asked of the dead worker
    for r in results:
        assert r.infra_failed == "worker_lost" and r.status == "error" and r.detail["error"] == "EnvWorkerLost"
        assert math.isnan(r.score) if policy == "invalid" else r.score == 0.0
    assert infra_metrics(Collected(results=results)) == {"reward/infra_failed": 2.0,
                                                         "reward/infra_failed/worker_lost": 2.0}


def _gateway_runner(**overrides) -> GatewayEpisodeRunner:
    cfg = _cfg(**{"env.tools": "[]", "env.agent": "reward.envs.calc_agent:run", **overrides})
    return GatewayEpisodeRunner(cfg, None, None, None, None)


def test_an_agents_service_failure_is_invalid_and_its_own_error_keeps_on_errors_score():
    r = _gateway_runner()
    cases = [({"kind": "end", "reward": None, "status": "error", "error": "ValueError: the model's JSON"}, 0.0, ""),  # the agent raised on the model's output: env.on_error (zero)
             ({"kind": "end", "reward": None, "status": "error", "error": "InfraFailure: search API down",
               "infra": "server_died"}, math.nan, "server_died")]
    for event, want, cause in cases:
        e = AgentEpisode("u#0@1.0", ROW, 0, seed=3, worker=0)
        assert r._on_event(e, event) is False and e.status == "error"
        detail: dict = {}
        score, correct, status = r._score(e, {}, detail)
        assert status == "error" and not correct and detail.get("infra", "") == cause
        assert math.isnan(score) if math.isnan(want) else score == want
    lost = AgentEpisode("u#1@1.0", ROW, 1, seed=3, worker=0)
    lost.status, lost.worker_lost = "error", True
    detail = {}
    score, _, _ = r._score(lost, {}, detail)
    assert math.isnan(score) and detail["infra"] == "worker_lost"


def test_the_gateway_takes_an_infra_cause_only_with_an_error():
    assert close_event({"status": "error", "error": "down", "infra": "service_timeout"})["infra"] == "service_timeout"
    assert "infra" not in close_event({"reward": 1.0})
    for body in ({"status": "ok", "infra": "server_died"}, {"status": "error", "infra": "disk_full"}):
        with pytest.raises(ProtocolError, match="infra must be one of"):
            close_event(body)


class _Calls:
    def __init__(self, answers):
        self.answers = answers

    def wait(self):
        return self.answers


class _Judge:
    """Stands in for the judge's ``JudgeFleet``: every engine's share fails (or answers unparsed)."""

    def __init__(self, answers):
        self.jc = JudgeConfig(model_path="builtin:tiny_moe", score="regex")
        self.answers = answers

    def submit(self, requests):
        return PendingJudgements(self, [[1]] * len(requests), list(range(len(requests))), _Calls(self.answers))

    @property
    def positive(self):
        return []

    negative = positive


class _Verifiers:
    def __init__(self, scores):
        self.scores = scores

    def score(self, requests):
        return [RewardResult(s, correct=True) for s in self.scores]

    def metrics(self):
        return {}


@pytest.mark.parametrize("policy", ["invalid", "zero"])
def test_a_judge_engine_that_fails_is_judge_failed_and_an_unparsed_answer_is_not_counted(policy):
    answers = [CallFailure("timeout", "GetTimeoutError", "past reward.judge.timeout_s"),
               CallFailure("error", "RayActorError", "the engine died"), ("no number here", {})]
    rewards = JudgedRewards(_Verifiers([1.0, 1.0, 1.0]), _Judge(answers), policy)
    reqs = [RewardRequest("42", ROW)] * 3
    timed_out, died, unparsed = rewards.score(reqs)
    for r, status in ((timed_out, "timeout"), (died, "error")):
        assert r.infra_failed == "judge_failed" and r.status == status and r.correct
        assert math.isnan(r.score) if policy == "invalid" else r.score == 0.0
    assert math.isnan(unparsed.score) and unparsed.infra_failed == ""  # the judge answered: invalid, not a service's
    m = rewards.metrics()
    assert m["reward/judge_failed"] == 3 and m["reward/judge_timeouts"] == 1 and m["reward/judge_unparsed"] == 1
    assert infra_metrics(Collected(results=[timed_out, died, unparsed]))["reward/infra_failed/judge_failed"] == 2


class _Teacher:
    def logprobs(self, completions):
        return [[-1.0, -1.0], CallFailure("timeout", "GetTimeoutError", "past distill.timeout_s"),
                CallFailure("error", "RayActorError", "died")]


def test_a_teacher_that_fails_makes_its_samples_teacher_failed_and_a_lost_sample_keeps_its_first_cause():
    lost = RewardResult(math.nan, status="error", detail={"infra": "worker_lost"}, infra_failed="worker_lost")
    c = Collected(completions=[_comp(0), _comp(1), _comp(2)],
                  results=[RewardResult(1.0, True), RewardResult(0.0), lost])
    Distiller(None, _Teacher()).annotate(c)
    assert c.results[0].score == 1.0 and c.results[0].infra_failed == ""
    assert math.isnan(c.results[1].score) and c.results[1].infra_failed == "teacher_failed"
    assert c.results[2].infra_failed == "worker_lost"  # counted once, under its first cause
    assert c.reward_metrics["distill/failed"] == 2
    assert infra_metrics(c) == {"reward/infra_failed": 2.0, "reward/infra_failed/teacher_failed": 1.0,
                                "reward/infra_failed/worker_lost": 1.0}


def test_the_step_counts_infra_failures_and_its_groups_leave_them_out():
    cfg = _cfg(**{"trainer.group_size": 4, "trainer.length_buckets": 0})
    results = [RewardResult(1.0, True), RewardResult(0.0),
               RewardResult(math.nan, status="error", infra_failed="server_died"),
               RewardResult(0.0, status="error", infra_failed="sandbox_start")]  # on_infra_failure: zero
    c = Collected(completions=[_comp(k) for k in range(4)], results=results,
                  reward_metrics={"reward/infra_failed": 3.0, "reward/infra_failed/server_died": 3.0})  # a dropped group
    rewards = torch.tensor([r.score for r in results], dtype=torch.float32)
    m = rollout_metrics(cfg, c, rewards)
    assert m["reward/infra_failed"] == 5 and m["reward/infra_failed/server_died"] == 4
    assert m["reward/infra_failed/sandbox_start"] == 1 and m["reward/invalid"] == 1
    adv = group_advantages(rewards, 4)
    assert adv[2] == 0  # the invalid sample: advantage 0, out of the mean and std of its group
    assert torch.allclose(adv[[0, 1, 3]], group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3))


class _Fleet:
    """Stands in for the rollout fleet: two-token answers for every prompt."""

    def generate_stream(self, rows, G, *, seed, pieces_per_engine):
        yield 0, [Completion(r.uid, k, [1], [5, 6], [-0.5, -0.5], "x", "stop", 0) for r in rows for k in range(G)]


class _Rewards:
    """The first round's samples lost to a dead worker, the next round's scored 1 and 0."""

    def __init__(self):
        self.rounds = 0

    def score(self, reqs):
        self.rounds += 1
        if self.rounds == 1:
            return [RewardResult(math.nan, status="error", infra_failed="worker_lost") for _ in reqs]
        return [RewardResult(float(i % 2 == 0), correct=i % 2 == 0) for i in range(len(reqs))]

    def metrics(self):
        return {}


def test_dynamic_sampling_counts_the_infra_failures_of_the_groups_it_drops():
    from cluster.data.prompts import PromptStream
    from cluster.driver.collect import Collector

    cfg = load_config("configs/tiny_moe.yaml", ["trainer.dynamic_sampling=true", "trainer.prompts_per_step=1",
                                               "trainer.group_size=2", "learner.num_minibatches=1",
                                               "learner.world_size=1", "learner.micro_batch_size=2",
                                               "trainer.length_buckets=0"])
    rows = [PromptRow(f"p{i}", "1+1=", [1], "2") for i in range(4)]
    c = Collector(cfg, PromptStream(rows, seed=0), _Fleet(), _Rewards()).collect(0)
    assert (c.dropped, len(c.prompts)) == (1, 1) and [r.infra_failed for r in c.results] == ["", ""]
    rewards = torch.tensor([r.score for r in c.results], dtype=torch.float32)
    m = rollout_metrics(cfg, c, rewards)
    assert m["reward/infra_failed"] == 2 and m["reward/infra_failed/worker_lost"] == 2  # lost, though not trained
