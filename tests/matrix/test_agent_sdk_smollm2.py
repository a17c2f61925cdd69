"""A real chat model driven by an unmodified agent framework from PyPI: SmolLM2-135M-Instruct (``make
real-model``) behind the session gateway, played by the OpenAI Agents SDK (``reward/envs/sdk_agent.py``, the
Responses API, one function tool), ``configs/smollm2_agent_sdk.yaml`` with smaller sizes, for two GSPO steps.
Skipped, with the reason, when the model folder is absent or the SDK is not installed.

Per step: the learner trains exactly what the engine sampled (``agent/token_mismatch`` 0), the gateway served
requests without a 5xx and no env worker was lost (episodes may end as agent errors: the SDK raises on a turn cut
at ``max_output_tokens``, which the untrained model's rambling often is), and
the engine/learner log-prob gap on the sampled tokens (``actor/train_rollout_logprob_diff``) is finite and small
(fp32 on both sides; docs/real_model.md measured under 1e-5 on this model, the bound here is 1e-3, far below what a
wrong token or a broken sync gives).
"""

from __future__ import annotations

import importlib.util
import math

import pytest

from tests.helpers import REPO_ROOT

MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
pytestmark = [
    pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(),
                       reason=f"{MODEL} absent: `make real-model` converts SmolLM2-135M-Instruct into it"),
    pytest.mark.skipif(importlib.util.find_spec("agents") is None,
                       reason="openai-agents (the OpenAI Agents SDK) is not installed"),
]
OVERRIDES = [
    f"model.path={MODEL}", "trainer.total_steps=2", "trainer.prompts_per_step=2", "trainer.group_size=4",
    "trainer.eval_every=0", "trainer.save_every=0", "trainer.plots=false", "trainer.max_staleness=0",
    "data.num_train=16", "data.num_eval=1", "wandb.mode=disabled",
]
GAP_BOUND = 1e-3


def test_the_agents_sdk_trains_smollm2_on_exactly_the_sampled_tokens(tmp_path):
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cfg = load_config(REPO_ROOT / "configs" / "smollm2_agent_sdk.yaml",
                      [f"trainer.output_dir={tmp_path}", "trainer.run_name=sdk", *OVERRIDES])
    assert cfg.env.agent == "reward.envs.sdk_agent:run" and cfg.env.tool_format == "hermes"
    t = Trainer(cfg)
    t.start()
    try:
        steps = [t.rl_step() for _ in range(2)]
    finally:
        t.shutdown()
    for m in steps:
        print({k: v for k, v in m.items() if k.split("/")[0] in ("agent", "gateway", "reward", "actor", "timing")})
        assert m["agent/token_mismatch"] == 0.0
        assert m["agent/env_worker_restarts"] == 0.0 and m["agent/turns_mean"] >= 1.0
        errors = {k: v for k, v in m.items() if k.startswith("gateway/errors/")}
        assert not [k for k in errors if k.split("/")[-1].startswith("5")], errors
        assert m["gateway/requests"] - sum(errors.values()) >= 1.0, m
        gap = m["actor/train_rollout_logprob_diff"]
        assert math.isfinite(gap) and 0.0 <= gap < GAP_BOUND, gap
        assert m["actor/num_optimizer_steps"] >= 1
