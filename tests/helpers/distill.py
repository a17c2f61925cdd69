"""A short distillation run's config on the embedded tiny model (tests/integration/test_distill.py,
tests/matrix/test_distill_e2e.py): configs/tiny_moe.yaml, 8 prompts x 4 samples, GSPO-token, a teacher built from
another seed in one small engine."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import REPO_ROOT


def distill_config(tmp_path: Path, *overrides: str):
    """The validated config (run ``distill`` in ``tmp_path``) with ``overrides`` applied last."""
    from cluster.config import load_config

    return load_config(REPO_ROOT / "configs" / "tiny_moe.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=distill", "trainer.eval_every=0", "trainer.plots=false",
        "trainer.prompts_per_step=8", "trainer.group_size=4", "learner.micro_batch_size=8", "data.num_eval=8",
        "wandb.mode=disabled", "learner.algorithm=gspo_token", "distill.model_path=builtin:tiny_moe",
        "distill.build_seed=1", "distill.num_cpus_per_engine=0.25", "distill.kv_cache_gb=0.05",
        "distill.timeout_s=120", *overrides])
