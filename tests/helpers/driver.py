"""Faults injected for real (processes killed by PID, a half-written checkpoint) and exact resume.

Starts the real services (Ray, vLLM, DeepSpeed, reward workers) with a tiny per-step batch.
"""

from __future__ import annotations

from tests.helpers import REPO_ROOT

BASE = [
    "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0", "learner.micro_batch_size=4",
    "warm_start.steps=2", "warm_start.batch_size=8", "data.num_eval=8", "wandb.mode=disabled",
    "trainer.plots=false", "data.num_train=16",  # 2 steps per epoch: the step-2 checkpoint is an epoch boundary
]


def _trainer(out, name, extra):
    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    overrides = [*BASE, f"trainer.output_dir={out}", f"trainer.run_name={name}", *extra]
    return Trainer(load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", overrides))
