"""Job submission through the Ray Jobs API (cluster/submit.py).

The slow tests start their own Ray heads on 127.0.0.1 with private temp dirs (/tmp/gspo-ray-t-*) and end
exactly those heads' processes; they never run ``ray stop``.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster import submit
from cluster.config import ConfigError
from cluster.submit import LocalHead, head_processes, stop_head_processes
from tests.conftest import REPO_ROOT

PY = sys.executable


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1",
               RAY_USAGE_STATS_ENABLED="0")
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    env.update(extra)
    return env


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT, timeout: float = 600):
    return subprocess.run([PY, "-m", "cluster.submit", *args], cwd=cwd, env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def _private_temp() -> Path:
    return Path(tempfile.mkdtemp(prefix="gspo-ray-t-", dir="/tmp"))


# ----------------------------------------------------------------------------------- without a cluster


def test_entrypoint_and_config_path():
    ep = submit.train_entrypoint(str(REPO_ROOT / "configs/tiny_moe.yaml"), ["trainer.run_name=a b"], "python")
    assert shlex.split(ep) == ["python", "-m", "cluster.train", "configs/tiny_moe.yaml", "trainer.run_name=a b"]
    with pytest.raises(ConfigError, match="outside the repository"):
        submit.train_entrypoint("/etc/hostname", [])
    with pytest.raises(ConfigError, match="not shipped"):
        submit.train_entrypoint(str(REPO_ROOT / "outputs/x.yaml"), [])


def test_path_overrides_make_relative_paths_absolute(tmp_path):
    got = submit.path_overrides(str(REPO_ROOT / "configs/gsm8k_tiny.yaml"), ["trainer.output_dir=runs"], cwd=tmp_path)
    assert f"trainer.output_dir={tmp_path / 'runs'}" in got
    # data paths resolve as cluster.data does: from the repository root when not found from cwd
    shared = (REPO_ROOT / "../shared/data/gsm8k").resolve()
    assert f"data.train_path={shared / 'train.jsonl'}" in got and f"data.test_path={shared / 'test.jsonl'}" in got
    assert not any(o.startswith("model.path=") for o in got)  # builtin:tiny_moe stays
    # absolute paths are left alone; a relative model folder becomes absolute, a hub id stays as it is
    (tmp_path / "models" / "m").mkdir(parents=True)
    hub = submit.path_overrides(str(REPO_ROOT / "configs/tiny_moe.yaml"),
                                ["model.path=HuggingFaceTB/SmolLM2-135M-Instruct"], cwd=tmp_path)
    assert not any(o.startswith("model.path=") for o in hub)
    got = submit.path_overrides(str(REPO_ROOT / "configs/tiny_moe.yaml"),
                                ["trainer.output_dir=/abs/out", "model.path=models/m"], cwd=tmp_path)
    assert got == [f"model.path={tmp_path / 'models/m'}"]
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        submit.path_overrides(str(REPO_ROOT / "configs/tiny_moe.yaml"), ["trainer.total_steps=-1"])


def test_runtime_env(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("WANDB_API_KEY", "secret-not-forwarded")
    rt = submit.job_runtime_env({"A": "1"}, {"env_vars": {"B": "2"}, "excludes": ["data/"], "pip": ["x"]})
    assert rt["working_dir"] == str(REPO_ROOT)
    for pattern in (".venv/", ".git/", "outputs/", "__pycache__/", "data/"):
        assert pattern in rt["excludes"]
    env = rt["env_vars"]
    assert env["DS_ACCELERATOR"] == "cpu" and env["A"] == "1" and env["B"] == "2" and env["GSPO_PROGRESS"] == "0"
    assert "WANDB_API_KEY" not in env
    assert rt["pip"] == ["x"]


def test_address_precedence(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.1:8265")
    assert submit.resolve_address(None) == "http://10.0.0.1:8265"
    assert submit.resolve_address("http://127.0.0.1:1") == "http://127.0.0.1:1"
    monkeypatch.delenv("RAY_ADDRESS")
    assert submit.resolve_address(None) is None


def test_local_head_command_binds_loopback_with_private_ports(tmp_path):
    head = LocalHead(num_cpus=2, num_gpus=0, temp_dir=tmp_path / "r")
    cmd = head.command()
    assert cmd[1:3] == ["start", "--head"]
    opt = dict(zip(cmd[3::], cmd[4::]))
    assert opt["--node-ip-address"] == "127.0.0.1" and opt["--dashboard-host"] == "127.0.0.1"
    assert opt["--temp-dir"] == str(tmp_path / "r") and opt["--num-gpus"] == "0" and opt["--num-cpus"] == "2"
    for default in ("6379", "8265", "10001", "52365"):  # Ray's fixed defaults are never used
        assert default not in cmd
    assert head.dashboard_url == f"http://127.0.0.1:{opt['--dashboard-port']}"


def test_cli_refuses_bad_input():
    r = _cli("configs/tiny_moe.yaml", "trainer.total_steps=-1")
    assert r.returncode == 2 and "trainer.total_steps" in r.stderr
    r = _cli()
    assert r.returncode == 2 and "a CONFIG is needed" in r.stderr
    r = _cli("--status", "raysubmit_x")
    assert r.returncode == 2 and "RAY_ADDRESS" in r.stderr
    r = _cli("--address", "http://127.0.0.1:9", "--status", "raysubmit_x")
    assert r.returncode == 4 and "no Ray job server answers" in r.stderr


# ------------------------------------------------------------------------------------ with a real head


@pytest.fixture(scope="module")
def head():
    h = LocalHead(num_cpus=2, num_gpus=0, temp_dir=_private_temp())
    try:
        h.start()
        yield h
    finally:
        h.stop(remove_temp_dir=True)
        assert head_processes(h.temp_dir, h.pgid) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trivial_job_mechanics(head):
    client = head.client()
    # Shipped working dir (without .venv/.git/outputs), forwarded env, logs followed, exit status.
    code = ("import os, ray; ray.init(); print('cwd:', sorted(os.listdir('.'))); "
            "print('mark:', os.environ['GSPO_MARK']); print('cpus:', ray.cluster_resources()['CPU'])")
    job = submit.submit_job(client, shlex.join([PY, "-c", code]), submit.job_runtime_env({"GSPO_MARK": "m1"}))
    out = io.StringIO()
    assert submit.follow(client, job, out=out) == "SUCCEEDED"
    logs = out.getvalue()
    assert "\nmark: m1\n" in logs and "\ncpus: 2.0\n" in logs
    listing = next(line for line in logs.splitlines() if line.startswith("cwd:"))
    assert "'cluster'" in listing and "'configs'" in listing
    assert "'.venv'" not in listing and "'.git'" not in listing and "'outputs'" not in listing

    failed = submit.submit_job(client, shlex.join([PY, "-c", "raise SystemExit(5)"]), submit.job_runtime_env())
    assert submit.follow(client, failed, out=io.StringIO()) == "FAILED"
    assert submit.EXIT_CODES["FAILED"] == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_no_wait_status_stop_logs(head):
    env = _env(RAY_ADDRESS=head.dashboard_url, **head.auth_env())
    sleeper = shlex.join([PY, "-c", "import time; print('sleeping', flush=True); time.sleep(600)"])
    r = _cli("--entrypoint", sleeper, "--no-wait", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    job = r.stdout.strip().splitlines()[-1]
    assert job.startswith("raysubmit_")
    r = _cli("--status", job, env=env)
    assert r.returncode == 0 and r.stdout.startswith(f"{job}: ") and r.stdout.split()[1] in ("PENDING", "RUNNING")
    r = _cli("--stop", job, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("status STOPPED"), r.stdout + r.stderr
    r = _cli("--status", job, env=env)
    assert r.stdout.split()[1] == "STOPPED"
    r = _cli("--logs", job, env=env)
    assert r.returncode == 0 and "sleeping" in r.stdout
    r = _cli("--status", "raysubmit_doesnotexist", env=env)
    assert r.returncode == 1 and "error: job 'raysubmit_doesnotexist'" in r.stderr
    # A job followed to its end: exit status from the job's status, logs on stdout.
    r = _cli("--entrypoint", shlex.join([PY, "-c", "print('forty-two'); raise SystemExit(3)"]), env=env)
    assert r.returncode == 1 and "forty-two" in r.stdout
    # Without the head's token the job server refuses.
    no_token = _env(RAY_ADDRESS=head.dashboard_url)
    r = _cli("--status", job, env=no_token)
    assert r.returncode != 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_starts_and_stops_its_own_head():
    temp = _private_temp()
    try:
        r = _cli("--entrypoint", "python -c \"import sys; print('from', sys.executable)\"", "--temp-dir", str(temp))
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"from {PY}" in r.stdout or f"from {Path(PY).parent}" in r.stdout
        assert "starting a local Ray head on 127.0.0.1" in r.stderr
        assert head_processes(temp) == [] and not temp.exists()
    finally:
        stop_head_processes(temp)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_submit_tiny_moe_two_steps(tmp_path):
    """The default config, 2 RL steps, submitted to a local head through the Jobs API; the relative
    trainer.output_dir lands in the caller's folder, not in Ray's copy of the repository."""
    temp = _private_temp()
    overrides = ["trainer.total_steps=2", "warm_start.steps=2", "trainer.prompts_per_step=8", "trainer.group_size=4",
                 "learner.micro_batch_size=2", "data.num_eval=16", "wandb.mode=disabled", "trainer.output_dir=runs",
                 "trainer.run_name=submitted", "trainer.plots=false"]
    try:
        r = _cli(str(REPO_ROOT / "configs/tiny_moe.yaml"), *overrides, "--temp-dir", str(temp), cwd=tmp_path,
                 timeout=1700)
        assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
        assert "job raysubmit_" in r.stderr and "SUCCEEDED" in r.stderr
        metrics = tmp_path / "runs" / "submitted" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steps = [row["step"] for row in rows if row.get("step", 0) >= 1]
        assert steps == [1, 2]
        assert all("loss/policy" in row for row in rows if row.get("step", 0) >= 1)
        assert head_processes(temp) == []
    finally:
        stop_head_processes(temp)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_keep_cluster_then_stop_head():
    temp = _private_temp()
    try:
        r = _cli("--entrypoint", "python -c \"print('kept')\"", "--keep-cluster", "--temp-dir", str(temp))
        assert r.returncode == 0 and "kept" in r.stdout, r.stderr[-3000:]
        assert f"--stop-head {temp}" in r.stderr
        assert head_processes(temp) != []  # still running, as asked
        r = _cli("--stop-head", str(temp))
        assert r.returncode == 0 and r.stdout.startswith("stopped ")
        assert head_processes(temp) == []
    finally:
        stop_head_processes(temp)
        shutil.rmtree(temp, ignore_errors=True)
