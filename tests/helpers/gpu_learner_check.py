"""``cluster.tools.gpu_learner_check`` at toy size on the CPU (gloo, DeepSpeed's CPU accelerator): the learner starts
as a ZeRO-3 GPU run starts it (partitioned build, bfloat16, with and without the optimizer offloaded to DeepSpeed's
CPU Adam), runs GSPO optimizer steps on synthetic rollouts and prints one JSON line whose checks all pass; without
a CUDA device and without ``--cpu`` it refuses, saying so. Also: the check imports neither Ray nor vLLM."""

from __future__ import annotations

import os
from tests.helpers import REPO_ROOT


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}
