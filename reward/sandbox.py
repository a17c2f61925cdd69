"""The sandbox for model-written Python code (``code`` verifier).

Every run gets a fresh temporary directory and a minimal environment (``PATH``, ``HOME``/``TMPDIR`` = its
scratch space, ``LANG``; nothing from the parent's environment: no API keys or tokens). Two backends:

``bwrap`` (bubblewrap; the default, and the only isolating one): new user, PID, network, IPC, UTS and mount
namespaces, no further user namespaces; the file system holds only ``/usr`` (read-only), ``/proc``, a
read-only minimal ``/dev`` and the scratch space, a tmpfs of ``sandbox.scratch_mb`` at ``/sandbox`` (also
``/tmp``) that is the only writable place (``reward/bwrap.py``); no network at all (an empty network
namespace); every process of the run dies with the namespace when the run ends. A run seen with its scratch
space full (it is watched while the run lives and read again when it ends) is stopped with status
``scratch_limit``. If bubblewrap does not work here, running model code raises ``SandboxUnavailable``.

``plain`` (only when the config says ``backend: plain``): NOT a sandbox. A new session, as root a dedicated
unprivileged uid, the limits below, and a Python audit hook in the solution's interpreter that refuses
sockets, subprocesses, ctypes and file access outside the run's directory, as a speed bump only: code in
that interpreter can switch the hook off (it lives in the interpreter's own state) or go around it (a
process-spawning call it does not see), so a solution can read files and run programs on the host, and its
writes are bounded only per file. Choosing it logs ``PLAIN_WARNING`` once per process.

Both backends: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE and RLIMIT_CORE=0 set inside
the run (the process limit holds because the run never has uid 0 in the init namespace when we are root),
a wall-clock limit and an output cap enforced here, and at the end every process of the run is killed: the
session's process group, then (as root) every process of the run's uid, then any process whose initial
environment carries this run's id (which catches a child that double-forked and left the session); then its
temporary directory is removed whatever tree it holds (``reward.cleanup.remove_tree``).

Verdicts (``run_python_tests``): the solution's interpreter never decides whether a test passed. Stdin/stdout
tests compare the run's output here. Assert-style tests run here, in the judge's interpreter, against the
solution's functions seen through a channel that carries plain data only (``SolutionSession``,
``RemoteObject``); the threat model is in ``reward/README.md``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from reward import bwrap
from reward.bwrap import MOUNT_POINT
from reward.cleanup import remove_tree
from reward.config import SandboxConfig
from reward.sandbox_procs import ENV_OWNER, ENV_RUN, adopt_orphans, kill_run, sandbox_uid


log = logging.getLogger(__name__)
PLAIN_WARNING = (
    "reward.sandbox.backend=plain: model-written code runs WITHOUT a sandbox. plain does not stop a solution "
    "from switching off its in-process guard (an audit hook reachable from Python) or going around it "
    "(process-spawning calls it does not see), and then from reading any file this machine lets the run's uid "
    "read, starting programs, using the network, filling the disk with files up to sandbox.file_size_mb each, "
    "and, when not run as root, signalling or tracing the verifier (same uid). What still holds: the CPU, "
    "memory, process and file-size limits, the wall-clock limit, the output cap, the kill of every process of "
    "the run, and verdicts reached outside the solution. Use backend: bwrap (apt-get install -y bubblewrap) "
    "for model code you do not trust."
)
_plain_warned = False

# Monotonic deadline of the verifier call this process serves (set by reward.runner in its child); a
# sandbox run never outlives it, so the runner's own kill is only a backstop.
CALL_DEADLINE: float | None = None


class SandboxUnavailable(RuntimeError):
    """``sandbox.backend`` is ``bwrap`` (the default) but bubblewrap does not work on this machine."""


@dataclass
class SandboxResult:
    """The outcome of one sandbox run.

    Attributes:
        status: ``"ok"`` (exit 0), ``"exit"`` (non-zero exit), ``"timeout"`` (wall limit), ``"cpu_limit"``
            (SIGXCPU/SIGKILL from RLIMIT_CPU), ``"output_limit"`` (more output than ``max_output_kb``),
            ``"scratch_limit"`` (its scratch space was found full, bwrap only), ``"killed"`` (another
            signal), ``"error"`` (could not start).
        returncode: exit code, negative signal number, or None when it never started.
        stdout, stderr: decoded output, at most ``max_output_kb`` together.
        elapsed_s: wall-clock seconds.
        backend: ``"bwrap"`` or ``"plain"``.
        leftover_killed: processes of the run still alive after the main process ended (killed).
    """

    status: str
    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    elapsed_s: float = 0.0
    backend: str = ""
    leftover_killed: int = 0
    run_id: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


# Runs inside the sandbox as ``python -I -B -c LAUNCHER <json>``: limits, optional guard, then the program.
# In ``serve`` mode the program is a solution, loaded by the harness given in the JSON (``reward/_harness.py``),
# which answers the judge (``reward.judge``) over private copies of the original stdin/stdout; the solution's
# own prints go to stderr. Nothing here decides a verdict.
LAUNCHER = r'''
import json, os, resource, sys, types
cfg = json.loads(sys.argv[1])
if cfg["pdeathsig"]:
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL (set after the uid change, so it holds)
    if os.getppid() != cfg["parent"]:
        os._exit(137)
    del sys.modules["ctypes"]
for name, soft, hard in cfg["limits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
serve = cfg["mode"] == "serve"
if serve:
    chan_in = os.fdopen(os.dup(0), "rb")
    chan_out = os.fdopen(os.dup(1), "wb")
    fd = os.open(os.devnull, os.O_RDONLY); os.dup2(fd, 0); os.close(fd)
    os.dup2(2, 1)  # the solution's own prints go to stderr, never into the channel
with open("main.py", encoding="utf-8") as f:
    source = f.read()

if cfg["guard"]:
    def _guard_setup():
        home = os.path.realpath(os.getcwd())
        reads = {os.path.realpath(p) for p in sys.path if p and os.path.exists(p)}
        reads |= {os.path.realpath(p) for p in (sys.base_prefix + "/lib", sys.prefix + "/lib")}
        devs = {"/dev/null", "/dev/urandom", "/dev/random", "/dev/zero"}
        wbits = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
        real, fsdecode, startswith = os.path.realpath, os.fsdecode, str.startswith

        def under(p, roots):
            return any(p == r or startswith(p, r + "/") for r in roots)

        def check(path, write):
            if path is None or isinstance(path, int):
                return
            p = real(fsdecode(path))
            if p in devs or under(p, (home,)):
                return
            if not write and under(p, reads):
                return
            raise PermissionError(f"sandbox: {'write to' if write else 'read of'} {p} is not allowed")

        deny = {"subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "pty.spawn",
                "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata", "socket.connect",
                "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                "socket.gethostbyname", "socket.gethostbyaddr", "os.kill", "os.killpg", "signal.pthread_kill",
                "sys.addaudithook", "os.chroot", "os.setuid"}
        path_events = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod",
                       "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile",
                       "shutil.copytree", "shutil.move", "os.chflags", "os.setxattr", "os.removexattr"}

        def hook(event, args):
            if event == "open":
                path, mode, flags = args
                write = bool(flags & wbits) if isinstance(flags, int) else any(c in str(mode) for c in "wax+")
                check(path, write)
            elif event in deny:
                raise PermissionError(f"sandbox: {event} is not allowed")
            elif event == "socket.__new__" and args[1] not in (1,):  # only AF_UNIX socketpairs/local
                raise PermissionError("sandbox: network sockets are not allowed")
            elif event in ("os.listdir", "os.scandir"):
                check(args[0] if args and args[0] is not None else ".", False)
            elif event in path_events:
                for a in args[:2]:
                    if isinstance(a, (str, bytes, os.PathLike)):
                        check(a, True)
        sys.addaudithook(hook)
    _guard_setup()
    del _guard_setup

if not serve:
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    sys.exit(0)
harness = {"__name__": "harness"}
exec(compile(cfg["harness"], "harness.py", "exec"), harness)
harness["serve"](source, chan_in, chan_out)
'''


def sandbox_python(cfg: SandboxConfig) -> str:
    """The interpreter that runs model code: ``cfg.python``, else ``/usr/bin/python3``, else ours (resolved)."""
    if cfg.python:
        return cfg.python
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.realpath(shutil.which("python3") or sys.executable)




def bwrap_available(python: str = "/usr/bin/python3") -> bool:
    """Whether bubblewrap runs sandboxes here (a probe run with every option a run uses, as the sandbox uid
    ``sandbox_uid()``; cached per process). ``reward.bwrap.probe`` says why not."""
    return bwrap.probe(python, sandbox_uid()) is None


def choose_backend(cfg: SandboxConfig) -> str:
    """``"bwrap"`` or ``"plain"`` for ``cfg.backend``; ``plain`` only when the config chose it, and then the
    first call in this process logs ``PLAIN_WARNING`` (calls under the protected runner, where
    ``CALL_DEADLINE`` is set, leave that to the process that owns the runner: ``reward.worker`` logs it
    once when it starts, through ``announce``).

    Raises:
        SandboxUnavailable: ``backend="bwrap"`` while bubblewrap does not work here (the message says why and
            how to install it).
    """
    if cfg.backend == "plain":
        if CALL_DEADLINE is None:
            warn_plain_once()
        return "plain"
    why = bwrap.probe(sandbox_python(cfg), sandbox_uid())
    if why is not None:
        raise SandboxUnavailable(
            f"reward.sandbox.backend='bwrap': {why}. Install bubblewrap 0.8 or newer (Debian/Ubuntu: apt-get "
            "install -y bubblewrap), or set reward.sandbox.backend: plain to run model code without a sandbox "
            "(see reward/README.md for what that allows)"
        )
    return "bwrap"


def warn_plain_once() -> None:
    """Log ``PLAIN_WARNING`` (what the ``plain`` backend does not stop) unless this process already did."""
    global _plain_warned
    if not _plain_warned:
        _plain_warned = True
        log.warning(PLAIN_WARNING)


def announce(cfg: SandboxConfig) -> str:
    """Resolve the backend of ``cfg`` now, at the start of a run: log ``PLAIN_WARNING`` once for ``plain``,
    raise ``SandboxUnavailable`` when bubblewrap is required and missing. Returns the backend."""
    if cfg.backend == "plain":
        warn_plain_once()
    return choose_backend(cfg)



def _limits(cfg: SandboxConfig) -> list[tuple[str, int, int]]:
    mem = cfg.memory_mb * 2**20
    fsize = int(cfg.file_size_mb * 2**20)
    return [("RLIMIT_CPU", cfg.cpu_s, cfg.cpu_s + 1), ("RLIMIT_AS", mem, mem), ("RLIMIT_FSIZE", fsize, fsize),
            ("RLIMIT_NPROC", cfg.max_procs, cfg.max_procs), ("RLIMIT_NOFILE", 64, 64), ("RLIMIT_CORE", 0, 0)]


@dataclass
class Run:
    """One started sandbox process and what is needed to end it (``start_run``, ``stop_run``).

    Attributes:
        proc: the process (bubblewrap's, or the interpreter's for ``plain``), with stdin/stdout/stderr pipes.
        work: its temporary working directory. uid: the sandbox uid (None when we are not root).
        run_id: the tag in its processes' environment. backend: ``"bwrap"`` or ``"plain"``.
        start, deadline: ``time.monotonic()`` at the start and when its wall-clock time is up.
        scratch_fd: a descriptor of its scratch tmpfs (bwrap; None for plain), closed by ``stop_run``.
    """

    proc: subprocess.Popen
    work: str
    uid: int | None
    run_id: str
    backend: str
    start: float
    deadline: float
    scratch_fd: int | None = None


def time_limit(cfg: SandboxConfig, wall_s: float | None = None) -> float:
    """Seconds a run may take: ``wall_s`` (default ``cfg.wall_s``), never past ``CALL_DEADLINE`` (minus
    0.25 s for clean-up); may be <= 0 when no time is left."""
    limit = cfg.wall_s if wall_s is None else wall_s
    if CALL_DEADLINE is not None:
        limit = min(limit, CALL_DEADLINE - time.monotonic() - 0.25)
    return limit


def start_run(code: str, cfg: SandboxConfig, limit: float, harness: str | None = None) -> Run | SandboxResult:
    """Start ``code`` in a fresh sandbox with ``limit`` seconds of wall-clock time: as a program, or, with
    ``harness`` (the source of ``reward/_harness.py``), as a solution served to the judge over the process's
    stdin/stdout. Returns the started ``Run`` (end it with ``stop_run``), or a ``SandboxResult`` with status
    ``error`` when it could not start (no scratch directory, the process could not be started): not the code's
    doing, which its callers report as ``reward.infra`` cause ``sandbox_start``.

    Raises:
        SandboxUnavailable: bubblewrap required but missing (see ``choose_backend``).
    """
    backend = choose_backend(cfg)
    python = sandbox_python(cfg)
    uid = sandbox_uid()
    if uid is not None:
        adopt_orphans()
    run_id = secrets.token_hex(8)
    start = time.monotonic()
    try:
        work = tempfile.mkdtemp(prefix="sbx-", dir=cfg.tmp_root)
    except OSError as err:  # no scratch space (tmp_root missing or full): the run cannot start
        return SandboxResult("error", None, backend=backend, run_id=run_id, detail={"reason": repr(err)})
    try:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chown(work, uid, uid)
            os.chown(os.path.join(work, "main.py"), uid, uid)
        os.chmod(work, 0o700)
        home = MOUNT_POINT if backend == "bwrap" else work
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", ENV_RUN: run_id, ENV_OWNER: str(os.getpid())}
        launcher_cfg = {"mode": "program" if harness is None else "serve", "limits": _limits(cfg),
                        "guard": backend == "plain", "pdeathsig": backend == "plain", "parent": os.getpid(),
                        "harness": harness}
        cmd = [python, "-I", "-B", "-c", LAUNCHER, json.dumps(launcher_cfg)]
        popen = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work, env=env,
                     user=uid, group=uid, extra_groups=[] if uid is not None else None, start_new_session=True,
                     close_fds=True)
        scratch_fd = None
        if backend == "bwrap":
            argv = bwrap.argv(python, work, cfg.scratch_mb * 2**20)
            for k, v in env.items():
                argv += ["--setenv", k, v]
            proc, scratch_fd = bwrap.start(argv + ["--"] + cmd, cfg.scratch_mb * 2**20, start + limit,
                                           **popen)
        else:
            proc = subprocess.Popen(cmd, **popen)
    except OSError as err:
        remove_tree(work)
        return SandboxResult("error", None, backend=backend, run_id=run_id, detail={"reason": repr(err)})
    return Run(proc, work, uid, run_id, backend, start, start + limit, scratch_fd)


def scratch_full(run: Run) -> bool:
    """Whether ``run``'s scratch space is full (bwrap; always False for plain, whose writes are bounded only
    per file). Readable until ``stop_run``, also after the run's processes ended."""
    return run.scratch_fd is not None and bwrap.is_full(run.scratch_fd)


def stop_run(run: Run) -> int:
    """Kill every process of ``run``, close its pipes and its scratch space, remove its temp dir (whatever tree
    it holds); returns how many processes of it were still alive after its process group was killed
    (idempotent)."""
    try:
        os.killpg(run.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        run.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.proc.wait()
    leftovers = kill_run(run_id=run.run_id, uid=run.uid, pgid=run.proc.pid)
    for stream in (run.proc.stdin, run.proc.stdout, run.proc.stderr):
        try:
            stream.close()
        except OSError:
            pass
    if run.scratch_fd is not None:
        os.close(run.scratch_fd)  # the last reference to the run's tmpfs: its memory is freed
        run.scratch_fd = None
    remove_tree(run.work)
    return max(0, leftovers)


def exit_status(run: Run) -> tuple[str, int | None]:
    """``(status, returncode)`` of an ended run that hit no limit of ours: ``ok`` (exit 0), ``cpu_limit``
    (SIGXCPU or SIGKILL), ``killed`` (another signal) or ``exit`` (a non-zero code)."""
    rc = run.proc.returncode
    if run.backend == "bwrap" and rc is not None and rc > 128:
        rc = -(rc - 128)  # bwrap reports a child killed by signal s as 128 + s
    if rc == 0:
        return "ok", rc
    if rc in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit", rc
    if rc is not None and rc < 0:
        return "killed", rc
    return "exit", rc


def run_python(code: str, cfg: SandboxConfig, *, stdin: str = "", wall_s: float | None = None) -> SandboxResult:
    """Run ``code`` (Python source) once in the sandbox as a program, feeding ``stdin``.

    Args:
        code: the program, written to ``main.py`` in the run's temp dir.
        cfg: limits and backend.
        stdin: text given on standard input.
        wall_s: wall-clock limit, seconds (default ``cfg.wall_s``; never past ``CALL_DEADLINE``).

    Raises:
        SandboxUnavailable: bubblewrap required but missing (see ``choose_backend``).
    """
    limit = time_limit(cfg, wall_s)
    if limit <= 0:
        return SandboxResult("timeout", None, backend=choose_backend(cfg),
                             detail={"reason": "no time left in the call"})
    run = start_run(code, cfg, limit)
    if isinstance(run, SandboxResult):
        return run
    return _execute(run, stdin, cfg)


def _execute(run: Run, feed: str, cfg: SandboxConfig) -> SandboxResult:
    proc = run.proc

    def _feed():
        try:
            proc.stdin.write(feed.encode("utf-8", "replace"))
        except (BrokenPipeError, OSError):
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    feeder = threading.Thread(target=_feed, daemon=True)
    feeder.start()
    cap = cfg.max_output_kb * 1024
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    status = None
    exited_at = None
    while sel.get_map():
        now = time.monotonic()
        if now >= run.deadline:
            status = "timeout"
            break
        if scratch_full(run):
            status = "scratch_limit"
            break
        if proc.poll() is not None:
            exited_at = exited_at or now
            if now - exited_at > 0.2:  # a leftover child holds the pipes open: stop reading
                break
        for key, _ in sel.select(timeout=min(0.05, run.deadline - now)):
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            bufs[key.fd] += chunk
            if sum(len(b) for b in bufs.values()) > cap:
                status = "output_limit"
                break
        if status:
            break
    sel.close()
    if status is None and scratch_full(run):  # read after the end too: it left its scratch full
        status = "scratch_limit"
    out, err = (bytes(b[:cap]) for b in bufs.values())  # stdout first, stderr second
    leftovers = stop_run(run)
    feeder.join(timeout=1)
    ended, rc = exit_status(run)
    return SandboxResult(status or ended, rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                         time.monotonic() - run.start, run.backend, leftovers, run.run_id)
