"""In-flight weight updates end to end (``sync.in_flight``) on the real services: the calculator agent's episodes
with a slow tool, partial rollouts beside the learner, the engine loading each new version while turns are open.
Turns that span a sync reach the learner with two versions, nothing is thrown away, no token is older than the
bound and the trained ids are the sampled ones. (Each token's log-prob against the weights of its own version:
tests/integration/test_in_flight.py.)"""

from __future__ import annotations

import pytest

from tests.helpers import REPO_ROOT

OVERRIDES = [
    "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0", "trainer.save_every=0",
    "trainer.plots=false", "learner.micro_batch_size=8", "warm_start.steps=150", "data.num_train=512",
    "data.num_eval=8", "wandb.mode=disabled", "trainer.total_steps=99", "trainer.partial_rollouts=true",
    "trainer.partial_rollout_overlap=true", "trainer.max_staleness=2",
    # slow tools of 0.5-1.5x 0.2 s: turns are open at every sync
    "env.cls=reward.envs.slow_tool:SlowTool", "env.tools=[]", "env.max_turns=4", "rollout.max_model_len=256",
]


def turn_spans(x) -> int:
    """Sampled turns of a completion whose tokens carry more than one version."""
    starts = list(x.turn_starts or [0]) + [len(x.response_token_ids)]
    n = 0
    for a, b in zip(starts, starts[1:]):
        versions = {v for v, m in zip(x.token_versions[a:b], x.response_mask[a:b]) if m}
        n += len(versions) > 1
    return n


@pytest.mark.matrix
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_turns_span_syncs_with_nothing_dropped(tmp_path, mode):
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml",
                      [f"trainer.output_dir={tmp_path}", f"trainer.run_name={mode}", f"sync.in_flight={mode}",
                       *OVERRIDES])
    t = Trainer(cfg)
    t.start()
    spanning = 0
    try:
        t.warm_start()
        for _ in range(4):
            c = t.pending or t.collector.collect(t.step)
            spanning += sum(turn_spans(x) for x in c.completions)
            t.pending = c
            m = t.rl_step()
            assert m["agent/token_mismatch"] == 0.0 and m["rollout/staleness_max"] <= 2.0
            assert m["partial/dropped_tokens"] == 0.0, m
            assert sum(v for k, v in m.items() if k.startswith("rollout/tokens_age_")) > 0
    finally:
        t.shutdown()
    assert spanning > 0, "no trained turn spanned a weight load"
