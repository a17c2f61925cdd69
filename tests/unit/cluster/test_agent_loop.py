"""The agent loop's pure parts: an episode's record and its completion, the tag
format's argument, the calculator task's rows and the warm start's multi-turn demonstrations."""

from __future__ import annotations

import pytest
import torch

from cluster.data.agent_calc import agent_calc_rows, calc_turns
from cluster.driver.episodes import Episode, _named_argument, episode_metrics, tool_call_dicts
from cluster.driver.batching import build_sft_batch, build_train_batch
from cluster.driver.warm_start import demonstration
from rollout.contracts import PromptRow

CALC_SCHEMA = {"type": "function", "function": {"name": "calc", "description": "d", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _episode() -> Episode:
    e = Episode("p#1", PromptRow("p", "1+2=", [5, 6], "3"), 1, seed=7, worker=0, prompt_ids=[5, 6])
    e.add([7, 8], [-0.5, -0.25], version=3)  # turn 1, sampled at version 3
    e.add([20, 21], None, version=3)  # the environment's reply
    e.add([9], [-0.125], version=4)  # turn 2, after a weight sync
    return e


def test_an_episode_becomes_a_masked_completion_with_each_tokens_version():
    c = _episode().completion()
    assert c.prompt_token_ids == [5, 6] and c.response_token_ids == [7, 8, 20, 21, 9]
    assert c.response_mask == [1, 1, 0, 0, 1] and c.response_logprobs == [-0.5, -0.25, 0.0, 0.0, -0.125]
    assert c.token_versions == [3, 3, 3, 3, 4] and c.weight_version == 3  # the oldest sampled token's
    assert (c.prompt_uid, c.sample_index, c.sampled_tokens) == ("p", 1, 3)


def test_the_tag_formats_argument_takes_the_tools_parameter_name():
    assert _named_argument({"input": "1+2"}, "calc", [CALC_SCHEMA]) == {"expression": "1+2"}
    assert _named_argument({"input": "1+2"}, "other", [CALC_SCHEMA]) == {"input": "1+2"}  # unknown: as it is
    assert _named_argument({"expression": "1"}, "calc", [CALC_SCHEMA]) == {"expression": "1"}


def test_parsed_calls_become_the_env_workers_call_dicts_in_order():
    from rollout.tool_calls import parse

    calls = parse("tag", "<call>calc 1+2</call> then <call>other x</call>").calls
    assert tool_call_dicts(calls, [CALC_SCHEMA]) == [{"name": "calc", "arguments": {"expression": "1+2"}},
                                                     {"name": "other", "arguments": {"input": "x"}}]
    assert tool_call_dicts([], [CALC_SCHEMA]) == []


def test_episode_metrics():
    a, b = _episode(), _episode()
    a.turns, a.tool_calls, a.status, a.env_s = 2, 1, "ok", 0.5
    b.turns, b.status, b.env_s = 3, "max_turns", 0.25
    b.tool_errors.update({"parse": 2})
    m = episode_metrics([a, b], busy_share=0.75)
    assert m["agent/turns_mean"] == 2.5 and m["agent/turns_max"] == 3.0 and m["agent/tool_calls_mean"] == 0.5
    assert m["agent/cut_turns"] == 1.0 and m["agent/cut_tokens"] == 0.0 and m["agent/env_failed"] == 0.0
    assert m["agent/tool_errors/parse"] == 2.0 and m["agent/env_s"] == 0.75 and m["agent/engine_busy_share"] == 0.75


def test_calc_rows_are_disjoint_and_the_slip_leaves_out_the_last_addend():
    train, held = agent_calc_rows(lambda s: [ord(ch) for ch in s], num_terms=4, num_train=200, num_eval=50, seed=1,
                                  demo_slip_rate=0.5)
    assert len(train) == 200 and len(held) == 50 and not {r.uid for r in train} & {r.uid for r in held}
    r = train[0]
    terms = [int(t) for t in r.prompt[:-1].split("+")]
    assert len(terms) == 4 and all(10 <= t <= 99 for t in terms) and r.answer == str(sum(terms))
    assert calc_turns([12, 34, 56]) == [["assistant", "<call>calc 12+34+56</call>"], ["tool", "102"],
                                        ["assistant", "102"]]
    assert calc_turns([12, 34, 56], slip=True)[2] == ["assistant", "46"]
    slips = sum(row.meta["solution_turns"][2][1] != row.answer for row in train)
    assert 70 <= slips <= 130 and all("solution_turns" not in row.meta for row in held)
    with pytest.raises(ValueError, match="data.num_terms=1"):
        agent_calc_rows(lambda s: [1], num_terms=1, num_train=1, num_eval=1, seed=0)


def test_a_multi_turn_demonstration_trains_on_the_assistant_turns_only():
    from cluster.models.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer()
    row = PromptRow("t", "12+34+56=", tok("12+34+56=")["input_ids"], "102",
                    meta={"solution_turns": calc_turns([12, 34, 56])})
    ids, mask = demonstration(row, tok)
    assert tok.decode(ids, skip_special_tokens=False) == "<call>calc 12+34+56</call><result>102</result>102<eos>"
    call, reply = len("<call>calc 12+34+56</call>"), len("<result>102</result>")
    assert mask == [1] * call + [0] * reply + [1] * 4  # "102" and EOS
    batch = build_sft_batch([row.prompt_token_ids], [ids], pad_token_id=0, response_masks=[mask])
    assert int(batch.loss_mask.sum()) == call + 4


def test_the_progress_line_shows_turns_per_episode_for_episodes_only():
    from cluster.driver.tracking import progress_line

    single = {"reward/mean": 0.5, "reward/accuracy": 0.25, "actor/clip_fraction": 0.0, "timing/step_s": 2.0}
    assert "turns" not in progress_line(single)
    assert progress_line({**single, "agent/turns_mean": 2.25}).startswith("reward 0.500 | acc 0.250 | turns 2.25 |")


def test_a_template_that_drops_earlier_turns_is_refused_before_any_service_starts():
    from cluster.config import ConfigError
    from cluster.driver.episodes import check_template
    from cluster.models.tiny_model import build_char_tokenizer
    from tests.helpers.chat_tokenizers import REASONING_STRIPPING_TEMPLATE, build_bpe_tokenizer

    check_template(build_bpe_tokenizer())  # ChatML with tools: prefix-stable
    check_template(build_char_tokenizer())  # no template: plain replies
    with pytest.raises(ConfigError, match="cannot continue an episode on its sampled ids"):
        check_template(build_bpe_tokenizer(REASONING_STRIPPING_TEMPLATE, name="stripping"))


def test_per_turn_rewards_are_recorded_at_each_turns_start_and_reach_the_advantages():
    """The loop records where each sampled turn starts and the environment's per-turn reward after it; the
    completion carries them, and gspo_token's advantages become per token from them (hand-computed)."""
    from types import SimpleNamespace

    from cluster.driver.agent_loop import EpisodeRunner
    from cluster.driver.batching import rollout_advantages
    from reward.env_worker import EnvStep
    from rollout.chat_delta import TurnEnd

    runner = EpisodeRunner.__new__(EpisodeRunner)
    runner.cfg = SimpleNamespace(rollout=SimpleNamespace(max_model_len=64))
    runner.chat, runner.tokenizer = False, lambda text, **_: {"input_ids": [30 + len(text) % 7, 31]}

    def episode(turn_reward: float | None, final_reward: float | None) -> Episode:
        e = Episode("p#0", PromptRow("p", "1+2=", [5, 6], "3"), 0, seed=7, worker=0, prompt_ids=[5, 6])
        for ids, step in (([7, 8], EnvStep([{"role": "tool", "content": "3"}], False, reward=turn_reward)),
                          ([9], EnvStep([], True, reward=final_reward))):
            e.turn_starts.append(len(e.response_ids))
            e.turn_rewards.append(0.0)
            e.add(ids, [-0.5] * len(ids), version=1)
            e.turn_end = TurnEnd.from_sampling("stop", None, ids[-1])
            runner._on_step(e, step)
        return e

    a, b = episode(-0.5, None), episode(None, None)
    ca, cb = a.completion(), b.completion()
    assert ca.turn_starts == [0, 4] and ca.turn_rewards == [-0.5, 0.0] and ca.response_mask == [1, 1, 0, 0, 1]
    assert cb.turn_rewards == [0.0, 0.0]
    rewards = torch.tensor([1.0, 1.0])  # equal episode rewards: only the per-turn reward separates them
    adv = rollout_advantages([ca, cb], rewards, 2, algorithm="gspo_token", normalize_std=False)
    # returns G_1 = (0.5, 1.0), mean 0.75: a's turn 1 (G = 0.5) gets -0.25, its turn 2 (G = 1.0) +0.25; b: 0.25
    assert adv.per_turn and adv.advantages.tolist() == [[-0.25] * 4 + [0.25], [0.25] * 5]
    seq = rollout_advantages([ca, cb], rewards, 2, algorithm="gspo", normalize_std=False)
    assert not seq.per_turn and seq.advantages.tolist() == [-0.25, 0.25] and seq.returns.tolist() == [0.5, 1.0]


def test_episodes_take_routing_capture_and_partial_rollouts_turn_by_turn_at_config_load():
    from cluster.config import load_config
    from tests.helpers import REPO_ROOT

    path = REPO_ROOT / "configs" / "tiny_agent_calc.yaml"
    assert load_config(path, ["rollout.return_routed_experts=true"]).rollout.return_routed_experts
    assert load_config(path, ["trainer.partial_rollouts=true", "trainer.max_staleness=1"]).trainer.partial_rollouts
    with pytest.raises(ValueError, match="trainer.partial_segment_tokens=4 is refused with env set"):
        load_config(path, ["trainer.partial_rollouts=true", "trainer.max_staleness=1",
                           "trainer.partial_segment_tokens=4"])


def test_length_metrics_of_episodes_count_sampled_tokens_over_the_episodes_range():
    from cluster.config import load_config
    from cluster.driver.collect import Collected
    from cluster.driver.step_metrics import response_token_limit, rollout_metrics
    from reward.contracts import RewardResult
    from tests.helpers import REPO_ROOT

    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml",
                      ["trainer.length_buckets=4", "trainer.group_size=2", "learner.micro_batch_size=8"])
    assert response_token_limit(cfg) == 96  # 3 turns of 32 tokens, within max_model_len 96
    c = Collected(completions=[_episode().completion()] * 2, results=[RewardResult(score=1.0, correct=True)] * 2)
    m = rollout_metrics(cfg, c, torch.ones(2))
    assert m["response/length_mean"] == 3.0  # 3 sampled tokens; the 2 reply tokens are not the model's
