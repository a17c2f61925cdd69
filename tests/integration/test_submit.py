"""Job submission through the Ray Jobs API (cluster/submit/job.py).

The slow tests start their own Ray heads on 127.0.0.1 with private temp dirs (/tmp/gspo-ray-t-*) and end
exactly those heads' processes; they never run ``ray stop``.
"""

from __future__ import annotations

import io
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from cluster.submit import job as submit
from cluster.submit.job import head_processes, stop_head_processes
from tests.helpers import REPO_ROOT
from tests.helpers.submit import PY, _cli, _env, _private_temp
from tests.helpers.submit import head  # noqa: F401 - fixtures


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


@pytest.mark.matrix  # wide case: the default set submits one job (test_trivial_job_mechanics)
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


@pytest.mark.matrix  # wide case: the default set submits one job (test_trivial_job_mechanics)
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


@pytest.mark.matrix  # wide case: the default set submits one job (test_trivial_job_mechanics)
@pytest.mark.timeout(1800)
def test_submit_tiny_moe_two_steps(tmp_path):
    """The default config, 2 RL steps, submitted to a local head through the Jobs API; the relative
    trainer.output_dir lands in the caller's folder, not in Ray's copy of the repository."""
    temp = _private_temp()
    overrides = ["trainer.total_steps=2", "warm_start.steps=2", "trainer.prompts_per_step=8", "trainer.group_size=4",
                 "learner.micro_batch_size=2", "data.num_eval=16", "wandb.mode=disabled", "trainer.output_dir=runs",
                 "trainer.run_name=submitted", "trainer.plots=false"]
    try:
        r = _cli(str(REPO_ROOT / "configs/tiny_moe_zero2.yaml"), *overrides, "--temp-dir", str(temp), cwd=tmp_path,
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


@pytest.mark.matrix  # wide case: the default set submits one job (test_trivial_job_mechanics)
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


@pytest.mark.matrix  # wide case: a two-node local cluster and a one-step run
@pytest.mark.timeout(1800)
def test_submit_from_a_user_folder_to_a_two_node_cluster(tmp_path, local_cluster):
    """A project folder outside the checkout (config, a verifier importing a helper beside it, data rows)
    travels with the job to a two-node local cluster; the reward workers import the verifier by name."""
    proj = tmp_path / "myproj"
    (proj / "data").mkdir(parents=True)
    (proj / "helper_uf.py").write_text("def one():\n    return 1.0\n")
    (proj / "myrew_uf.py").write_text("import helper_uf\n\ndef score(response, row):\n    return helper_uf.one()\n")
    (proj / "data" / "rows.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(16)))
    (proj / "outputs").mkdir()
    (proj / "outputs" / "junk.bin").write_bytes(b"0" * 1000)
    (proj / "myconf.yaml").write_text(
        "reward:\n  verifier: myrew_uf:score\n"
        "data:\n  task: files\n  train_path: data/rows.jsonl\n  eval_fraction: 0.25\n")
    cluster = local_cluster({"num_cpus": 2, "include_dashboard": True, "dashboard_host": "127.0.0.1"})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    url = "http://" + cluster.head_node.address_info["webui_url"]
    overrides = ["trainer.total_steps=1", "warm_start.steps=0", "trainer.prompts_per_step=4", "trainer.group_size=2",
                 "learner.micro_batch_size=2", "data.num_eval=4", "wandb.mode=disabled", "trainer.output_dir=runs",
                 "trainer.run_name=fromfolder", "trainer.plots=false"]
    # the cluster's nodes run this interpreter's environment (a real cluster's image has the packages installed)
    r = _cli("myconf.yaml", *overrides, "--python", sys.executable, env=_env(RAY_ADDRESS=url), cwd=proj,
             timeout=1700)
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    assert "-m cluster.train myconf.yaml" in r.stderr  # run in the shipped folder (the working_dir)
    rows = [json.loads(line) for line in (proj / "runs" / "fromfolder" / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    assert [row["step"] for row in rows if row.get("step", 0) >= 1] == [1]
