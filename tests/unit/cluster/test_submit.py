"""Job submission through the Ray Jobs API (cluster/submit/job.py).

The slow tests start their own Ray heads on 127.0.0.1 with private temp dirs (/tmp/gspo-ray-t-*) and end
exactly those heads' processes; they never run ``ray stop``.
"""

from __future__ import annotations

import shlex

import pytest

from cluster.submit import job as submit
from cluster.config import ConfigError
from cluster.submit.job import LocalHead
from tests.helpers import REPO_ROOT
from tests.helpers.submit import _cli


def test_entrypoint_and_config_path():
    ep = submit.train_entrypoint(str(REPO_ROOT / "configs/tiny_moe_zero2.yaml"), ["trainer.run_name=a b"], "python")
    assert shlex.split(ep) == ["python", "-m", "cluster.train", "configs/tiny_moe_zero2.yaml", "trainer.run_name=a b"]
    with pytest.raises(ConfigError, match="outside the repository"):
        submit.train_entrypoint("/etc/hostname", [])
    with pytest.raises(ConfigError, match="not shipped"):
        submit.train_entrypoint(str(REPO_ROOT / "outputs/x.yaml"), [])


def test_path_overrides_make_relative_paths_absolute(tmp_path):
    got = submit.path_overrides(str(REPO_ROOT / "configs/gsm8k_tiny.yaml"), ["trainer.output_dir=runs"], cwd=tmp_path)
    assert f"trainer.output_dir={tmp_path / 'runs'}" in got
    # data paths resolve as cluster.data.prompts does: from the repository root when not found from cwd
    shared = (REPO_ROOT / "../shared/data/gsm8k").resolve()
    assert f"data.train_path={shared / 'train.jsonl'}" in got and f"data.test_path={shared / 'test.jsonl'}" in got
    assert not any(o.startswith("model.path=") for o in got)  # builtin:tiny_moe stays
    # absolute paths are left alone; a relative model folder becomes absolute, a hub id stays as it is
    (tmp_path / "models" / "m").mkdir(parents=True)
    hub = submit.path_overrides(str(REPO_ROOT / "configs/tiny_moe_zero2.yaml"),
                                ["model.path=HuggingFaceTB/SmolLM2-135M-Instruct"], cwd=tmp_path)
    assert not any(o.startswith("model.path=") for o in hub)
    got = submit.path_overrides(str(REPO_ROOT / "configs/tiny_moe_zero2.yaml"),
                                ["trainer.output_dir=/abs/out", "model.path=models/m"], cwd=tmp_path)
    assert got == [f"model.path={tmp_path / 'models/m'}"]
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        submit.path_overrides(str(REPO_ROOT / "configs/tiny_moe_zero2.yaml"), ["trainer.total_steps=-1"])


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
    r = _cli("configs/tiny_moe_zero2.yaml", "trainer.total_steps=-1")
    assert r.returncode == 2 and "trainer.total_steps" in r.stderr
    r = _cli()
    assert r.returncode == 2 and "a CONFIG is needed" in r.stderr
    r = _cli("--status", "raysubmit_x")
    assert r.returncode == 2 and "RAY_ADDRESS" in r.stderr
    r = _cli("--address", "http://127.0.0.1:9", "--status", "raysubmit_x")
    assert r.returncode == 4 and "no Ray job server answers" in r.stderr
