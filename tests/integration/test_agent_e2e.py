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
    assert m["agent/token_mismatch"] == 0.0
    assert m["actor/num_optimizer_steps"] >= 1 and m["reward/invalid"] == 0.0
    assert 0.0 < m["agent/engine_busy_share"] <= 1.0
    m2 = t.rl_step()
    assert m2["agent/token_mismatch"] == 0.0 and m2["step"] == 2


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
    c = t.collector.collect(t.step)  # the worker's episodes end with status error, scored 0; it is replaced
    assert c.reward_metrics["agent/env_worker_restarts"] == 1.0 and c.reward_metrics["agent/env_failed"] == 32.0
    assert all(r.score == 0.0 and r.status == "error" for r in c.results)
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
