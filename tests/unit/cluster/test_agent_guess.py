"""The number-guessing agent task (``data.task: agent_guess``): its rows and demonstrations, played through
``GuessNumber`` in an env worker as the agent loop plays them (the warm start trains on exactly the ids the
loop produces), and the config checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config
from cluster.data.agent_guess import agent_guess_rows, guess_prompt, guess_turns
from cluster.driver.agent_loop import EpisodeRunner
from cluster.driver.episodes import tool_call_dicts
from cluster.driver.warm_start import demonstration
from reward.config import EnvConfig
from reward.env_worker import EnvWorker
from rollout.chat_delta import TurnEnd, reply_ids
from rollout.tool_calls import parse

REPO_ROOT = Path(__file__).resolve().parents[3]
CONFIG = REPO_ROOT / "configs" / "tiny_agent_guess.yaml"


def _consistent(turns: list[list[str]], secret: int, low: int, high: int) -> bool:
    """Every guess lies among the numbers still possible, every reply is right, and the last guess is the secret."""
    lo, hi = low, high
    guesses = [int(text.removeprefix("<call>guess ").removesuffix("</call>")) for role, text in turns[::2]]
    replies = [text for _, text in turns[1::2]]
    if [role for role, _ in turns] != ["assistant", "tool"] * (len(turns) // 2) + ["assistant"]:
        return False
    for g, reply in zip(guesses, replies):
        if not lo <= g <= hi or reply != ("higher" if g < secret else "lower"):
            return False
        lo, hi = (g + 1, hi) if g < secret else (lo, g - 1)
    return lo <= guesses[-1] <= hi and guesses[-1] == secret


def test_demonstrations_scan_or_bisect_consistently_with_the_replies():
    assert guess_turns(3, 1, 9, scan=True) == [
        ["assistant", "<call>guess 1</call>"], ["tool", "higher"], ["assistant", "<call>guess 2</call>"],
        ["tool", "higher"], ["assistant", "<call>guess 3</call>"]]
    assert [t for _, t in guess_turns(7, 1, 9, scan=False)] == [
        "<call>guess 5</call>", "higher", "<call>guess 7</call>"]  # binary search: the lower middle
    for scan, mean_turns, most in ((True, 5.0, 9), (False, 25 / 9, 4)):
        games = [guess_turns(s, 1, 9, scan) for s in range(1, 10)]
        assert all(_consistent(turns, s, 1, 9) for s, turns in zip(range(1, 10), games))
        turns = [(len(t) + 1) // 2 for t in games]
        assert sum(turns) / 9 == pytest.approx(mean_turns) and max(turns) == most
    with pytest.raises(ValueError, match="secret=0 is outside"):
        guess_turns(0, 1, 9, scan=True)


def test_rows_share_one_prompt_and_held_out_secrets_cover_the_range():
    train, held = agent_guess_rows(lambda s: [ord(c) for c in s], high=9, num_train=50, num_eval=20, seed=3,
                                   demo_slip_rate=0.6, guess_bonus=0.1)
    assert {r.prompt for r in train + held} == {guess_prompt(1, 9)} == {"Guess my number in 1..9."}
    assert len({r.uid for r in train + held}) == 70
    assert [r.meta["secret"] for r in held] == [1 + i % 9 for i in range(20)]
    game = {"low": 1, "high": 9, "use_prompt": True, "guess_bonus": 0.1}
    assert all({k: r.meta[k] for k in game} == game for r in train + held)
    assert all("secret" not in r.meta and r.meta["solution_turns"] for r in train)  # the secret: the episode's seed
    assert all("solution_turns" not in r.meta for r in held)
    scans = sum(r.meta["solution_turns"][0][1] == "<call>guess 1</call>" for r in train)  # a scan starts at 1
    assert 20 <= scans <= 40  # demo_slip_rate 0.6 of 50
    with pytest.raises(ValueError, match="data.guess_high=1"):
        agent_guess_rows(lambda s: [1], high=1, num_train=1, num_eval=1, seed=0)


def test_a_demonstration_is_the_episode_the_loop_builds_token_for_token():
    """Play a row's demonstration through GuessNumber in an env worker as ``EpisodeRunner`` does (first ids,
    each turn's sampled ids, the reply rendered in plain mode): the same ids as ``demonstration`` gives for the
    warm start, the environment done at the last call, the number found and the saved guesses rewarded."""
    from cluster.models.tiny_model import build_char_tokenizer

    cfg = load_config(CONFIG)
    tok = build_char_tokenizer()
    train, _ = agent_guess_rows(lambda s: tok(s, add_special_tokens=False)["input_ids"], high=9, num_train=20,
                                num_eval=1, seed=5, demo_slip_rate=0.6, guess_bonus=0.1)
    runner = EpisodeRunner(cfg, fleet=None, pool=None, tokenizer=tok)
    worker = EnvWorker(EnvConfig(cls="reward.envs.guess_number:GuessNumber", max_turns=10))
    for i, r in enumerate(train):
        turns = r.meta["solution_turns"]
        secret = int(turns[-1][1].removeprefix("<call>guess ").removesuffix("</call>"))
        game = {"uid": r.uid, "prompt": r.prompt, "answer": r.answer, "verifier": r.verifier,
                "meta": {**r.meta, "secret": secret}}
        start = worker.start(f"e{i}", game, 0)
        assert runner._first_ids(r, start.messages, start.tool_schemas) == r.prompt_token_ids
        ids, done = [], False
        for role, text in turns[::2]:
            assert role == "assistant" and not done
            ids += tok(text, add_special_tokens=False)["input_ids"]  # what the engine samples, to the stop string
            calls = tool_call_dicts(parse(cfg.env.tool_format, text).calls, start.tool_schemas)
            step = worker.step(f"e{i}", text, calls, [])
            done = step.done
            if not done:
                ids += reply_ids(tok, step.messages, TurnEnd("stop"), chat=False)
        outcome = worker.finish(f"e{i}")
        demo_ids, mask = demonstration(r, tok)
        assert done and demo_ids == ids + [tok.eos_token_id] and len(mask) == len(demo_ids)
        guesses = (len(turns) + 1) // 2
        assert outcome.correct and outcome.reward == pytest.approx(1 + 0.1 * (9 - guesses))


def test_the_shipped_config_and_its_refusals():
    cfg = load_config(CONFIG)
    assert (cfg.data.task, cfg.env.cls, cfg.env.tool_format) == (
        "agent_guess", "reward.envs.guess_number:GuessNumber", "tag")
    assert cfg.env.max_turns >= cfg.data.guess_high  # a consistent player always finds the number
    with pytest.raises(ConfigError, match="agent_guess' needs env.cls"):
        load_config(CONFIG, ["env.cls=null"])
    with pytest.raises(ConfigError, match="agent_guess' needs env.cls"):
        load_config(CONFIG, ["env.cls=null", "env.tools=[reward.envs.calculator:calc]"])
