"""In-flight weight updates on the driver's side (``sync.in_flight``), pure bookkeeping: a turn that spans a load
puts each token's version into its episode, the staleness bound goes by the oldest token, the batch's tokens are
counted per version (``rollout/tokens_age_<a>``), and the config refuses the combinations it cannot run."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, load_config
from cluster.driver.collect import Collected
from cluster.driver.episodes import Episode
from cluster.driver.partial_episodes import EpisodeBacklog, EpisodeGroup, oldest_version
from cluster.driver.step_metrics import token_ages
from reward.contracts import RewardResult
from rollout.contracts import PromptRow, SampledTurn
from tests.helpers import REPO_ROOT

AGENT = REPO_ROOT / "configs" / "tiny_agent_calc.yaml"
PARTIAL = ["trainer.partial_rollouts=true", "trainer.max_staleness=1"]


def turn(eid: str, ids: list[int], version: int, versions: list[int] | None = None) -> SampledTurn:
    return SampledTurn(eid, ids, [-0.1 * (i + 1) for i in range(len(ids))], "x", "stop", None, version,
                       token_versions=versions)


def test_a_turn_spanning_a_load_gives_each_token_its_version_and_the_reply_the_last_ones():
    e = Episode("p#0", PromptRow("p", "q", [1, 2], "a"), 0, seed=0, worker=0, prompt_ids=[1, 2])
    e.take_turn(turn("p#0", [5, 6], 3))
    e.add_reply([9])
    e.take_turn(turn("p#0", [7, 8, 9], 3, [3, 4, 4]))
    e.add_reply([9, 9])
    assert e.versions == [3, 3, 3, 3, 4, 4, 4, 4] and e.mask == [1, 1, 0, 1, 1, 1, 0, 0]
    assert e.sampled_versions == [3, 3, 3, 4, 4] and oldest_version(e) == 3
    c = e.completion()
    assert c.weight_version == 3 and c.token_versions == e.versions
    with pytest.raises(ValueError, match="2 token versions for 3 ids"):
        e.add([1, 2, 3], [0.0] * 3, [1, 2])


def test_the_bound_goes_by_a_spanning_turns_oldest_token():
    e = Episode("p#0", PromptRow("p", "q", [1, 2], "a"), 0, seed=0, worker=0, prompt_ids=[1, 2])
    e.take_turn(turn("p#0", [5, 6, 7], 2, [2, 3, 4]))  # open across two loads
    b = EpisodeBacklog(group_size=1, max_staleness=1)
    g = EpisodeGroup(e.row, 0, [e], [RewardResult(score=1.0)])
    b.groups = [g]
    assert b.expire(3) == 0 and b.expire(4) == 1 and b.to_restart == {(0, 0)}  # 4 - 2 > 1
    with pytest.raises(RuntimeError, match="2 versions old"):
        b.take(1, 4)


def test_tokens_per_version_count_sampled_tokens_only():
    c = Collected()
    e = Episode("p#0", PromptRow("p", "q", [1, 2], "a"), 0, seed=0, worker=0, prompt_ids=[1, 2])
    e.take_turn(turn("p#0", [5, 6, 7], 4, [4, 5, 5]))
    e.add_reply([9, 9])
    single = e.completion().__class__("q", 1, [1], [3, 3], [-1.0, -1.0], "", "stop", 5)  # one version, no mask
    c.completions = [e.completion(), single]
    assert token_ages(c, 5) == {"rollout/tokens_age_0": 4.0, "rollout/tokens_age_1": 1.0}
    assert token_ages(Collected(), 5) == {}


def test_in_flight_loads_the_agent_config_with_partial_episodes_and_refuses_the_rest():
    assert load_config(AGENT).sync.in_flight == "off"  # the default drains
    assert load_config(AGENT, ["sync.in_flight=off"]).sync.in_flight == "off"  # YAML's false
    assert load_config(AGENT, [*PARTIAL, "sync.in_flight=keep"]).sync.in_flight == "keep"
    assert load_config(AGENT, [*PARTIAL, "sync.in_flight=recompute", "rollout.return_routed_experts=true",
                               "learner.routing_replay=rollout"]).rollout.return_routed_experts  # R3 too
    for extra, needle in [([], "needs trainer.partial_rollouts=true and env set"),
                          ([*PARTIAL, "rollout.in_process=false"], "needs rollout.in_process=true")]:
        with pytest.raises(ConfigError, match="sync.in_flight='recompute'") as err:
            load_config(AGENT, [*extra, "sync.in_flight=recompute"])
        assert needle in str(err.value)
    with pytest.raises(ConfigError, match="sync.in_flight"):
        load_config(AGENT, ["sync.in_flight=always"])
