"""Multi-turn, tool-using episodes end to end on the real services (Ray, vLLM, DeepSpeed, an env worker): the
calculator task's warm start on demonstrations with the environment's replies masked, then GSPO steps on the
episodes the engine samples, the held-out evaluation through greedy episodes."""

from __future__ import annotations

import pytest

from tests.helpers import REPO_ROOT

OVERRIDES = [
    "trainer.total_steps=2", "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0",
    "trainer.save_every=0", "trainer.plots=false", "learner.micro_batch_size=8", "warm_start.steps=150",
    "data.num_train=512", "data.num_eval=8", "wandb.mode=disabled", "trainer.max_staleness=0",
]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    out = tmp_path_factory.mktemp("agent")
    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml",
                      [f"trainer.output_dir={out}", "trainer.run_name=agent", *OVERRIDES])
    t = Trainer(cfg)
    t.start()
    try:
        yield t
    finally:
        t.shutdown()


def test_episodes_train_on_exactly_the_sampled_ids(trainer):
    t = trainer
    t.warm_start()
    c = t.collector.collect(t.step)
    assert len(c.completions) == 32 and len(c.results) == 32
    for comp, r in zip(c.completions, c.results):
        assert len(comp.response_mask) == len(comp.response_token_ids) == len(comp.response_logprobs)
        assert r.detail["episode_id"].startswith(f"{comp.prompt_uid}#{comp.sample_index}@")
        assert comp.sampled_tokens == len(c.sampled[r.detail["episode_id"]])
    with_reply = [x for x in c.completions if 0 in x.response_mask]  # the warm start taught the call
    assert with_reply, "no episode called the calculator after the warm start"
    text = t.tokenizer.decode(with_reply[0].response_token_ids)
    assert "<call>calc " in text and "<result>" in text
    assert c.reward_metrics["agent/turns_mean"] > 1.0 and c.reward_metrics["agent/env_failed"] == 0.0
    for x, r in zip(c.completions, c.results):  # a reply is always followed by a turn, unless cut for room
        assert x.response_mask[-1] == 1 or r.detail["episode"] == "cut_tokens", (x, r)
    t.pending = c
    m = t.rl_step()
    assert m["agent/token_mismatch"] == 0.0 and m["agent/token_turns"] >= 32 * m["agent/turns_mean"] - 1e-9
    assert m["env/turns"] > 0 and m["env/episodes"] == 32.0  # the env workers' own counters, forwarded
    assert m["actor/num_optimizer_steps"] >= 1 and m["reward/invalid"] == 0.0
    assert 0.0 < m["agent/engine_busy_share"] <= 1.0
    m2 = t.rl_step()
    assert m2["agent/token_mismatch"] == 0.0 and m2["step"] == 2


def test_an_openai_program_behind_the_gateway_plays_the_same_episodes(trainer):
    """The calculator agent written as a plain ``openai`` program (reward/envs/calc_agent.py, env.agent) through
    the session gateway, on the same engine, weights, rows and seed as the env.tools episodes: the same ids,
    masks, versions and rewards; every request continued its session (no fork)."""
    import ray

    from cluster.config import load_config
    from cluster.driver.env_pool import EnvPool
    from cluster.driver.gateway_episodes import start_gateway_runner
    from cluster.runtime.services import RewardGroups

    t = trainer
    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_openai.yaml",
                      [f"trainer.output_dir={t.cfg.trainer.output_dir}", "trainer.run_name=agent", *OVERRIDES])
    groups = RewardGroups(cfg.env.num_cpus_per_worker, cfg.env.node_resources, cfg.cluster.placement_timeout_s)
    runner, gateway = start_gateway_runner(cfg, t.fleet, EnvPool(cfg, groups), t.tokenizer)
    try:
        rows = t.train_rows[:4]
        want, want_scored, _, want_sampled = t.episodes.run(rows, 4, seed=11)
        got, scored, metrics, sampled = runner.run(rows, 4, seed=11)
    finally:
        runner.pool.shutdown()
        groups.remove_all()
        ray.get(gateway.stop.remote(), timeout=30)
    assert [c.response_token_ids for c in got] == [c.response_token_ids for c in want]
    assert [c.response_mask for c in got] == [c.response_mask for c in want]
    assert [c.token_versions for c in got] == [c.token_versions for c in want]
    assert [r.score for r in scored] == [r.score for r in want_scored]
    assert sorted(map(len, sampled.values())) == sorted(map(len, want_sampled.values()))
    assert metrics["agent/forks"] == 0.0 and metrics["gateway/requests"] >= 16.0
    errors = {k: v for k, v in metrics.items() if k.startswith("gateway/errors")}
    assert metrics["agent/env_failed"] == 0.0 and set(errors) <= {"gateway/errors/400"}, errors  # 400: no room


def test_a_separate_harness_program_takes_the_same_episodes_over_rest(trainer):
    """env.gateway.harness: the driver starts reward/envs/calc_harness.py, which claims each episode with POST
    /sessions and the run key, plays it (the calculator loop of calc_agent.py) and closes it with its own reward:
    the same ids as the env.tools episodes; every episode claimed once, each group G episodes."""
    from cluster.config import load_config
    from cluster.driver.env_pool import EnvPool
    from cluster.driver.gateway_episodes import start_gateway_runner
    from cluster.runtime.services import RewardGroups

    t = trainer
    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_openai.yaml",
                      [f"trainer.output_dir={t.cfg.trainer.output_dir}", "trainer.run_name=agent", *OVERRIDES,
                       "env.agent=null", "env.gateway.harness=python -m reward.envs.calc_harness --parallel 8"])
    groups = RewardGroups(cfg.env.num_cpus_per_worker, cfg.env.node_resources, cfg.cluster.placement_timeout_s)
    runner, _ = start_gateway_runner(cfg, t.fleet, EnvPool(cfg, groups), t.tokenizer)
    try:
        rows = t.train_rows[:4]
        want, _, _, _ = t.episodes.run(rows, 4, seed=11)
        got, scored, metrics, _ = runner.run(rows, 4, seed=11)
    finally:
        runner.pool.shutdown()
        groups.remove_all()
        runner.stop_gateway()
    assert runner.harness.poll() is not None  # ended with the run
    assert [c.response_token_ids for c in got] == [c.response_token_ids for c in want]
    assert metrics["gateway/claims"] == 16.0 and [r.status for r in scored] == ["ok"] * 16
    assert {r.score for r in scored} <= {0.0, 1.0} and [c.prompt_uid for c in got] == [r.uid for r in rows for _ in range(4)]


def test_a_rerendered_history_fails_the_token_check(trainer):
    """env.debug_rerender: later turns are sampled on the history decoded and tokenized again (a newline between
    its pieces), the episodes train on their own ids: the engines' records and the trained turns disagree on every
    such turn, from both sides (its record never trained, its trained turn never sampled)."""
    t = trainer
    t.episodes.rerender, t.episodes.rerendered = True, 0
    try:
        m = t.rl_step()
    finally:
        t.episodes.rerender = False
    assert t.episodes.rerendered > 0 and m["agent/token_checked"] == 1.0
    assert m["agent/token_unsampled"] == m["agent/token_untrained"] == float(t.episodes.rerendered)
    assert m["agent/token_mismatch"] == 2.0 * t.episodes.rerendered and m["agent/token_records_lost"] == 0.0
    assert t.rl_step()["agent/token_mismatch"] == 0.0  # off again: 0


def test_held_out_accuracy_comes_from_greedy_episodes(trainer):
    out = trainer.evaluate()
    assert out["eval/num_prompts"] == 8.0 and 0.0 <= out["eval/accuracy"] <= 1.0
    assert out["eval/turns_mean"] >= 1.0 and "eval/tool_calls_mean" in out


def test_an_env_worker_that_dies_ends_its_episodes_not_the_run(trainer):
    import os
    import signal

    import ray

    t = trainer
    os.kill(ray.get(t.episodes.pool.workers[0].pid.remote()), signal.SIGKILL)
    c = t.collector.collect(t.step)  # the worker's episodes end with status error, invalid (worker_lost); replaced
    assert c.reward_metrics["agent/env_worker_restarts"] == 1.0 and c.reward_metrics["agent/env_failed"] == 32.0
    assert all(r.score != r.score and r.status == "error" and r.infra_failed == "worker_lost" for r in c.results)
    again = t.collector.collect(t.step)  # the new worker plays the next round
    assert again.reward_metrics["agent/env_failed"] == 0.0 and again.reward_metrics["agent/turns_mean"] > 1.0


def test_env_workers_scale_through_control_yaml_and_are_replaced_when_holding_abandoned_threads(trainer):
    import ray

    from cluster.driver.scaling import apply_control

    t = trainer
    pool = t.episodes.pool
    (t.run_dir / "control.yaml").write_text("env.num_workers: 2\n")
    apply_control(t.run_dir, t.fleet, t.rewards, pool)
    assert len(pool) == 2 and len(set(ray.get([w.pid.remote() for w in pool.workers]))) == 2
    c = t.collector.collect(t.step)  # the episodes spread over both workers
    assert c.reward_metrics["agent/env_failed"] == 0.0 and c.reward_metrics["agent/env_worker_restarts"] == 0.0
    (t.run_dir / "control.yaml").write_text("env.num_workers: 1\n")
    apply_control(t.run_dir, t.fleet, t.rewards, pool)
    assert len(pool) == 1
    # a worker holding more abandoned threads than allowed is replaced after the round (limit -1: any worker)
    pid = ray.get(pool.workers[0].pid.remote())
    pool.cfg = pool.cfg.model_copy(update={"env": pool.cfg.env.model_copy(update={"max_abandoned_threads": -1})})
    c = t.collector.collect(t.step)
    assert c.reward_metrics["agent/env_worker_restarts"] == 1.0 and c.reward_metrics["agent/env_failed"] == 0.0
    assert ray.get(pool.workers[0].pid.remote()) != pid
    (t.run_dir / "control.yaml").unlink()
    pool.cfg = t.cfg


def test_partial_episodes_span_weight_syncs_with_exact_ids_and_lose_no_prompt(trainer):
    """trainer.partial_rollouts with env: a step trains the first P groups whose episodes all ended; the rest go
    on after the sync under the new weights (the engines hold no open turn at the sync, or it would refuse), the
    trained ids are the sampled ones and no token is older than the bound; a rollback's restarts and a
    checkpoint's round trip lose no prompt and train none twice, and leave no environment open that no episode
    owns. (Episodes with turns of two versions: tests/matrix/test_agent_r3.py, with slow tools.)"""
    import pickle

    import ray

    from cluster.config import load_config
    from cluster.data.prompts import PromptStream
    from cluster.driver.partial_episodes import PartialEpisodeCollector

    t = trainer
    if not t.state.warm_start_done:
        t.warm_start()
    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml",
                      [f"trainer.output_dir={t.run_dir.parent}", "trainer.run_name=agent", *OVERRIDES,
                       "trainer.partial_rollouts=true", "trainer.max_staleness=1", "trainer.total_steps=99"])
    old_cfg, old_collector = t.cfg, t.collector
    col = PartialEpisodeCollector(cfg, t.stream, t.episodes, lambda: t.weight_version)
    t.cfg, t.collector = cfg, col
    start, trained, metrics = t.stream.position, [], []

    def open_envs() -> set[str]:
        return {i for w in t.episodes.pool.workers for i in ray.get(w.open_episodes.remote())}

    def owned() -> set[str]:
        return {e.episode_id for g in col.buffer.groups for e, v in zip(g.episodes, g.verdicts) if v is None}

    try:
        for k in range(4):
            if k == 1:  # as after a health-guard rollback: every episode with tokens starts again (step 1
                marked = col.buffer.restart_all()  # sampled 2P groups and trained P: the others have tokens)
                assert marked > 0
            m = t.rl_step()
            metrics.append(m)
            trained += t.trained_uids[-1]
            assert m["agent/token_mismatch"] == 0.0 and m["rollout/staleness_max"] <= 1.0
            assert m["partial/in_flight_groups"] > 0 and len(t.trained_uids[-1]) == 8
            assert open_envs() <= owned()  # every open environment belongs to an episode under way
        assert metrics[1]["partial/restarted_episodes"] >= marked
        # a checkpoint: scored episodes kept whole, the others marked to start again; nothing lost or repeated
        saved = pickle.loads(pickle.dumps(col.buffer))
        assert {(g.serial, e.sample_index) for g in saved.groups for e, v in zip(g.episodes, g.verdicts)
                if v is None} <= saved.to_restart
        ray.get([w.close.remote() for w in t.episodes.pool.workers])  # a resumed run's workers are new
        col.buffer = saved
        m = t.rl_step()
        trained += t.trained_uids[-1]
        assert m["agent/token_mismatch"] == 0.0 and m["partial/restarted_episodes"] >= 1
        replay = PromptStream(t.train_rows, seed=cfg.trainer.seed, position=start)
        admitted = [r.uid for r in replay.take(t.stream.position - start)]
        in_flight = [g.row.uid for g in col.buffer.groups]
        assert sorted(trained + in_flight) == sorted(admitted)  # none lost, none trained twice
    finally:
        t.cfg, t.collector = old_cfg, old_collector
