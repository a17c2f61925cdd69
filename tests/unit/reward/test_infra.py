"""A failed service is not a wrong answer (``reward.infra``): per cause on the reward side, the sample is invalid
(NaN) by default, marked with its cause and counted; a failure the model caused keeps its score. The verifier's
process that dies (``worker_lost``), a sandbox that cannot start a run (``sandbox_start``: the code verifier and
the python tool), an environment's service that times out, dies or errs (``service_timeout``, ``server_died``,
``service_error``), OpenEnv's server failures by kind; and the model's own: a verifier that raises or times out,
code that crashes or loops, a malformed or failing tool call, an environment's own code that raises."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from reward.config import EnvConfig, RewardConfig
from reward.contracts import RewardRequest
from reward.env_worker import EnvWorker
from reward.infra import CAUSES, METRIC, Cause, InfraFailure, cause_of, counts, infra_score
from reward.openenv_env import OpenEnvEnvironment, OpenEnvReplyError, OpenEnvServerError, tool_function
from reward.worker import RewardWorker
from rollout.contracts import PromptRow
from tests.helpers.envs import row
from tests.helpers.sandbox import sandbox_backend

U = "tests.helpers.userfns"
H = "tests.helpers.envs"
NOWHERE = "/nonexistent/gspo-scratch"  # a sandbox scratch root that does not exist: no run can start
LOOKUP = {"name": "lookup", "arguments": {"key": "k"}}


def request(verifier: str, response: str = "", answer: str = "1", **meta) -> RewardRequest:
    return RewardRequest(response, PromptRow("u1", "p", [1], answer, verifier=verifier, meta=meta))


def test_causes_scores_and_counts():
    assert CAUSES == ("worker_lost", "service_timeout", "server_died", "service_error", "sandbox_start",
                      "judge_failed", "teacher_failed")
    assert math.isnan(infra_score("invalid")) and infra_score("zero") == 0.0
    with pytest.raises(ValueError, match="on_infra_failure='drop'"):
        infra_score("drop")
    with pytest.raises(ValueError):
        InfraFailure("disk_full")
    assert cause_of(InfraFailure(Cause.SERVER_DIED, "gone")) == "server_died" and cause_of(RuntimeError()) is None
    assert counts(["", None, "worker_lost", "judge_failed", "worker_lost"]) == {
        METRIC: 3.0, f"{METRIC}/worker_lost": 2.0, f"{METRIC}/judge_failed": 1.0}
    assert counts([]) == {METRIC: 0.0}
    assert RewardConfig().on_infra_failure == "invalid" and EnvConfig().on_error == "zero"  # the defaults


@pytest.mark.parametrize("policy", ["invalid", "zero"])
def test_a_verifier_process_that_dies_is_worker_lost_and_the_models_failures_keep_their_score(policy):
    w = RewardWorker(RewardConfig(timeout_s=2.0, preload=[U], on_infra_failure=policy))
    bomb = "\\boxed{9^{9^{9^{9^{9}}}}}"  # a degenerate answer that keeps math-verify past reward.timeout_s
    try:
        died, raised, hung = w.score([request(f"{U}:dies"), request(f"{U}:raises"), request("math", bomb, "18")])
    finally:
        w.close()
    assert died.infra_failed == "worker_lost" and died.detail["infra"] == "worker_lost"
    assert (math.isnan(died.score) and not died.valid) if policy == "invalid" else died.score == 0.0
    # the response made the verifier raise or hang: the model's, scored error_score / timeout_score (0)
    assert (raised.score, raised.status, raised.infra_failed) == (0.0, "error", "")
    assert (hung.score, hung.status, hung.infra_failed) == (0.0, "timeout", "")


def test_a_sandbox_that_cannot_start_makes_code_invalid_while_code_that_fails_keeps_its_score():
    tests = ["assert f(2) == 4"]
    sandbox = {"backend": sandbox_backend(), "wall_s": 1.0}
    w = RewardWorker(RewardConfig(timeout_s=10.0, sandbox={**sandbox, "tmp_root": NOWHERE}))
    try:
        (lost,) = w.score([request("code", "def f(x):\n    return 2 * x\n", tests=tests)])
    finally:
        w.close()
    assert math.isnan(lost.score) and lost.infra_failed == "sandbox_start" and lost.status == "error"
    assert lost.detail["error"] == "InfraFailure" and "could not start" in lost.detail["message"]
    w = RewardWorker(RewardConfig(timeout_s=10.0, sandbox=sandbox))
    try:
        good, crashed, looped = w.score([request("code", "def f(x):\n    return 2 * x\n", tests=tests),
                                         request("code", "def f(x):\n    return 1 / 0\n", tests=tests),
                                         request("code", "while True:\n    pass\n", tests=tests)])
    finally:
        w.close()
    assert (good.score, good.infra_failed) == (1.0, "")
    for r in (crashed, looped):  # the model's code crashed or ran out of time: a failed test, score kept
        assert (r.score, r.status, r.infra_failed) == (0.0, "ok", "")
    assert looped.detail["sandbox"] == "timeout"


def test_an_environments_service_that_times_out_or_dies_ends_the_episode_invalid():
    w = EnvWorker(EnvConfig(cls=f"{H}:ServiceTool", tool_timeout_s=5.0))
    slow = w.start("t", row("t", service="service_timeout"), seed=0)
    assert slow.status == "ok"
    step = w.step("t", "", [LOOKUP])
    assert step.done and step.status == "timeout" and step.detail["infra"] == "service_timeout"
    out = w.finish("t")
    assert math.isnan(out.reward) and out.infra_failed == "service_timeout" and out.status == "timeout"
    dead = w.start("d", row("d", service_fails_in="init", cause="server_died"), seed=0)  # no session at all
    assert dead.status == "error" and dead.detail["infra"] == "server_died"
    out = w.finish("d")
    assert math.isnan(out.reward) and out.infra_failed == "server_died"
    assert w.metrics()["env/errors"] == 1  # counted as failures too


@pytest.mark.parametrize("on_error, want", [("zero", 0.0), ("drop", math.nan)])
def test_failures_of_the_model_or_the_environments_own_code_keep_env_on_errors_score(on_error, want):
    w = EnvWorker(EnvConfig(cls=f"{H}:ServiceTool", on_error=on_error))
    assert w.start("m", row("m", service="raise"), seed=0).status == "ok"
    failing = w.step("m", "", [LOOKUP], ["bad JSON in the call"])  # a failing tool, a malformed call: the model's
    assert not failing.done and failing.tool_errors == {"parse": 1, "raised": 1}
    assert failing.messages[0]["content"].startswith("Error: the tool call could not be parsed")
    assert w.step("m", "It is 5.", []).done
    scored = w.finish("m")
    assert (scored.status, scored.infra_failed) == ("ok", "") and scored.reward > 0
    assert w.start("r", row("r", raise_in="step"), seed=0).status == "ok"
    assert w.step("r", "", [LOOKUP]).status == "error"  # the environment's own code raised: not known as a service's
    out = w.finish("r")
    assert out.infra_failed == "" and (out.reward == want or math.isnan(want) and math.isnan(out.reward))


def test_the_python_tool_with_a_sandbox_that_cannot_start_ends_the_episode_invalid():
    tools = ["reward.envs.python_tool:python"]
    sandbox = {"backend": sandbox_backend(), "wall_s": 2.0}
    call = {"name": "python", "arguments": {"code": "print(1)"}}
    w = EnvWorker(EnvConfig(tools=tools, tool_timeout_s=20.0),
                  RewardConfig(sandbox={**sandbox, "tmp_root": NOWHERE}))
    assert w.start("p", row("p"), seed=0).status == "ok"
    step = w.step("p", "", [call])
    assert step.done and step.status == "error" and step.detail["infra"] == "sandbox_start", step
    out = w.finish("p")
    assert math.isnan(out.reward) and out.infra_failed == "sandbox_start"
    w = EnvWorker(EnvConfig(tools=tools, tool_timeout_s=20.0), RewardConfig(sandbox=sandbox))
    assert w.start("q", row("q"), seed=0).status == "ok"
    crash = w.step("q", "", [{"name": "python", "arguments": {"code": "1 / 0"}}])  # the model's code crashed
    assert not crash.done and crash.tool_errors == {"raised": 1} and "ZeroDivisionError" in crash.messages[0]["content"]
    assert w.step("q", "5", []).done
    out = w.finish("q")
    assert (out.status, out.reward, out.infra_failed) == ("ok", 1.0, "")


class _Session:
    """Stands in for an OpenEnv WebSocket session (the real server: tests/integration/test_openenv.py)."""

    def __init__(self, reset_error: BaseException | None = None, step_error: BaseException | None = None):
        self.reset_error, self.step_error = reset_error, step_error

    def reset(self, **kwargs):
        if self.reset_error is not None:
            raise self.reset_error
        return SimpleNamespace(observation={"text": "guess"}, reward=None, done=False)

    def step(self, action):
        raise self.step_error

    def close(self):
        pass


def _backend(session: _Session):
    action = {"properties": {"number": {"type": "integer"}}, "required": ["number"]}
    cfg = SimpleNamespace(reset_meta_keys=[], prompt="row", observation_key=None, reward="sum")
    return SimpleNamespace(name="env.openenv.app='stub'", cfg=cfg, session=lambda: session,
                           tool=tool_function("guess", None, action))


@pytest.mark.parametrize("error, cause", [(TimeoutError("no answer"), "service_timeout"),
                                          (ConnectionRefusedError("refused"), "server_died"),
                                          (OpenEnvReplyError("CAPACITY_REACHED", "full"), "service_error")])
def test_openenv_server_failures_are_the_services_by_kind(error, cause):
    with pytest.raises(OpenEnvServerError) as err:  # opening the session
        OpenEnvEnvironment(row("o"), 0, _backend(_Session(reset_error=error)))
    assert cause_of(err.value) == cause and "could not be opened and reset" in str(err.value)
    env = OpenEnvEnvironment(row("o"), 0, _backend(_Session(step_error=error)))
    with pytest.raises(OpenEnvServerError) as err:  # a step
        env.step("", [{"name": "guess", "arguments": {"number": 3}}])
    assert cause_of(err.value) == cause


def test_an_openenv_action_the_server_refuses_is_the_models():
    env = OpenEnvEnvironment(row("v"), 0, _backend(_Session(step_error=OpenEnvReplyError("VALIDATION_ERROR", "bad"))))
    result = env.step("", [{"name": "guess", "arguments": {"number": 3}}])
    assert result.tool_errors == {"raised": 1} and not result.done  # back to the model; the episode goes on
