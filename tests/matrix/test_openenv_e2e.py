"""An OpenEnv environment end to end (``configs/tiny_openenv_guess.yaml``): the driver checks the server before
any service starts, the env worker serves the example game (``reward.envs.openenv_guess``) itself, the warm
start teaches the call format, GSPO steps train on episodes played over WebSocket sessions (exact ids, no failed
episode), and the server is gone once the run has shut down."""

from __future__ import annotations

import os
import time

from tests.helpers import REPO_ROOT

OVERRIDES = [
    "trainer.total_steps=2", "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0",
    "trainer.save_every=0", "trainer.plots=false", "learner.micro_batch_size=8", "warm_start.steps=150",
    "data.num_train=512", "wandb.mode=disabled", "trainer.max_staleness=0",
]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_run_trains_on_an_openenv_server_it_starts_and_stops(tmp_path):
    import ray

    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cfg = load_config(REPO_ROOT / "configs" / "tiny_openenv_guess.yaml",
                      [f"trainer.output_dir={tmp_path}", "trainer.run_name=openenv", *OVERRIDES])
    t = Trainer(cfg)
    t.start()
    try:
        server = ray.get(t.episodes.pool.workers[0].openenv_server_pid.remote())
        assert server is not None and _alive(server)
        t.warm_start()
        c = t.collector.collect(t.step)
        assert len(c.completions) == 32 and c.reward_metrics["agent/env_failed"] == 0.0
        assert c.reward_metrics["agent/turns_mean"] > 1.0
        text = t.tokenizer.decode(next(x for x in c.completions if 0 in x.response_mask).response_token_ids)
        assert "<call>guess " in text and "<result>" in text and any(
            w in text for w in ("higher", "lower")), text
        assert any(r.score >= 1.0 for r in c.results)  # some episode found its number (the server's reward)
        t.pending = c
        m = t.rl_step()
        assert m["agent/token_mismatch"] == 0.0 and m["actor/num_optimizer_steps"] >= 1
        m2 = t.rl_step()
        assert m2["agent/token_mismatch"] == 0.0 and m2["agent/env_failed"] == 0.0 and m2["step"] == 2
    finally:
        t.shutdown()
    deadline = time.monotonic() + 30
    while _alive(server) and time.monotonic() < deadline:  # its worker is gone: the server follows within a second
        time.sleep(0.2)
    assert not _alive(server)
