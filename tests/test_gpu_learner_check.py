"""``cluster.gpu_learner_check`` at toy size on the CPU (gloo, DeepSpeed's CPU accelerator): the learner starts
as a ZeRO-3 GPU run starts it (partitioned build, bfloat16, with and without the optimizer offloaded to DeepSpeed's
CPU Adam), runs GSPO optimizer steps on synthetic rollouts and prints one JSON line whose checks all pass; without
a CUDA device and without ``--cpu`` it refuses, saying so. Also: the check imports neither Ray nor vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


@pytest.mark.slow
def test_toy_learner_check_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.gpu_learner_check", "--size", "toy", "--cpu", "--steps", "2",
                           "--json-out", str(out), "--workdir", str(tmp_path)], cwd=REPO_ROOT, env=_env(),
                          capture_output=True, text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(lines[0])
    assert report == json.loads(out.read_text())
    assert report["device"] == "cpu" and report["ok"] is True and set(report["variants"]) == {"none", "cpu"}
    for name, v in report["variants"].items():
        assert all(v["checks"].values()) and len(v["checks"]) == 7, (name, v["checks"])
        assert v["devices"]["partitioned_build"] and v["devices"]["backend"] == "gloo"
        assert v["optimizer_steps"] == 2 and len(v["seconds_per_step"]) == 2 and v["weights_moved"]
    # the same synthetic rollouts and seeds: CPU Adam and torch's AdamW see the same first gradient
    assert report["variants"]["none"]["grad_norms"][0] == pytest.approx(report["variants"]["cpu"]["grad_norms"][0],
                                                                        rel=1e-5)


def test_refuses_without_cuda():
    proc = subprocess.run([sys.executable, "-m", "cluster.gpu_learner_check"], cwd=REPO_ROOT,
                          env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr


def test_the_check_imports_neither_ray_nor_vllm():
    """What a bare GPU machine has: the learner service, the step, the objectives, the plan and the tiny-model
    builder import with Ray, vLLM, datasets and wandb absent."""
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('ray', 'vllm', 'datasets', 'wandb', 'math_verify'):
            raise ImportError('absent: ' + name)
sys.meta_path.insert(0, Block())
import cluster.gpu_learner_check as c, learner.service, learner.step, cluster.plan, cluster.tiny_model
c.check_config('1b', 'cpu', True)
print('imports ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "imports ok" in proc.stdout, proc.stderr[-2000:]


def test_the_1b_check_matches_the_plan_settings():
    """The check's learner settings are the ones its plan figure is computed for: ZeRO-3, bfloat16, one GPU."""
    from cluster.gpu_learner_check import check_config, plan_figures

    cfg = check_config("1b", "cpu", True)
    lc = cfg.learner
    assert (lc.zero_stage, lc.dtype, lc.num_gpus_per_rank, lc.world_size, lc.offload_optimizer) == (3, "bfloat16", 1, 1,
                                                                                                     "cpu")
    figures = plan_figures(cfg, 140.0)
    assert 0.9 < figures["num_params_b"] < 1.2
    assert figures["learner_gpu_gib"] < plan_figures(check_config("1b", "none", True), 140.0)["learner_gpu_gib"]
