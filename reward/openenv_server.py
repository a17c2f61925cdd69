"""An OpenEnv environment's server as a local subprocess (``env.openenv.app``): started by an env worker on its
own node, on 127.0.0.1 at a free port, stopped with the worker.

``OpenEnvServer`` starts ``python -m reward.openenv_server --app module:app --port N --parent PID``: this module
as a script imports the app (an ASGI app, what openenv's ``create_app`` returns) and serves it with uvicorn on
127.0.0.1 only. A watchdog thread in the server ends it within a second once its parent (the env worker) is gone,
so a worker killed with SIGKILL (Ray's ``ray.kill``, a lost node) leaves no server behind; the server is also in a
session of its own, so that ``stop`` ends whatever it started (its process group).

The server is ready when ``GET /health`` answers 200. It is not when its process exits first, or when
``start_timeout_s`` passes: then ``OpenEnvStartError`` names the app and shows the end of the server's log (its
stdout and stderr go to a file, never to a pipe that could fill up and block it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from reward.infra import Cause, InfraFailure

HOST = "127.0.0.1"
LOG_TAIL_CHARS = 2000  # the end of the server's log shown in a start error
_PORT_TAKEN = "address already in use"  # uvicorn's log line when the port was taken between choice and bind


class OpenEnvStartError(InfraFailure):
    """An OpenEnv server did not start (its app does not import, its process exited, or it did not answer
    ``/health`` in time) or a server does not answer as OpenEnv's do; the message names the app or URL. At the
    run's start it stops the run; under an episode (a dead server that would not start again) it is the
    service's failure (``reward.infra``, cause ``server_died``)."""

    def __init__(self, message: str):
        super().__init__(Cause.SERVER_DIED, message)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice; another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout_s: float) -> tuple[int, bytes]:
    """``(status, body)`` of ``GET url``, without proxies (the servers are local or named by the user).

    Raises:
        OSError: no answer (refused, reset, timed out: ``urllib.error.URLError`` and ``TimeoutError`` are
            ``OSError``s).
    """
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()


class OpenEnvServer:
    """One local OpenEnv server process serving ``app``.

    Args:
        app: ``"module.path:attr"``, an ASGI app (openenv's ``create_app``); imported in the server process, where
            ``python -m`` looks (the working folder, ``PYTHONPATH``: Ray's shipped user modules included).
        start_timeout_s: seconds the server has to answer ``/health``.

    Attributes:
        url: ``http://127.0.0.1:PORT`` while it runs, else None.
        starts: how many times it was started (restarts included).
    """

    def __init__(self, app: str, start_timeout_s: float):
        self.app = app
        self.start_timeout_s = float(start_timeout_s)
        self.url: str | None = None
        self.starts = 0
        self._proc: subprocess.Popen | None = None
        self._log: Path | None = None
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop_process, None, None)

    def start(self) -> str:
        """Start the server and wait until it answers ``/health``; its base URL. A running one is stopped first.

        Raises:
            OpenEnvStartError: the process exited before it answered (its app does not import, raised, or its port
                was taken three times in a row) or did not answer within ``start_timeout_s``; the message names
                the app and shows the end of its log.
        """
        with self._lock:
            self._stop_locked()
            for _ in range(3):
                if self._launch_locked():
                    self.starts += 1
                    return str(self.url)
            raise OpenEnvStartError(f"env.openenv.app={self.app!r}: the server found no free port in 3 tries")

    def running(self) -> bool:
        """Whether the server process is alive (it may still be unable to answer)."""
        proc = self._proc
        return proc is not None and proc.poll() is None

    def pid(self) -> int | None:
        """The server process's id while it runs, else None."""
        return self._proc.pid if self.running() else None

    def stop(self) -> None:
        """End the server (SIGTERM to its process group, SIGKILL after 5 s) and remove its log. Idempotent."""
        with self._lock:
            self._stop_locked()

    # -- private ----------------------------------------------------------------------------------------------
    def _launch_locked(self) -> bool:
        """One start; True when it answered ``/health``, False when its port was taken (try again)."""
        port = free_port()
        fd, log = tempfile.mkstemp(prefix="openenv-server-", suffix=".log")
        self._log = Path(log)
        cmd = [sys.executable, "-m", "reward.openenv_server", "--app", self.app, "--port", str(port),
               "--parent", str(os.getpid())]
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True)
        except OSError as err:
            raise OpenEnvStartError(f"env.openenv.app={self.app!r}: the server process did not start: {err}") from err
        finally:
            os.close(fd)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop_process, self._proc, self._log)
        url = f"http://{HOST}:{port}"
        status = 0
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self._log_tail()
                code = self._proc.returncode
                self._stop_locked()
                if _PORT_TAKEN in tail.lower():
                    return False
                raise OpenEnvStartError(f"env.openenv.app={self.app!r}: the server exited with status {code} before "
                                        f"it answered /health; the end of its log:\n{tail}")
            try:
                status, _ = http_get(f"{url}/health", timeout_s=1.0)
            except OSError:
                status = 0
            if status == 200:
                self.url = url
                return True
            time.sleep(0.05)
        tail = self._log_tail()
        self._stop_locked()
        said = f"its last answer was status {status}" if status else "it did not answer"
        raise OpenEnvStartError(f"env.openenv.app={self.app!r}: the server did not answer /health with status 200 "
                                f"within env.openenv.start_timeout_s={self.start_timeout_s:g} s ({said}); the end of "
                                f"its log:\n{tail}")

    def _log_tail(self) -> str:
        try:
            return self._log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if self._log else ""
        except OSError:
            return ""

    def _stop_locked(self) -> None:
        proc, log, self._proc, self._log, self.url = self._proc, self._log, None, None, None
        self._finalizer.detach()
        _stop_process(proc, log)


def _stop_process(proc: subprocess.Popen | None, log: Path | None) -> None:
    """End ``proc``'s process group (it leads one: ``start_new_session``) and remove ``log``."""
    if proc is not None and proc.poll() is None:
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    if proc is not None:
        try:
            proc.wait(timeout=0.1)  # reaped: no zombie left
        except subprocess.TimeoutExpired:
            pass
    if log is not None:
        log.unlink(missing_ok=True)


def _watch_parent(parent: int) -> None:
    """In the server: exit at once when the process that started it is gone (re-parented)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """Serve ``--app`` on 127.0.0.1:``--port`` with uvicorn until stopped or the ``--parent`` process is gone.

    Raises:
        SystemExit: bad arguments (argparse), or the app cannot be imported, is not there or is not callable
            (status 2, the reason on stderr).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", required=True, help="module.path:attr of the ASGI app")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent", type=int, default=0, help="exit when this process is gone (0: never)")
    args = parser.parse_args(argv)
    if args.parent:
        threading.Thread(target=_watch_parent, args=(args.parent,), daemon=True, name="parent-watch").start()
    module_name, _, attr = args.app.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        app = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        print(f"env.openenv.app={args.app!r} cannot be loaded: {type(err).__name__}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if not callable(app):
        print(f"env.openenv.app={args.app!r} is {app!r}, not an ASGI app (what openenv's create_app returns)",
              file=sys.stderr)
        raise SystemExit(2)
    import uvicorn

    uvicorn.run(app, host=HOST, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
