"""The offline ratio audit (learner/audit.py) and the audit dump (cluster/driver/audit_dump.py).

Fast tests: the audit's own math against hand-computed values and against the training code
(learner.objectives, imported here only as the thing being cross-checked), and the whole audit on a synthetic
step folder with planted defects. Slow test: a real short run saves step 1, the audit is clean, and a planted
one-token mask shift makes it fail naming the check; a short agent run (multi-turn episodes) audits clean.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from learner import audit
from tests.helpers import REPO_ROOT


def _run(cfg):
    """Train ``cfg`` (its warm start, step 0's evaluation, its steps) on the real services; returns its run folder."""
    from cluster.driver.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.start()
        trainer.run()
    finally:
        trainer.shutdown()
        import ray

        ray.shutdown()
    return trainer.run_dir


@pytest.mark.parametrize("algorithm", ["gspo", pytest.param("dr_grpo", marks=pytest.mark.matrix)])
def test_real_run_audits_clean_and_catches_mask_shift(tmp_path, algorithm):
    """gspo in the suite; Dr. GRPO (GRPO's token loss over a constant length) in ``make test-matrix``."""
    from safetensors.torch import load_file, save_file

    from cluster.config import load_config

    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=audit", "trainer.total_steps=1",
        "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0", "trainer.save_every=0",
        "trainer.plots=false", "trainer.audit_steps=[1]", "learner.micro_batch_size=2", "learner.num_minibatches=2",
        f"learner.algorithm={algorithm}",
        "warm_start.steps=2", "warm_start.batch_size=16", "data.num_eval=8", "wandb.mode=disabled",
        # After 2 warm-start steps no sum is right; a format term (a digit anywhere) makes rewards differ within
        # groups, so advantages and the first minibatch's gradient are not all zero.
        "reward.extra_terms=[{verifier: format, weight: 1.0}]", 'reward.format_regex="[0-9]"',
    ])
    run_dir = _run(cfg)
    step_dir = run_dir / "audit" / "step_00000001"
    for name in ("batch.safetensors", "split.json", "meta.json", "metrics.json", "model/model.safetensors",
                 "model/config.json", audit.GRADIENT_FILE):
        assert (step_dir / name).is_file(), name
    split = json.loads((step_dir / "split.json").read_text())["minibatches"]
    assert len(split) == 2 and all(len(mb["ranks"]) == 2 and len(mb["ranks"][0]) == 8 for mb in split)
    first_rows = [i for r in split[0]["ranks"] for i in r]
    assert load_file(str(step_dir / "batch.safetensors"))["advantages"][first_rows].abs().sum() > 0

    cmd = [sys.executable, "-m", "learner.audit", str(run_dir), "--step", "1", "--json", str(tmp_path / "clean.json")]
    clean = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    report = json.loads((tmp_path / "clean.json").read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    for name in ("mask_alignment", "behaviour_log_probs", "learner_log_probs", "sequence_log_ratio", "normalisers",
                 "minibatch_split", "entropy", "logprob_diff_metric", "gradient_first_minibatch"):
        assert status[name] == "ok", (name, clean.stdout)
    grad = next(c for c in report["checks"] if c["name"] == "gradient_first_minibatch")
    assert grad["values"]["training_grad_norm"] > 0, grad  # the check compared a real gradient

    # Plant a one-token shift of one row's response mask (one position earlier: the last prompt token counts,
    # the last response token does not) in the saved data.
    tensors = load_file(str(step_dir / "batch.safetensors"))
    mask = tensors["response_mask"]
    row = int(torch.nonzero(mask.any(-1))[0])
    cols = torch.nonzero(mask[row]).flatten()
    first, last = int(cols[0]), int(cols[-1])
    assert first >= 1
    mask[row, first - 1], mask[row, last] = True, False
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(step_dir / "batch.safetensors"))
    bad = subprocess.run(cmd[:-1] + [str(tmp_path / "bad.json")], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=600)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    failed = json.loads((tmp_path / "bad.json").read_text())["failed"]
    assert "mask_alignment" in failed and "behaviour_log_probs" in failed, bad.stdout
    assert "audit FAILED" in bad.stdout and "mask_alignment" in bad.stdout


def test_agent_run_audits_clean(tmp_path):
    """Multi-turn episodes (configs/tiny_agent_calc.yaml, docs/agents.md): the saved step holds the engines'
    sampled-token masks, with environment tokens in them, and the audit, whose mask then keeps the sampled tokens
    only, is clean."""
    from safetensors.torch import load_file

    from cluster.config import load_config

    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=audit_agent", "trainer.total_steps=1",
        "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0", "trainer.save_every=0",
        "trainer.plots=false", "trainer.max_staleness=0", "trainer.audit_steps=[1]", "learner.num_minibatches=2",
        "learner.micro_batch_size=8",
        "warm_start.steps=150", "data.num_train=512", "data.num_eval=8", "wandb.mode=disabled",
    ])
    run_dir = _run(cfg)
    tensors = load_file(str(run_dir / "audit" / "step_00000001" / "batch.safetensors"))
    episodes = tensors[audit.EPISODE_MASK_KEY]
    assert episodes.shape[0] == 32 and bool((episodes == 0).any()), "no environment token in the step's episodes"
    # the trained mask holds the sampled tokens only: fewer than the responses' tokens
    response_tokens = int((tensors["attention_mask"].sum(-1) - tensors["prompt_lengths"]).sum())
    assert int(tensors["response_mask"].sum()) == int((episodes == 1).sum()) < response_tokens

    cmd = [sys.executable, "-m", "learner.audit", str(run_dir), "--step", "1", "--json", str(tmp_path / "a.json")]
    clean = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    status = {c["name"]: c["status"] for c in json.loads((tmp_path / "a.json").read_text())["checks"]}
    for name in ("mask_alignment", "length_normalisation", "episode_mask_length", "prompt_tokens",
                 "behaviour_log_probs", "learner_log_probs", "sequence_log_ratio", "normalisers",
                 "gradient_first_minibatch"):
        assert status[name] == "ok", (name, clean.stdout)
