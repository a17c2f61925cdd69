"""Routing Replay R3 on multi-turn episodes, end to end on the real services: the calculator agent's episodes
sampled with routing capture on, trained with ``learner.routing_replay=rollout``: the learner's forwards run the
experts the engine ran for every position of each episode (its turns, and the environment's replies computed in
the next turn's prefill), and its log-probs of the sampled tokens before the update equal the engine's; the
trained ids are the sampled ones. (The engine's experts per position are checked against a transformers forward
in tests/integration/test_rollout_routing.py; in float32 this tiny model's learner routes like the engine even
without replay, so a run without it is no contrast here.)"""

from __future__ import annotations

import pytest

from tests.helpers import REPO_ROOT

OVERRIDES = [
    "trainer.total_steps=1", "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0",
    "trainer.save_every=0", "trainer.plots=false", "learner.micro_batch_size=8", "warm_start.steps=150",
    "data.num_train=512", "data.num_eval=8", "wandb.mode=disabled", "trainer.max_staleness=0",
    "rollout.return_routed_experts=true", "learner.mismatch_monitor_every=1",
]


@pytest.mark.timeout(900)
def test_episodes_replay_the_engines_experts_per_position(tmp_path):
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml",
                      [f"trainer.output_dir={tmp_path}", "trainer.run_name=r3", "learner.routing_replay=rollout",
                       *OVERRIDES])
    t = Trainer(cfg)
    t.start()
    try:
        t.warm_start()
        c = t.collector.collect(t.step)
        multi = [x for x in c.completions if 0 in x.response_mask]
        assert multi, "no episode called the calculator after the warm start"
        for x in c.completions:
            assert x.routed_experts.shape == (len(x.prompt_token_ids) + len(x.response_token_ids) - 1, 2, 2)
            assert (x.routed_experts >= 0).all()  # every position of the episode has the engine's experts
        t.pending = c
        m = t.rl_step()
    finally:
        t.shutdown()
    assert m["agent/token_mismatch"] == 0.0
    assert m["actor/train_rollout_logprob_diff"] < 1e-4, m


@pytest.mark.timeout(900)
def test_partial_episodes_keep_each_turns_experts_across_syncs(tmp_path):
    """With trainer.partial_rollouts an episode's later turns come from newer weights: every position still has
    engine experts (its rows spliced turn by turn, cluster.driver.episodes.spliced_routing), the learner
    trains with them, and the trained ids are the sampled ones."""
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml",
                      [f"trainer.output_dir={tmp_path}", "trainer.run_name=r3p", "learner.routing_replay=rollout",
                       *OVERRIDES, "trainer.total_steps=3", "trainer.partial_rollouts=true", "trainer.max_staleness=1",
                       # slow tools of 0.5-1.5x 0.2 s per group: episodes are under way at every sync
                       "env.cls=reward.envs.slow_tool:SlowTool", "env.tools=[]", "env.max_turns=4",
                       "rollout.max_model_len=256"])
    t = Trainer(cfg)
    t.start()
    spans = []
    try:
        t.warm_start()
        for _ in range(3):
            c = t.collector.collect(t.step)
            for x in c.completions:
                assert x.routed_experts.shape == (len(x.prompt_token_ids) + len(x.response_token_ids) - 1, 2, 2)
                assert (x.routed_experts >= 0).all()
            spans.append(t.collector.stats["partial/multi_version_share"])
            t.pending = c
            m = t.rl_step()
            assert m["agent/token_mismatch"] == 0.0 and m["rollout/staleness_max"] <= 1.0
    finally:
        t.shutdown()
    assert max(spans) > 0.0, spans  # some episodes had turns from two weight versions
