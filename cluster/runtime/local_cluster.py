"""A multi-node Ray cluster on this machine, started as a user starts a real one: ``gspo-cluster``
(``python -m cluster.runtime.local_cluster``).

    gspo-cluster up --nodes 3 --cpus-per-node 1 --node-resources rollout_node [--head-resources learner_node]
    eval "$(gspo-cluster env)"          # RAY_ADDRESS (job server) + the cluster's token, for gspo-submit
    gspo-submit configs/tiny_moe.yaml rollout.node_resources='{rollout_node: 1}'
    gspo-cluster add-node --node-resources rollout_node
    gspo-cluster remove-node 2          # ends one worker node's raylet and workers (a node lost)
    gspo-cluster status
    gspo-cluster down

The head is a ``cluster.runtime.local_head.LocalHead`` (``ray start --head`` on 127.0.0.1, every port chosen free, a
private temp dir and token); each worker node is one more ``ray start --address HEAD`` on 127.0.0.1 with ports
of its own, the same temp dir (so every process of the cluster names it) and the head's token. Ray gives each
node its own raylet, object store and resources, and objects cross between nodes through its object manager as
between machines. Every node gets a custom resource ``gspo_node_<i>: 1`` of its own (pin work to one node)
beside ``--node-resources`` (worker nodes) or ``--head-resources`` (the head).

The cluster's state (ports, temp dir, token file, each node's process group) is kept in a JSON file
(``--state``, default ``$GSPO_CLUSTER_STATE`` or ``<tmp>/gspo-cluster-<uid>.json``): ``down`` and
``remove-node`` end only the processes of this cluster, never other Ray instances (no ``ray stop``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cluster.common import free_port
from cluster.runtime.local_head import (LocalHead, SubmitError, head_processes, stop_head_processes,
                                        terminate_then_kill)

#: per-node object store; several nodes share this machine's memory (Ray's default is 30% of RAM per node)
DEFAULT_OBJECT_STORE_MB = 700
#: the ports ``ray start`` opens on a worker node (the head's are chosen in ``LocalHead.command``)
WORKER_PORTS = ("node-manager-port", "object-manager-port", "metrics-export-port", "dashboard-agent-listen-port",
                "dashboard-agent-grpc-port", "runtime-env-agent-port")


def default_state_path() -> Path:
    """``$GSPO_CLUSTER_STATE``, else ``<tmp>/gspo-cluster-<uid>.json``."""
    env = os.environ.get("GSPO_CLUSTER_STATE")
    return Path(env) if env else Path(tempfile.gettempdir()) / f"gspo-cluster-{os.getuid()}.json"


def parse_resources(items: list[str]) -> dict[str, float]:
    """``["rollout_node", "gpu_kind=2"]`` -> ``{"rollout_node": 1.0, "gpu_kind": 2.0}`` (an amount defaults to 1).

    Raises:
        ValueError: an empty name, one of Ray's own resources, or an amount that is not a number > 0.
    """
    out: dict[str, float] = {}
    for item in items:
        name, _, amount = item.partition("=")
        name = name.strip()
        if not name or name in ("CPU", "GPU", "memory", "object_store_memory") or name.startswith("node:"):
            raise ValueError(f"--node-resources {item!r}: not a custom resource name")
        try:
            value = float(amount) if amount else 1.0
        except ValueError:
            raise ValueError(f"--node-resources {item!r}: the amount {amount!r} is not a number") from None
        if not value > 0:
            raise ValueError(f"--node-resources {item!r}: the amount must be > 0")
        out[name] = value
    return out


# Ray's message when a node's raylet did not register with the GCS within its fixed 30 s (ray/_private/node.py)
STARTUP_TIMEOUT = "timed out during startup"


class LocalCluster:
    """A head and worker nodes on 127.0.0.1, remembered in a state file.

    Args:
        state_path: the JSON file that records the cluster (read by ``load``, ``down``, ``add_node``).
    """

    def __init__(self, state_path: Path | None = None):
        self.state_path = Path(state_path) if state_path else default_state_path()
        self.state: dict[str, Any] = {}

    # -- state ---------------------------------------------------------------------------------------------
    def load(self) -> "LocalCluster":
        """Read the state file.

        Raises:
            SubmitError: there is none (no cluster was started with this state file).
        """
        if not self.state_path.is_file():
            raise SubmitError(f"no local cluster recorded in {self.state_path} (start one with `gspo-cluster up`)")
        self.state = json.loads(self.state_path.read_text())
        return self

    def _save(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, self.state_path)

    @property
    def gcs_address(self) -> str:
        """``host:port`` of the GCS: ``trainer.ray_address`` / ``ray.init(address=...)``."""
        return f"{self.state['host']}:{self.state['gcs_port']}"

    @property
    def dashboard_url(self) -> str:
        """The job server (``gspo-submit --address``, ``RAY_ADDRESS`` for the Jobs API)."""
        return f"http://{self.state['host']}:{self.state['dashboard_port']}"

    def auth_env(self) -> dict[str, str]:
        """Environment that lets Ray's clients (``ray.init``, the Jobs API, ``ray`` CLI) talk to this cluster."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path(self.state["temp_dir"]) / "auth_token")}

    def alive(self) -> bool:
        """True while a process of the cluster is running."""
        return bool(self.state) and bool(head_processes(self.state["temp_dir"], self.state.get("pgid")))

    # -- up / add / remove / down --------------------------------------------------------------------------
    def up(self, nodes: int, cpus_per_node: int, node_resources: dict[str, float] | None = None,
           head_resources: dict[str, float] | None = None, object_store_mb: int = DEFAULT_OBJECT_STORE_MB,
           temp_dir: str | None = None) -> "LocalCluster":
        """Start the head and ``nodes - 1`` worker nodes (``node_resources`` each; the head ``head_resources``).

        Raises:
            ValueError: ``nodes`` or ``cpus_per_node`` < 1.
            SubmitError: a cluster recorded in the state file still runs, or ``ray start`` failed (what was
                started is stopped again).
        """
        if nodes < 1 or cpus_per_node < 1:
            raise ValueError(f"--nodes {nodes} and --cpus-per-node {cpus_per_node} must be >= 1")
        if self.state_path.is_file() and self.load().alive():
            raise SubmitError(f"a local cluster recorded in {self.state_path} is running ({self.gcs_address}); "
                              "`gspo-cluster down` first, or pass another --state")
        head = LocalHead(num_cpus=cpus_per_node, num_gpus=0, temp_dir=temp_dir,
                         object_store_memory=object_store_mb * 2**20,
                         resources={**(head_resources or {}), "gspo_node_0": 1})
        head.start()
        self.state = {"host": head.host, "gcs_port": head.gcs_port, "dashboard_port": head.dashboard_port,
                      "temp_dir": str(head.temp_dir), "pgid": head.pgid, "object_store_mb": object_store_mb,
                      "nodes": [{"index": 0, "head": True, "pgid": head.pgid, "cpus": cpus_per_node,
                                 "resources": head.resources}]}
        self._save()
        try:
            for _ in range(nodes - 1):
                self.add_node(cpus_per_node, node_resources)
        except BaseException:
            self.down()
            raise
        return self

    def add_node(self, cpus: int, resources: dict[str, float] | None = None, timeout_s: float = 120.0,
                 attempts: int = 2) -> dict:
        """Start one more worker node with ``ray start --address`` (ports of its own, the cluster's temp dir and
        token). Returns its record (``index``, ``pgid``, ``cpus``, ``resources``). A start that fails with Ray's
        "timed out during startup" (``ray start`` waits a fixed 30 s for the raylet to register with the GCS,
        which a busy small machine can exceed) is cleaned up and tried again, up to ``attempts`` starts in all.

        Raises:
            SubmitError: ``ray start`` failed (on the last attempt, or for another reason) or did not return
                within ``timeout_s``.
        """
        for attempt in range(1, attempts):
            try:
                return self._start_node(cpus, resources, timeout_s)
            except SubmitError as err:
                if STARTUP_TIMEOUT not in str(err):
                    raise
                print(f"`ray start` timed out registering the node (attempt {attempt} of {attempts}); trying again",
                      file=sys.stderr)
        return self._start_node(cpus, resources, timeout_s)

    def _start_node(self, cpus: int, resources: dict[str, float] | None, timeout_s: float) -> dict:
        """One ``ray start`` of a worker node (see ``add_node``); a failed start's processes are ended."""
        index = max(n["index"] for n in self.state["nodes"]) + 1
        res = {**(resources or {}), f"gspo_node_{index}": 1}
        host = self.state["host"]
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [str(ray_bin) if ray_bin.exists() else "ray", "start", "--address", self.gcs_address,
               "--node-ip-address", host, "--num-cpus", str(int(cpus)), "--num-gpus", "0",
               "--resources", json.dumps(res), "--object-store-memory", str(self.state["object_store_mb"] * 2**20),
               "--temp-dir", self.state["temp_dir"], "--disable-usage-stats"]
        for name in WORKER_PORTS:
            cmd += [f"--{name}", str(free_port(host))]
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
        env.update(self.auth_env())
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        proc = subprocess.Popen(cmd, env=env, cwd=self.state["temp_dir"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        record = {"index": index, "head": False, "pgid": proc.pid, "cpus": int(cpus), "resources": res}
        self.state["nodes"].append(record)  # recorded before it runs: `down` finds it even if start fails
        self._save()
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            out = f"did not return within {timeout_s:.0f}s"
        if proc.returncode != 0:
            self.remove_node(index)
            raise SubmitError(f"`ray start` of worker node {index} failed:\n{(out or '')[-4000:]}")
        return record

    def remove_node(self, index: int, grace_s: float = 5.0) -> int:
        """End worker node ``index``'s processes (its raylet, object store, agents and workers: the process
        group its ``ray start`` left them in), as a machine that is lost. Returns how many were found.

        Raises:
            SubmitError: no such worker node (the head is not removable: ``down`` ends the cluster).
        """
        node = next((n for n in self.state["nodes"] if n["index"] == index), None)
        if node is None or node["head"]:
            raise SubmitError(f"no worker node {index} in {self.state_path} "
                              f"(worker nodes: {[n['index'] for n in self.state['nodes'] if not n['head']]})")
        n = _stop_group(node["pgid"], grace_s)
        self.state["nodes"].remove(node)
        self._save()
        return n

    def down(self, grace_s: float = 15.0, keep_temp_dir: bool = False) -> int:
        """End every process of the cluster (each node's process group, and any process naming its temp dir),
        remove its temp dir (Ray's logs among it) unless ``keep_temp_dir``, and forget the state file.
        Returns how many processes were found."""
        n = sum(_stop_group(node["pgid"], grace_s) for node in self.state.get("nodes", []) if not node["head"])
        n += stop_head_processes(self.state["temp_dir"], self.state.get("pgid"), grace_s=grace_s)
        if not keep_temp_dir:
            shutil.rmtree(self.state["temp_dir"], ignore_errors=True)
        self.state_path.unlink(missing_ok=True)
        return n


def _stop_group(pgid: int, grace_s: float) -> int:
    """SIGTERM, then SIGKILL after ``grace_s``, the processes of group ``pgid`` (a worker node's ``ray start``:
    its raylet and agents) and their descendants (Ray's workers run in process groups of their own). A group id
    is trusted only while one of its processes is a Ray process (ids can be reused)."""
    import psutil

    procs = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getpgid(p.info["pid"]) == pgid:
                procs.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    if not any("ray" in " ".join(p.info["cmdline"] or []) for p in procs):
        return 0
    for p in list(procs):
        try:
            procs += [c for c in p.children(recursive=True) if c not in procs]
        except psutil.Error:
            pass
    terminate_then_kill(procs, grace_s)
    return len(procs)


# ---------------------------------------------------------------------------------------------- the command


def env_lines(cluster: LocalCluster) -> list[str]:
    """Shell ``export`` lines for this cluster: ``RAY_ADDRESS`` (the GCS, for ``ray.init`` and
    ``trainer.ray_address``), ``RAY_API_SERVER_ADDRESS`` (the job server, for ``gspo-submit``) and its token."""
    env = {"RAY_ADDRESS": cluster.gcs_address, "RAY_API_SERVER_ADDRESS": cluster.dashboard_url, **cluster.auth_env()}
    return [f"export {k}={v}" for k, v in env.items()]


def describe(cluster: LocalCluster) -> str:
    """A few lines: addresses, temp dir and the nodes with their CPUs and custom resources."""
    s = cluster.state
    lines = [f"GCS (trainer.ray_address): {cluster.gcs_address}", f"job server (gspo-submit --address): "
             f"{cluster.dashboard_url}", f"temp dir: {s['temp_dir']}   state: {cluster.state_path}"]
    for n in s["nodes"]:
        role = "head  " if n["head"] else "worker"
        lines.append(f"  node {n['index']} {role} {n['cpus']} CPU  resources {json.dumps(n['resources'])}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gspo-cluster", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--state", type=Path, default=None, help="the cluster's state file (default: %(default)s -> "
                   f"{default_state_path()})")
    sub = p.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="start a head and worker nodes")
    up.add_argument("--nodes", type=int, default=3, help="nodes in all, the head included (default 3)")
    up.add_argument("--cpus-per-node", type=int, default=1, help="logical CPUs of each node (default 1)")
    up.add_argument("--node-resources", action="append", default=[], metavar="NAME[=AMT]",
                    help="custom resource of every worker node (repeatable; amount 1 when omitted)")
    up.add_argument("--head-resources", action="append", default=[], metavar="NAME[=AMT]",
                    help="custom resource of the head node (repeatable)")
    up.add_argument("--object-store-mb", type=int, default=DEFAULT_OBJECT_STORE_MB,
                    help="object store of each node, MiB (default %(default)s)")
    up.add_argument("--temp-dir", help="the cluster's Ray temp dir (default a new /tmp/gspo-ray-*; keep it short)")
    add = sub.add_parser("add-node", help="start one more worker node")
    add.add_argument("--cpus", type=int, default=None, help="its logical CPUs (default: as the head)")
    add.add_argument("--node-resources", action="append", default=[], metavar="NAME[=AMT]")
    rm = sub.add_parser("remove-node", help="end one worker node's processes (a lost node)")
    rm.add_argument("index", type=int)
    sub.add_parser("env", help="print export lines for RAY_ADDRESS, RAY_API_SERVER_ADDRESS and the token")
    sub.add_parser("status", help="print the recorded nodes")
    down = sub.add_parser("down", help="end every process of the cluster and remove its temp dir")
    down.add_argument("--keep-temp-dir", action="store_true", help="keep the temp dir (Ray's logs: session_*/logs)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``gspo-cluster`` command. Exit status: 0 done, 2 bad arguments, 4 no cluster / a node failed to start."""
    args = build_parser().parse_args(argv)
    cluster = LocalCluster(args.state)
    try:
        if args.verb == "up":
            cluster.up(args.nodes, args.cpus_per_node, parse_resources(args.node_resources),
                       parse_resources(args.head_resources), args.object_store_mb, args.temp_dir)
            print(describe(cluster))
            print("use it:\n  " + "\n  ".join(env_lines(cluster)))
            return 0
        cluster.load()
        if args.verb == "add-node":
            cpus = args.cpus or cluster.state["nodes"][0]["cpus"]
            node = cluster.add_node(cpus, parse_resources(args.node_resources))
            print(f"added worker node {node['index']}: {cpus} CPU, resources {json.dumps(node['resources'])}")
        elif args.verb == "remove-node":
            print(f"removed worker node {args.index} ({cluster.remove_node(args.index)} processes ended)")
        elif args.verb == "env":
            print("\n".join(env_lines(cluster)))
        elif args.verb == "status":
            print(describe(cluster) + f"\nrunning: {cluster.alive()}")
        elif args.verb == "down":
            n = cluster.down(keep_temp_dir=args.keep_temp_dir)
            print(f"stopped {n} processes of the cluster in {cluster.state['temp_dir']}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SubmitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
