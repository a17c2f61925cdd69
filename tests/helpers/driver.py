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


# keys of metrics.jsonl that measure time, not the computation: they differ between two runs of the same config
VOLATILE_METRICS = ("timing/", "throughput/", "perf/", "sync/seconds", "sync/gb_per_s", "sync/engine_load_s",
                    "reward/time_s", "env/time_s", "agent/env_s", "agent/engine_busy_share",
                    "partial/beside_learner_s")


def logged_metrics(run_dir) -> list[dict]:
    """Every line of ``run_dir/metrics.jsonl`` without the ``VOLATILE_METRICS`` keys (what two runs of the same
    config and seed must log bit for bit)."""
    import json

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(VOLATILE_METRICS)} for m in lines]


def metric_differences(a: list[dict], b: list[dict]) -> list[str]:
    """``step key: x != y`` for every logged metric that differs between two runs' ``logged_metrics`` (and a line
    for a different number of steps); empty when they agree bit for bit."""
    out = [f"{len(a)} lines != {len(b)} lines"] if len(a) != len(b) else []
    for ma, mb in zip(a, b):
        out += [f"step {ma.get('step')} {k}: {ma.get(k)!r} != {mb.get(k)!r}" for k in sorted(set(ma) | set(mb))
                if ma.get(k) != mb.get(k)]
    return out
