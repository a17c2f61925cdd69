"""``gspo-cluster`` (cluster/runtime/local_cluster.py) as a user runs it: ``up`` a head and a worker node on 127.0.0.1,
a job through ``gspo-submit`` that sees both nodes and their custom resources, ``add-node``, ``remove-node``
(the node's raylet and workers end, the head notices), ``down`` (every process of this cluster ends, the state
file goes). The cluster has a private temp dir and state file; nothing else on the machine is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


from cluster.runtime.local_head import head_processes
from tests.helpers import REPO_ROOT


PROBE = ("python -c \"import json, ray; ray.init(); print('NODES', json.dumps(sorted("
         "[sorted(k for k in n['Resources'] if k.endswith('_node') or k.startswith('gspo_node')) "
         "for n in ray.nodes() if n['Alive']])))\"")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), RAY_USAGE_STATS_ENABLED="0")
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    env.update(extra)
    return env


def _run(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)


def _alive_nodes(out: str) -> list[list[str]]:
    line = next(l for l in out.splitlines() if l.startswith("NODES "))
    return json.loads(line[len("NODES "):])


def test_up_submit_add_remove_down(tmp_path):
    state = tmp_path / "cluster.json"
    temp_dir = tempfile.mkdtemp(prefix="gspo-ray-t-", dir="/tmp")
    cli = ["--state", str(state)]
    up = _run("cluster.runtime.local_cluster", *cli, "up", "--nodes", "2", "--cpus-per-node", "1", "--node-resources",
              "rollout_node", "--head-resources", "learner_node", "--object-store-mb", "300", "--temp-dir", temp_dir)
    try:
        assert up.returncode == 0, up.stderr
        recorded = json.loads(state.read_text())
        assert [n["head"] for n in recorded["nodes"]] == [True, False]
        # A second `up` on the same state file is refused while the cluster runs.
        again = _run("cluster.runtime.local_cluster", *cli, "up", "--nodes", "1")
        assert again.returncode == 4 and "is running" in again.stderr

        env_out = _run("cluster.runtime.local_cluster", *cli, "env")
        exports = dict(l.removeprefix("export ").split("=", 1) for l in env_out.stdout.splitlines())
        assert exports["RAY_ADDRESS"].startswith("127.0.0.1:") and exports["RAY_AUTH_MODE"] == "token"
        job = _run("cluster.submit", "--entrypoint", PROBE, env=_env(**exports))
        assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
        assert _alive_nodes(job.stdout) == [["gspo_node_0", "learner_node"], ["gspo_node_1", "rollout_node"]]

        added = _run("cluster.runtime.local_cluster", *cli, "add-node", "--node-resources", "rollout_node=2")
        assert added.returncode == 0, added.stderr
        removed = _run("cluster.runtime.local_cluster", *cli, "remove-node", "1")
        assert removed.returncode == 0 and "processes ended" in removed.stdout, removed.stderr
        assert [n["index"] for n in json.loads(state.read_text())["nodes"]] == [0, 2]
        want = [["gspo_node_0", "learner_node"], ["gspo_node_2", "rollout_node"]]
        deadline = time.monotonic() + 90  # the GCS marks the node dead after its health checks fail
        while True:
            job = _run("cluster.submit", "--entrypoint", PROBE, env=_env(**exports))
            if _alive_nodes(job.stdout) == want or time.monotonic() > deadline:
                break
            time.sleep(5)
        assert _alive_nodes(job.stdout) == want
    finally:
        down = _run("cluster.runtime.local_cluster", *cli, "down")
    assert down.returncode == 0, down.stderr
    assert not state.exists()
    assert head_processes(temp_dir, recorded["pgid"]) == []
    bad = _run("cluster.runtime.local_cluster", *cli, "down")
    assert bad.returncode == 4 and "no local cluster" in bad.stderr
