"""``cluster.tools.gpu_learner_check`` at toy size on the CPU (gloo, DeepSpeed's CPU accelerator): the learner starts
as a ZeRO-3 GPU run starts it (partitioned build, bfloat16, with and without the optimizer offloaded to DeepSpeed's
CPU Adam), runs GSPO optimizer steps on synthetic rollouts and prints one JSON line whose checks all pass; without
a CUDA device and without ``--cpu`` it refuses, saying so. Also: the check imports neither Ray nor vLLM."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO_ROOT
from tests.helpers.gpu_learner_check import _env


def test_refuses_without_cuda():
    proc = subprocess.run([sys.executable, "-m", "cluster.tools.gpu_learner_check"], cwd=REPO_ROOT,
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
import cluster.tools.gpu_learner_check as c, learner.service, learner.step, cluster.planning.plan, cluster.models.tiny_model
c.check_config('1b', 'cpu', True)
print('imports ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "imports ok" in proc.stdout, proc.stderr[-2000:]


def test_the_1b_check_matches_the_plan_settings():
    """The check's learner settings are the ones its plan figure is computed for: ZeRO-3, bfloat16, one GPU."""
    from cluster.tools.gpu_learner_check import check_config, plan_figures

    cfg = check_config("1b", "cpu", True)
    lc = cfg.learner
    assert (lc.zero_stage, lc.dtype, lc.num_gpus_per_rank, lc.world_size, lc.offload_optimizer) == (3, "bfloat16", 1, 1,
                                                                                                     "cpu")
    figures = plan_figures(cfg, 140.0)
    assert 0.9 < figures["num_params_b"] < 1.2
    assert figures["learner_gpu_gib"] < plan_figures(check_config("1b", "none", True), 140.0)["learner_gpu_gib"]
