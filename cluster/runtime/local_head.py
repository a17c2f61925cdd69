"""A single-node Ray head started on this machine for a job, and the Jobs API client (``cluster.submit``).

``LocalHead`` runs ``ray start --head`` bound to 127.0.0.1 with every port chosen free, a private temp dir and
a token of its own; ``stop_head_processes`` ends only that head's processes (never ``ray stop``, which would
end every Ray instance of the machine). ``make_client`` talks to the job server of a head or of a cluster.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster.common import free_port

HEAD_STATE_FILE = "gspo-head.json"


class SubmitError(RuntimeError):
    """The job could not be submitted or followed (no cluster, bad address, head failed to start)."""


def make_client(address: str, token: str | None = None):
    """A ``JobSubmissionClient`` for ``address`` (Ray lets the environment override its argument; here the
    argument wins). ``token``: the cluster's authentication token, sent as a bearer header; None leaves it
    to Ray (``RAY_AUTH_MODE=token`` with ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``).

    Raises:
        SubmitError: nothing answers at ``address``.
    """
    from ray.job_submission import JobSubmissionClient

    saved = {k: os.environ.pop(k) for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if k in os.environ}
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else None
        return JobSubmissionClient(address, headers=headers)
    except Exception as e:
        raise SubmitError(f"no Ray job server answers at {address!r}: {e}") from None
    finally:
        os.environ.update(saved)


# ---------------------------------------------------------------------------------------- the local head


class LocalHead:
    """A single-node Ray cluster started by this process with ``ray start --head``.

    Everything binds to ``host`` (127.0.0.1 by default); every port is chosen free, so it never collides with
    another Ray instance on the machine, and all of its files live in a private temp dir. ``stop()`` ends only
    the processes of this head: the process group it was started in, plus any process whose command line
    names its temp dir. It never runs ``ray stop`` (which would end every Ray instance of the machine).

    Args:
        num_cpus: logical CPUs of the node (the actors' reservations, not cores).
        num_gpus: GPUs of the node; None lets Ray detect them.
        temp_dir: the head's ``--temp-dir`` (created; keep the path short: Ray's socket paths live under it).
            None: a new ``/tmp/gspo-ray-*`` folder.
        host: address every server binds to.
        object_store_memory: bytes of the object store; None = Ray's default (30% of RAM).
        resources: custom resources of the node (name -> amount, ``ray start --resources``).
    """

    def __init__(
        self,
        num_cpus: int,
        num_gpus: int | None = None,
        temp_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        object_store_memory: int | None = None,
        resources: dict[str, float] | None = None,
    ):
        if num_cpus < 1:
            raise ValueError(f"num_cpus={num_cpus!r} must be >= 1")
        self.num_cpus = int(num_cpus)
        self.num_gpus = num_gpus
        self.host = host
        self.object_store_memory = object_store_memory
        self.resources = dict(resources or {})
        self.temp_dir = Path(temp_dir) if temp_dir else Path(tempfile.mkdtemp(prefix="gspo-ray-", dir="/tmp"))
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.temp_dir = self.temp_dir.resolve()
        self.pgid: int | None = None
        self.token: str | None = None
        self.gcs_port: int | None = None
        self.dashboard_port: int | None = None

    @property
    def dashboard_url(self) -> str:
        """The job server's address (``http://host:port``), for ``JobSubmissionClient`` and the browser."""
        return f"http://{self.host}:{self.dashboard_port}"

    @property
    def token_path(self) -> Path:
        """The head's private authentication token (mode 0600), for ``RAY_AUTH_TOKEN_PATH``."""
        return self.temp_dir / "auth_token"

    def auth_env(self) -> dict[str, str]:
        """Environment that lets Ray's own clients (``ray.init``, the ``ray`` CLI) talk to this head."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    def client(self):
        """A ``JobSubmissionClient`` of this head (sends its token)."""
        return make_client(self.dashboard_url, token=self.token)

    @property
    def gcs_address(self) -> str:
        """``host:port`` of the GCS, for ``ray.init(address=...)``."""
        return f"{self.host}:{self.gcs_port}"

    def command(self) -> list[str]:
        """The ``ray start`` command line (ports filled in)."""
        ports = {name: free_port(self.host) for name in (
            "port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port", "node-manager-port",
            "object-manager-port")}
        self.gcs_port, self.dashboard_port = ports["port"], ports["dashboard-port"]
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [str(ray_bin) if ray_bin.exists() else "ray", "start", "--head",
               "--node-ip-address", self.host, "--dashboard-host", self.host, "--include-dashboard", "true",
               "--num-cpus", str(self.num_cpus), "--temp-dir", str(self.temp_dir), "--disable-usage-stats"]
        if self.num_gpus is not None:
            cmd += ["--num-gpus", str(int(self.num_gpus))]
        if self.object_store_memory:
            cmd += ["--object-store-memory", str(int(self.object_store_memory))]
        if self.resources:
            cmd += ["--resources", json.dumps(self.resources)]
        for name, port in ports.items():
            cmd += [f"--{name}", str(port)]
        return cmd

    def start(self, timeout_s: float = 180.0) -> "LocalHead":
        """Start the head and wait until its job server answers.

        Raises:
            SubmitError: ``ray start`` failed or the job server did not answer within ``timeout_s``.
        """
        # Token authentication with a token of this head's own (never ~/.ray/auth_token, which other Ray
        # instances of this user share): the GCS, the dashboard and the job server refuse requests without it.
        self.token = secrets.token_hex(32)
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token)
        env = dict(os.environ)
        env.pop("RAY_AUTH_TOKEN", None)
        env.update(self.auth_env())
        # The job's entry point and the workers find this interpreter first.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
            env.pop(var, None)
        cmd = self.command()
        # A new session: every daemon `ray start` spawns stays in this process group, so stop() finds them.
        proc = subprocess.Popen(cmd, env=env, cwd=str(self.temp_dir), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.pgid = proc.pid
        self._write_state()
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise SubmitError(f"`ray start` did not return within {timeout_s:.0f}s") from None
        if proc.returncode != 0:
            self.stop()
            raise SubmitError(f"`ray start` failed (exit {proc.returncode}):\n{out[-4000:]}")
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                self.client().list_jobs()
                return self
            except Exception as e:  # the dashboard comes up a little after `ray start` returns
                last = e
                time.sleep(1.0)
        self.stop()
        raise SubmitError(f"the job server at {self.dashboard_url} did not answer within {timeout_s:.0f}s: {last}")

    def _write_state(self) -> None:
        state = {"pgid": self.pgid, "temp_dir": str(self.temp_dir), "gcs_port": self.gcs_port,
                 "dashboard_port": self.dashboard_port, "host": self.host}
        (self.temp_dir / HEAD_STATE_FILE).write_text(json.dumps(state))

    def stop(self, grace_s: float = 15.0, remove_temp_dir: bool = False) -> int:
        """End this head's processes (SIGTERM, then SIGKILL after ``grace_s``); returns how many were found."""
        n = stop_head_processes(self.temp_dir, self.pgid, grace_s=grace_s)
        if remove_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return n

    def __enter__(self) -> "LocalHead":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def head_processes(temp_dir: str | Path, pgid: int | None = None) -> list[Any]:
    """Processes of the head whose temp dir is ``temp_dir``: members of process group ``pgid`` and any process
    whose command line names ``temp_dir`` (Ray passes its session dir to every daemon and worker)."""
    import psutil

    marker = str(Path(temp_dir).resolve())
    me = os.getpid()
    named, grouped, group_is_ours = [], [], False
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] == me:
            continue
        try:
            in_group = pgid is not None and os.getpgid(p.info["pid"]) == pgid
            names_dir = any(marker in arg for arg in (p.info["cmdline"] or []))
        except (ProcessLookupError, psutil.Error):
            continue
        if names_dir:
            named.append(p)
            group_is_ours |= in_group
        elif in_group:
            grouped.append(p)
    # A group id is trusted only while a process of that group names our temp dir (ids can be reused).
    return named + (grouped if group_is_ours else [])


def terminate_then_kill(procs: list[Any], grace_s: float) -> None:
    """SIGTERM ``procs`` (``psutil.Process``), SIGKILL those still alive after ``grace_s`` seconds, and wait up
    to 5 s more for them to go; processes already gone are skipped."""
    import psutil

    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def stop_head_processes(temp_dir: str | Path, pgid: int | None = None, grace_s: float = 15.0) -> int:
    """SIGTERM the processes of one local head (see ``head_processes``), SIGKILL what is left after ``grace_s``.

    Returns:
        The number of processes found.
    """
    import psutil

    procs = head_processes(temp_dir, pgid)
    terminate_then_kill(procs, grace_s)
    # Workers started late (after the first scan) still name the temp dir.
    late = head_processes(temp_dir, pgid)
    for p in late:
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(procs) + len(late)


def stop_head_from_dir(temp_dir: str | Path) -> int:
    """Stop a local head that ``--keep-cluster``/``--no-wait`` left running, given its temp dir."""
    state_file = Path(temp_dir) / HEAD_STATE_FILE
    if not state_file.is_file():
        raise SubmitError(f"{str(temp_dir)!r} is not the temp dir of a head started by cluster.submit "
                          f"(no {HEAD_STATE_FILE})")
    state = json.loads(state_file.read_text())
    return stop_head_processes(state["temp_dir"], state.get("pgid"))
