"""``cluster.tools.gpu_learner_check`` at toy size on the CPU (gloo, DeepSpeed's CPU accelerator): the learner starts
as a ZeRO-3 GPU run starts it (partitioned build, bfloat16, with and without the optimizer offloaded to DeepSpeed's
CPU Adam), runs GSPO optimizer steps on synthetic rollouts and prints one JSON line whose checks all pass; without
a CUDA device and without ``--cpu`` it refuses, saying so. Also: the check imports neither Ray nor vLLM."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.gpu_learner_check import _env


def test_toy_learner_check_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.tools.gpu_learner_check", "--size", "toy", "--cpu", "--steps", "2",
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
