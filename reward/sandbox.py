"""The sandbox for model-written Python code (``code`` verifier).

Every run gets a fresh temporary directory as its working directory and a minimal environment (``PATH``,
``HOME``/``TMPDIR`` = the temp dir, ``LANG``; nothing from the parent's environment: no API keys or tokens).
Two backends:

``bwrap`` (bubblewrap, chosen by ``backend="auto"`` when a probe run works): new user, PID, network, IPC,
UTS and mount namespaces; the file system holds only ``/usr`` (read-only), a private ``/tmp``, ``/proc``,
``/dev`` and the temp dir (at ``/sandbox``); no network at all (an empty network namespace); every process of
the run dies with the namespace when the run ends.

``plain`` (fallback when bubblewrap is missing): a new session, and as root a dedicated unprivileged uid;
a Python audit hook inside the interpreter refuses sockets, subprocess/exec, ctypes, writes outside the temp
dir and reads outside the temp dir and the interpreter's own library paths. The hook is not a kernel
boundary: a determined native-code escape can bypass it (see README).

Both backends: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE and RLIMIT_CORE=0 set inside
the run (the process limit holds because the run never has uid 0 in the init namespace when we are root),
a wall-clock limit and an output cap enforced here, and at the end every process of the run is killed: the
session's process group, then (as root) every process of the run's uid, then any process whose initial
environment carries this run's id (which catches a child that double-forked and left the session).

Verdicts (``run_python_tests``): the solution's interpreter never decides whether a test passed. Stdin/stdout
tests compare the run's output here. Assert-style tests run here, in the judge's interpreter, against the
solution's functions seen through a channel that carries plain data only (``SolutionSession``,
``RemoteObject``); the threat model is in ``reward/README.md``.
"""

from __future__ import annotations

import builtins
import importlib
import json
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
from functools import lru_cache
from typing import Any

import psutil

from reward.config import SandboxConfig

UID_BASE = 200_000  # dedicated sandbox uids (root only): UID_BASE + owner_pid % UID_SPAN
UID_SPAN = 60_000
ENV_RUN = "GSPO_SANDBOX_RUN"
ENV_OWNER = "GSPO_SANDBOX_OWNER"
MOUNT_POINT = "/sandbox"

# Monotonic deadline of the verifier call this process serves (set by reward.runner in its child); a
# sandbox run never outlives it, so the runner's own kill is only a backstop.
CALL_DEADLINE: float | None = None


class SandboxUnavailable(RuntimeError):
    """``sandbox.require_bwrap`` is set but bubblewrap does not work on this machine."""


@dataclass
class SandboxResult:
    """The outcome of one sandbox run.

    Attributes:
        status: ``"ok"`` (exit 0), ``"exit"`` (non-zero exit), ``"timeout"`` (wall limit), ``"cpu_limit"``
            (SIGXCPU/SIGKILL from RLIMIT_CPU), ``"output_limit"`` (more output than ``max_output_kb``),
            ``"killed"`` (another signal), ``"error"`` (could not start).
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
# In ``serve`` mode the program is a solution: it is loaded, then the harness answers calls from the judge
# (``run_python_tests``) over a private copy of the original stdin/stdout. Nothing here decides a verdict:
# the answers are plain data, checked and compared outside this interpreter.
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

handles, iterators = [], {}


def send(msg):
    chan_out.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
    chan_out.flush()


def keep(v):
    handles.append(v)
    return {"$h": len(handles) - 1, "type": type(v).__name__[:80], "callable": callable(v)}


def enc(v, depth=0):
    if depth > 100:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if v is None or isinstance(v, bool):
        return None if v is None else bool(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, str):
        return str(v)
    if isinstance(v, list):
        return [enc(x, d) for x in v]
    if isinstance(v, tuple):
        return {"$t": [enc(x, d) for x in v]}
    if isinstance(v, dict):
        return {"$d": [[enc(k, d), enc(x, d)] for k, x in v.items()]}
    if isinstance(v, (set, frozenset)):
        return {"$fs" if isinstance(v, frozenset) else "$s": [enc(x, d) for x in v]}
    if isinstance(v, (bytes, bytearray)):
        return {"$b": bytes(v).decode("latin-1")}
    if isinstance(v, complex):
        return {"$c": [v.real, v.imag]}
    return keep(v)


def dec(x):
    if isinstance(x, list):
        return [dec(e) for e in x]
    if not isinstance(x, dict):
        return x
    (tag, val), = x.items()
    if tag == "$h":
        return handles[val]
    if tag == "$t":
        return tuple(dec(e) for e in val)
    if tag == "$d":
        return {dec(k): dec(e) for k, e in val}
    if tag in ("$s", "$fs"):
        return (frozenset if tag == "$fs" else set)(dec(e) for e in val)
    if tag == "$b":
        return val.encode("latin-1")
    if tag == "$c":
        return complex(*val)
    raise ValueError("bad tag")


def describe(e):
    try:
        msg = str(e)[:300]
    except BaseException:
        msg = ""
    return {"exc": type(e).__name__[:80], "msg": msg}


g = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(compile(source, "main.py", "exec"), g)
except BaseException as e:
    send({"load_error": describe(e)})
    os._exit(1)
exports = {}
for k, v in list(g.items()):
    if k.startswith("__"):
        continue
    if isinstance(v, types.ModuleType):
        exports[k] = {"$m": v.__name__}
        continue
    try:
        e = enc(v)
        if len(json.dumps(e)) > 65536:
            e = keep(v)
    except BaseException:
        e = keep(v)
    exports[k] = e
send({"ready": exports})
for line in chan_in:
    try:
        req = json.loads(line)
        op, obj = req["op"], handles[req["h"]]
        if op == "call":
            args = [dec(a) for a in req["args"]]
            kwargs = {k: dec(v) for k, v in req["kwargs"].items()}
            try:
                res = obj(*args, **kwargs)
            except BaseException as e:
                send(describe(e))
                continue
            post = []
            for a, raw in zip(args, req["args"]):
                after = enc(a) if type(a) in (list, dict, set) else None
                post.append(after if after is not None and after != raw else None)
            send({"ok": enc(res), "post": post})
        elif op == "getattr":
            try:
                send({"ok": enc(getattr(obj, req["name"]))})
            except BaseException as e:
                send(describe(e))
        elif op == "next":
            try:
                it = iterators.get(req["h"])
                if it is None:
                    it = iterators[req["h"]] = iter(obj)
                send({"ok": enc(next(it))})
            except StopIteration:
                send({"stop": True})
            except BaseException as e:
                send(describe(e))
        else:
            send({"exc": "ProtocolError", "msg": "unknown op"})
    except BaseException as e:
        send(describe(e))
os._exit(0)
'''


def sandbox_python(cfg: SandboxConfig) -> str:
    """The interpreter that runs model code: ``cfg.python``, else ``/usr/bin/python3``, else ours (resolved)."""
    if cfg.python:
        return cfg.python
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.realpath(shutil.which("python3") or sys.executable)


def sandbox_uid(owner_pid: int | None = None) -> int | None:
    """The dedicated uid of sandbox runs started by process ``owner_pid`` (default: this one), or None when
    this process is not root (then runs keep our uid)."""
    if os.geteuid() != 0:
        return None
    return UID_BASE + (owner_pid if owner_pid is not None else os.getpid()) % UID_SPAN


def _bwrap_argv(python: str, workdir: str) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    if prefix not in ("/usr", "/") and not prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", workdir, MOUNT_POINT,
             "--chdir", MOUNT_POINT, "--clearenv"]
    return argv


@lru_cache(maxsize=8)
def bwrap_available(python: str = "/usr/bin/python3") -> bool:
    """Whether bubblewrap is installed and a probe run (namespaces, as the sandbox uid) succeeds here."""
    if shutil.which("bwrap") is None:
        return False
    work = tempfile.mkdtemp(prefix="bwrap-probe-")
    try:
        uid = sandbox_uid()
        if uid is not None:
            os.chown(work, uid, uid)
        argv = _bwrap_argv(python, work) + [python, "-I", "-c", "import os; print(os.getcwd())"]
        out = subprocess.run(argv, capture_output=True, timeout=20, user=uid, group=uid,
                             extra_groups=[] if uid is not None else None, env={"PATH": "/usr/bin:/bin"})
        return out.returncode == 0 and out.stdout.strip() == MOUNT_POINT.encode()
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(work, ignore_errors=True)


def choose_backend(cfg: SandboxConfig) -> str:
    """``"bwrap"`` or ``"plain"`` for ``cfg.backend``.

    Raises:
        SandboxUnavailable: ``backend="bwrap"`` or ``require_bwrap`` while bubblewrap does not work here.
    """
    if cfg.backend == "plain" and not cfg.require_bwrap:
        return "plain"
    if bwrap_available(sandbox_python(cfg)):
        return "bwrap"
    if cfg.backend == "bwrap" or cfg.require_bwrap:
        raise SandboxUnavailable(
            f"sandbox.backend={cfg.backend!r} / require_bwrap={cfg.require_bwrap}: bubblewrap (bwrap) is "
            "missing or cannot create namespaces here; install it (Debian: apt-get install -y bubblewrap)"
        )
    return "plain"


def find_run_processes(key: str, value: str) -> list[psutil.Process]:
    """Live processes whose initial environment holds ``key=value`` (readable ones only)."""
    want = f"{key}={value}".encode()
    found = []
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    found.append(psutil.Process(pid))
        except (OSError, psutil.Error):
            continue
    return found


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (via ``kill(-1)`` in a helper that runs as that uid; root only)."""
    try:
        subprocess.run(["/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable,
                        "-I", "-S", "-c", "import os; os.kill(-1, 9)"],
                       user=uid, group=uid, extra_groups=[], env={}, timeout=10,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        pass


def _uid_processes(uid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["uids"]):
        try:
            if p.info["uids"] and p.info["uids"].real == uid and _is_live(p):
                out.append(p)
        except psutil.Error:
            continue
    return out


def kill_run(run_id: str | None = None, uid: int | None = None, pgid: int | None = None) -> int:
    """Kill everything of one run: its process group, then every live process of its uid (root only) or
    tagged with its run id. Returns how many processes were still alive after the group kill."""
    if pgid is not None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    victims: dict[int, psutil.Process] = {}
    if uid is not None:
        victims.update({p.pid: p for p in _uid_processes(uid)})
    if run_id is not None:
        victims.update({p.pid: p for p in find_run_processes(ENV_RUN, run_id)})
    victims.pop(pgid, None)
    _, alive = psutil.wait_procs(list(victims.values()), timeout=0.2)  # bwrap's init may still be exiting
    alive = [p for p in alive if _is_live(p)]
    if uid is not None and alive:
        _kill_uid(uid)
    _kill_and_wait(alive)
    return len(alive)


def _kill_and_wait(procs: list[psutil.Process], timeout: float = 2.0) -> None:
    """SIGKILL every process of ``procs`` (gone ones are fine) and wait up to ``timeout`` s for them."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def _is_live(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap_owner(owner_pid: int) -> int:
    """Kill every sandbox process started on behalf of process ``owner_pid`` (the runner calls this after it
    killed a verifier child that may have had a sandbox run in flight). Returns the number found."""
    victims = find_run_processes(ENV_OWNER, str(owner_pid))
    uid = sandbox_uid(owner_pid)
    if uid is not None:
        victims += [p for p in _uid_processes(uid) if p.pid not in {v.pid for v in victims}]
        if victims:
            _kill_uid(uid)
    _kill_and_wait(victims)
    return len(victims)


def _limits(cfg: SandboxConfig) -> list[tuple[str, int, int]]:
    mem = cfg.memory_mb * 2**20
    fsize = int(cfg.file_size_mb * 2**20)
    return [("RLIMIT_CPU", cfg.cpu_s, cfg.cpu_s + 1), ("RLIMIT_AS", mem, mem), ("RLIMIT_FSIZE", fsize, fsize),
            ("RLIMIT_NPROC", cfg.max_procs, cfg.max_procs), ("RLIMIT_NOFILE", 64, 64), ("RLIMIT_CORE", 0, 0)]


@dataclass
class _Run:
    """One started sandbox process and what is needed to end it."""

    proc: subprocess.Popen
    work: str
    uid: int | None
    run_id: str
    backend: str
    start: float
    deadline: float


def _time_limit(cfg: SandboxConfig, wall_s: float | None) -> float:
    limit = cfg.wall_s if wall_s is None else wall_s
    if CALL_DEADLINE is not None:
        limit = min(limit, CALL_DEADLINE - time.monotonic() - 0.25)
    return limit


def _start(code: str, cfg: SandboxConfig, mode: str, limit: float) -> _Run | SandboxResult:
    """Start ``code`` in a fresh sandbox (``mode`` ``"program"`` or ``"serve"``); a ``SandboxResult`` with
    status ``error`` when it could not start (the temp dir is then already gone)."""
    backend = choose_backend(cfg)
    python = sandbox_python(cfg)
    uid = sandbox_uid()
    run_id = secrets.token_hex(8)
    work = tempfile.mkdtemp(prefix="sbx-", dir=cfg.tmp_root)
    start = time.monotonic()
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
        launcher_cfg = {"mode": mode, "limits": _limits(cfg), "guard": backend == "plain",
                        "pdeathsig": backend == "plain", "parent": os.getpid()}
        cmd = [python, "-I", "-B", "-c", LAUNCHER, json.dumps(launcher_cfg)]
        if backend == "bwrap":
            argv = _bwrap_argv(python, work)
            for k, v in env.items():
                argv += ["--setenv", k, v]
            argv += ["--"] + cmd
        else:
            argv = cmd
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=work, env=env, user=uid, group=uid,
                                extra_groups=[] if uid is not None else None, start_new_session=True,
                                close_fds=True)
    except OSError as err:
        shutil.rmtree(work, ignore_errors=True)
        return SandboxResult("error", None, backend=backend, run_id=run_id, detail={"reason": repr(err)})
    return _Run(proc, work, uid, run_id, backend, start, start + limit)


def _stop(run: _Run) -> int:
    """Kill every process of ``run``, close its pipes, remove its temp dir; returns the leftovers killed."""
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
    shutil.rmtree(run.work, ignore_errors=True)
    return max(0, leftovers)


def _exit_status(run: _Run) -> tuple[str, int | None]:
    """``(status, returncode)`` of an ended run that hit no limit of ours."""
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
    limit = _time_limit(cfg, wall_s)
    if limit <= 0:
        return SandboxResult("timeout", None, backend=choose_backend(cfg),
                             detail={"reason": "no time left in the call"})
    run = _start(code, cfg, "program", limit)
    if isinstance(run, SandboxResult):
        return run
    return _execute(run, stdin, cfg)


def _execute(run: _Run, feed: str, cfg: SandboxConfig) -> SandboxResult:
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
    out, err = (bytes(b[:cap]) for b in bufs.values())  # stdout first, stderr second
    leftovers = _stop(run)
    feeder.join(timeout=1)
    ended, rc = _exit_status(run)
    return SandboxResult(status or ended, rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                         time.monotonic() - run.start, run.backend, leftovers, run.run_id)


# ---------------------------------------------------------------------------------------------------------
# Assert-style tests: the solution runs in the sandbox, the tests run here, and only plain data crosses.

MAX_MESSAGE_BYTES = 4 << 20  # one answer of the solution's harness (a call's result), bytes
MAX_DEPTH = 100  # nesting of one value
# Modules a solution's global may stand for in the tests' namespace (tests often use the solution's
# ``import math``): the judge binds its own, genuine copy of the module, never the solution's.
SAFE_MODULES = frozenset({
    "math", "cmath", "re", "string", "collections", "itertools", "functools", "heapq", "bisect", "operator",
    "fractions", "decimal", "statistics", "random", "copy", "typing", "json", "datetime", "time", "array",
    "numbers", "dataclasses", "enum", "string", "textwrap", "unicodedata", "calendar",
})


@dataclass(frozen=True)
class ModuleRef:
    """A global of the solution that is a module: only its name crosses (see ``SAFE_MODULES``)."""

    name: str


class ProtocolError(Exception):
    """The solution's harness answered something that is not a well-formed message of plain data."""


class SessionLost(BaseException):
    """The solution's process died, ran out of time, flooded its output or broke the protocol. A
    ``BaseException``, so that a test's ``except Exception`` does not take it for an expected error (a test
    during which the session was lost fails whatever the test does with it)."""


class RemoteError(Exception):
    """An exception raised by the solution whose type is not a built-in exception (message: its name)."""


class RemoteObject:
    """A value of the solution that is not plain data (a function, a class, an instance, a generator).

    Usable only through what cannot decide a verdict by itself: calling it, reading a public attribute and
    iterating over it (each one a request to the solution, answered with plain data or another remote object).
    It compares by identity, has no truth value and never runs the solution's ``__eq__``/``__bool__``/
    ``__contains__``/``__len__``: a solution whose answers are not plain data can only fail a comparison.
    """

    __slots__ = ("_session", "_id", "_type", "_callable")

    def __init__(self, session: "SolutionSession", ident: int, type_name: str, is_callable: bool):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_id", ident)
        object.__setattr__(self, "_type", type_name)
        object.__setattr__(self, "_callable", is_callable)

    def __call__(self, *args, **kwargs):
        return self._session.request_value({"op": "call", "h": self._id, "args": [encode_plain(a, self._session)
                                            for a in args], "kwargs": {str(k): encode_plain(v, self._session)
                                                                       for k, v in kwargs.items()}}, args)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in RemoteObject.__slots__:
            raise AttributeError(name)
        return self._session.request_value({"op": "getattr", "h": self._id, "name": name})

    def __setattr__(self, name, value):
        raise AttributeError("attributes of the solution's objects cannot be set from the tests")

    def __iter__(self):
        return _RemoteIterator(self)

    def __bool__(self):
        raise TypeError(f"the truth value of the solution's {self._type} object is not trusted")

    def __repr__(self) -> str:
        return f"<solution {self._type} #{self._id}>"


class _RemoteIterator:
    __slots__ = ("_obj",)

    def __init__(self, obj: RemoteObject):
        self._obj = obj

    def __iter__(self):
        return self

    def __next__(self):
        session = self._obj._session
        return session.request_value({"op": "next", "h": self._obj._id})


def encode_plain(value: Any, session: "SolutionSession | None" = None, depth: int = 0) -> Any:
    """``value`` (plain data from a test: None, bool, int, float, str, bytes, complex, and lists, tuples,
    dicts, sets of these) in the channel's JSON form; a ``RemoteObject`` of ``session`` as its handle.

    Raises:
        TypeError: anything else (a lambda, a local class instance...): only plain data crosses the sandbox.
    """
    if depth > MAX_DEPTH:
        raise TypeError("value nested too deeply to send to the solution")
    d = depth + 1
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, list):
        return [encode_plain(x, session, d) for x in value]
    if isinstance(value, tuple):
        return {"$t": [encode_plain(x, session, d) for x in value]}
    if isinstance(value, dict):
        return {"$d": [[encode_plain(k, session, d), encode_plain(x, session, d)] for k, x in value.items()]}
    if isinstance(value, (set, frozenset)):
        return {"$fs" if isinstance(value, frozenset) else "$s": [encode_plain(x, session, d) for x in value]}
    if isinstance(value, (bytes, bytearray)):
        return {"$b": bytes(value).decode("latin-1")}
    if isinstance(value, complex):
        return {"$c": [value.real, value.imag]}
    if isinstance(value, RemoteObject):
        if value._session is not session:
            raise TypeError(f"{value!r} belongs to an earlier run of the solution")
        return {"$h": value._id}
    raise TypeError(f"cannot pass a {type(value).__name__} to the solution: only plain data crosses the sandbox")


_TAGS = {"$t", "$d", "$s", "$fs", "$b", "$c", "$h", "$m"}


def decode_plain(x: Any, session: "SolutionSession | None" = None, depth: int = 0) -> Any:
    """A channel JSON value (as ``json.loads`` returns it) as genuine built-in objects: the inverse of
    ``encode_plain``; a handle becomes a ``RemoteObject`` of ``session``.

    Raises:
        ProtocolError: anything that is not a well-formed value (unknown tag, wrong field types, unhashable
            set members or dict keys, nesting deeper than ``MAX_DEPTH``, or a handle without a session).
    """
    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    d = depth + 1
    if t is list:
        return [decode_plain(e, session, d) for e in x]
    if t is not dict:
        raise ProtocolError(f"unexpected JSON type {t.__name__}")
    keys = set(x)
    tags = keys & _TAGS
    if len(tags) != 1:
        raise ProtocolError("a JSON object must carry exactly one type tag")
    tag = tags.pop()
    val = x[tag]
    try:
        if tag == "$h":
            if session is None or type(val) is not int or not keys <= {"$h", "type", "callable"}:
                raise ProtocolError("malformed handle")
            return RemoteObject(session, val, str(x.get("type", "object"))[:80], bool(x.get("callable")))
        if len(keys) != 1:
            raise ProtocolError(f"unexpected fields next to {tag}")
        if tag == "$m":
            raise ProtocolError("a module is not a value")
        if tag == "$b":
            if type(val) is not str:
                raise ProtocolError("bytes must be a latin-1 string")
            return val.encode("latin-1")
        if type(val) is not list:
            raise ProtocolError(f"{tag} needs a list")
        if tag == "$c":
            if len(val) != 2 or not all(type(v) in (int, float) for v in val):
                raise ProtocolError("complex needs two numbers")
            return complex(float(val[0]), float(val[1]))
        items = [decode_plain(e, session, d) for e in val]
        if tag == "$t":
            return tuple(items)
        if tag == "$s":
            return set(items)
        if tag == "$fs":
            return frozenset(items)
        pairs = []
        for pair in items:
            if type(pair) is not list or len(pair) != 2:
                raise ProtocolError("dict items must be [key, value] pairs")
            pairs.append(pair)
        return dict(pairs)
    except (TypeError, UnicodeEncodeError, OverflowError) as err:  # unhashable key/member, non-latin-1 bytes
        raise ProtocolError(f"malformed {tag}: {type(err).__name__}") from None


def _remote_exception(detail: Any) -> BaseException:
    """The exception to raise in the tests for one the solution raised: the built-in exception of that name
    (``ValueError``, ``KeyError``...), else ``RemoteError``."""
    if type(detail) is not dict:
        return ProtocolError("malformed exception report")
    name, msg = str(detail.get("exc", ""))[:80], str(detail.get("msg", ""))[:300]
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, StopIteration):
        try:
            return cls(msg)
        except Exception:  # noqa: BLE001 - exceptions with required arguments (UnicodeDecodeError...)
            pass
    return RemoteError(f"{name}: {msg}" if msg else name)


class SolutionSession:
    """One sandbox run holding the solution, answering requests over its stdin/stdout.

    The solution is loaded with ``__name__ == "solution"`` (a ``if __name__ == "__main__":`` block does not
    run); its prints go to stderr (kept, capped at ``cfg.max_output_kb``). After loading, the harness sends
    the solution's globals: plain values as data, modules by name, everything else as handles. Every request
    and answer is one line of JSON; answers are decoded by ``decode_plain`` (built-in types only).

    Attributes:
        exports: the solution's globals (name -> plain value, ``RemoteObject`` or ``ModuleRef``), empty when
            it did not load.
        load_error: ``"TypeName: message"`` when loading the solution raised, else None.
        status: ``"ok"`` while alive; afterwards why it ended (``timeout``, ``output_limit``, ``protocol``,
            ``exit``, ``killed``, ``cpu_limit``, ``load_error``, ``error``).
        lost: True once the session is unusable (any status other than ``ok``).
    """

    def __init__(self, code: str, cfg: SandboxConfig, deadline: float):
        self.cfg = cfg
        self.exports: dict[str, Any] = {}
        self.load_error: str | None = None
        self.status = "ok"
        self.lost = False
        self.detail: dict[str, Any] = {}
        self._rbuf = bytearray()
        self._err = bytearray()
        self._wbuf = b""
        self._writing = False
        self._sel: selectors.BaseSelector | None = None
        run = _start(code, cfg, "serve", deadline - time.monotonic())
        if isinstance(run, SandboxResult):
            self.run = None
            self.backend = run.backend
            self.run_id = run.run_id
            self.status, self.lost, self.detail = "error", True, dict(run.detail)
            return
        self.run = run
        self.backend = run.backend
        self.run_id = run.run_id
        self._sel = selectors.DefaultSelector()
        for stream in (run.proc.stdin, run.proc.stdout, run.proc.stderr):
            os.set_blocking(stream.fileno(), False)
        self._sel.register(run.proc.stdout, selectors.EVENT_READ, "out")
        self._sel.register(run.proc.stderr, selectors.EVENT_READ, "err")
        try:
            msg = self._receive()
        except SessionLost:
            return
        if type(msg) is dict and "load_error" in msg:
            err = msg["load_error"] if type(msg["load_error"]) is dict else {}
            self.load_error = f"{str(err.get('exc', '?'))[:80]}: {str(err.get('msg', ''))[:200]}"
            self._lose("load_error")
            return
        if type(msg) is not dict or type(msg.get("ready")) is not dict:
            self._lose("protocol", "no ready message")
            return
        for name, raw in msg["ready"].items():
            try:
                if type(raw) is dict and set(raw) == {"$m"}:
                    self.exports[name] = ModuleRef(str(raw["$m"])[:100])
                else:
                    self.exports[name] = decode_plain(raw, self)
            except ProtocolError:
                continue

    def _lose(self, status: str, why: str = "") -> None:
        """Mark the session lost with ``status`` (the first reason wins) and end its run."""
        if not self.lost:
            if status == "exit" and self.run is not None and self.run.proc.poll() is not None:
                ended, _ = _exit_status(self.run)  # it ended by itself: say how
                status = ended if ended != "ok" else "exit"
            self.status, self.lost = status, True
            if why:
                self.detail["reason"] = why
        if self.run is not None and self._sel is not None:
            self._sel.close()
            self._sel = None
            self.detail["leftover_killed"] = _stop(self.run)
            self.detail["returncode"] = self.run.proc.returncode

    def _receive(self) -> Any:
        """Pump the pipes until the pending request is written and one answer line has arrived; decode its
        JSON. Raises SessionLost (after ending the session) on timeout, death, flood or garbage."""
        if self.lost:
            raise SessionLost(self.status)
        run = self.run
        while True:
            if not self._wbuf:
                nl = self._rbuf.find(b"\n")
                if nl >= 0:
                    line = bytes(self._rbuf[:nl])
                    del self._rbuf[:nl + 1]
                    try:
                        return json.loads(line)
                    except (ValueError, RecursionError):
                        self._lose("protocol", "an answer is not JSON")
                        raise SessionLost(self.status) from None
            if len(self._rbuf) > MAX_MESSAGE_BYTES:
                self._lose("protocol", f"an answer longer than {MAX_MESSAGE_BYTES} bytes")
                raise SessionLost(self.status)
            now = time.monotonic()
            if now >= run.deadline:
                self._lose("timeout")
                raise SessionLost(self.status)
            if run.proc.poll() is not None:  # the solution's process ended: take what it wrote, then stop
                self._pump(0.0)
                if self._wbuf or b"\n" not in self._rbuf:
                    self._lose("exit")
                    raise SessionLost(self.status)
                continue
            self._pump(min(0.05, run.deadline - now))

    def _pump(self, wait_s: float) -> None:
        """One round of non-blocking I/O: write pending request bytes, read answers and the solution's output
        (which is capped at ``cfg.max_output_kb``)."""
        sel, proc = self._sel, self.run.proc
        if bool(self._wbuf) != self._writing:
            if self._wbuf:
                sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
            else:
                sel.unregister(proc.stdin)
            self._writing = bool(self._wbuf)
        for key, _ in sel.select(timeout=wait_s):
            if key.data == "in":
                try:
                    n = os.write(key.fd, self._wbuf[:65536])
                    self._wbuf = self._wbuf[n:]
                except BlockingIOError:
                    pass
                except OSError:  # the solution closed its end of the channel
                    self._lose("exit", "the solution closed its channel")
                    raise SessionLost(self.status) from None
                continue
            try:
                chunk = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(key.fileobj)
                if key.data == "out":
                    self._lose("exit", "the solution closed its channel")
                    raise SessionLost(self.status)
                continue
            if key.data == "out":
                self._rbuf += chunk
            else:
                self._err += chunk
                if len(self._err) > self.cfg.max_output_kb * 1024:
                    self._lose("output_limit")
                    raise SessionLost(self.status)

    def request_value(self, msg: dict, args: tuple = ()) -> Any:
        """Send one request (``call``, ``getattr``, ``next``) and return its answer as plain data or a
        ``RemoteObject``. For ``call``, positional list/dict/set arguments the solution changed in place are
        updated here too.

        Raises:
            SessionLost: the session ended (see the class docstring); the current test fails.
            StopIteration: ``next`` on an exhausted iterator.
            Exception: the built-in exception the solution raised (``RemoteError`` for its own types).
        """
        if self.lost:
            raise SessionLost(self.status)
        self._wbuf = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
        answer = self._receive()
        try:
            if type(answer) is not dict:
                raise ProtocolError("an answer must be a JSON object")
            if "exc" in answer:
                raise _remote_exception(answer)
            if answer.get("stop") is True:
                raise StopIteration
            if "ok" not in answer:
                raise ProtocolError("an answer needs 'ok', 'exc' or 'stop'")
            value = decode_plain(answer["ok"], self)
            post = answer.get("post")
            if post is not None:
                if type(post) is not list or len(post) != len(args):
                    raise ProtocolError("'post' must have one entry per argument")
                for arg, new in zip(args, post):
                    if new is None or type(arg) not in (list, dict, set):
                        continue
                    new = decode_plain(new, self)
                    if type(new) is not type(arg):
                        raise ProtocolError("an argument changed type")
                    if type(arg) is list:
                        arg[:] = new
                    else:
                        arg.clear()
                        arg.update(new)
            return value
        except ProtocolError as err:
            self._lose("protocol", str(err))
            raise SessionLost(self.status) from None

    @property
    def stderr(self) -> str:
        """What the solution printed (its stdout and stderr), decoded, at most ``cfg.max_output_kb``."""
        return bytes(self._err[: self.cfg.max_output_kb * 1024]).decode("utf-8", "replace")

    def close(self) -> None:
        """End the session: kill every process of its run and remove its temp dir (idempotent)."""
        if not self.lost:
            self.status = "ok"
            self.lost = True
        if self.run is not None and self._sel is not None:
            self._sel.close()
            self._sel = None
            self.detail["leftover_killed"] = _stop(self.run)


def _bind_exports(session: SolutionSession, ns: dict, previous: dict[str, Any]) -> dict[str, Any]:
    """Put the solution's globals into the tests' namespace ``ns``: plain values and remote objects, and for a
    module the judge's own copy when it is one of ``SAFE_MODULES``. Names of built-ins are never bound (a
    solution's ``def abs`` must not change what the tests' ``abs`` does), nor dunder names. On a restarted
    session, a name is rebound only if it still holds what the last session gave it (``previous``).
    Returns what was bound."""
    bound = {}
    for name, value in session.exports.items():
        if not name.isidentifier() or name.startswith("__") or hasattr(builtins, name):
            continue
        if name in ns and (name not in previous or ns[name] is not previous[name]):
            continue  # a name the tests defined themselves
        if isinstance(value, ModuleRef):
            if value.name not in SAFE_MODULES:
                continue
            try:
                value = importlib.import_module(value.name)
            except ImportError:
                continue
        ns[name] = bound[name] = value
    return bound


def run_python_tests(code: str, tests: list, cfg: SandboxConfig) -> tuple[int, int, dict]:
    """Run ``code`` against ``tests`` in the sandbox; returns ``(passed, total, info)``.

    Args:
        code: the solution (Python source).
        tests: Python snippets (``"assert f(2) == 4"``; a snippet passes when it raises nothing), or
            ``{"input": str, "output": str}`` pairs (one sandbox run each; passes when the run exits 0 and its
            stripped stdout equals the stripped expected output, compared here).
        cfg: limits and backend; all snippets together share ``cfg.wall_s``.

    Snippets never run in the solution's interpreter. The solution runs in a ``SolutionSession``; the
    snippets run here, in the caller's process, in one namespace holding the solution's globals as plain
    values and ``RemoteObject``s. What the solution can influence is the plain data its functions return,
    decoded here into built-in types: comparisons, ``abs``, ``isinstance``, ``math.isclose`` and the verdict
    itself are the judge's own. A snippet fails when it raises, and also when the session was lost while it
    ran (death, timeout, output flood, broken protocol), whatever the snippet did with the error; the next
    snippet then gets a fresh session, while time is left. A solution that does not load fails every snippet.
    Snippets are trusted input (they come with the dataset, like a user verifier).

    ``info`` holds ``backend``, ``sandbox`` (status of the first session that ended badly, ``load_error``
    when the solution did not load, else ``"ok"``), ``stderr`` (a short tail), ``sessions`` (sandbox runs
    started) and ``failed`` (the first few failing snippets as ``[index, reason]``).

    Raises:
        ValueError: ``tests`` is not a non-empty list, or a test is neither a string nor an input/output dict.
        SandboxUnavailable: bubblewrap required but missing.
    """
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"tests must be a non-empty list, got {tests!r}"[:300])
    total = len(tests)
    if all(isinstance(t, str) for t in tests):
        return _run_snippets(code, tests, cfg)
    passed, first_bad, backend, stderr = 0, "ok", "", ""
    for i, t in enumerate(tests):
        if not (isinstance(t, dict) and "input" in t and "output" in t):
            raise ValueError(f"code test {i} must be a string or an {{'input', 'output'}} dict, got {t!r}"[:300])
    for t in tests:
        res = run_python(code, cfg, stdin=str(t["input"]))
        backend = res.backend
        good = res.status == "ok" and res.stdout.strip() == str(t["output"]).strip()
        passed += good
        if not good and first_bad == "ok":
            first_bad, stderr = res.status, res.stderr[-300:]
    return passed, total, {"backend": backend, "sandbox": first_bad, "stderr": stderr}


def _run_snippets(code: str, tests: list[str], cfg: SandboxConfig) -> tuple[int, int, dict]:
    limit = _time_limit(cfg, None)
    deadline = time.monotonic() + limit
    ns: dict[str, Any] = {"__builtins__": builtins, "__name__": "__tests__"}
    results = [False] * len(tests)
    failed: list[list] = []
    session: SolutionSession | None = None
    bound: dict[str, Any] = {}
    first_bad, stderr, sessions, backend = "ok", "", 0, choose_backend(cfg)

    def note(sess: SolutionSession) -> None:
        nonlocal first_bad, stderr
        if sess.status != "ok" and first_bad == "ok":
            first_bad = sess.status
            stderr = (sess.load_error + "\n" if sess.load_error else "") + sess.stderr[-300:]

    try:
        for i, test in enumerate(tests):
            if session is None or session.lost:
                if session is not None:
                    note(session)
                    if session.load_error is not None:
                        failed.append([i, "solution did not load"])
                        break
                if time.monotonic() >= deadline - 0.05:
                    failed.append([i, "no time left"])
                    first_bad = "timeout" if first_bad == "ok" else first_bad
                    break
                session = SolutionSession(code, cfg, deadline)
                sessions += 1
                backend = session.backend
                if session.lost:
                    note(session)
                    failed.append([i, "solution did not load" if session.load_error else session.status])
                    break
                bound = _bind_exports(session, ns, bound)
            try:
                exec(compile(test, f"<test {i}>", "exec"), ns)
                ok, why = True, ""
            except SessionLost as err:
                ok, why = False, f"session lost: {err}"
            except BaseException as err:  # noqa: BLE001 - every failure of a snippet is a failed test
                ok, why = False, type(err).__name__
            if session.lost and ok:
                ok, why = False, f"session lost: {session.status}"
            results[i] = ok
            if not ok and len(failed) < 10:
                failed.append([i, why])
    finally:
        if session is not None:
            session.close()
            note(session)
            if first_bad == "ok":
                stderr = session.stderr[-300:]
    return sum(results), len(tests), {"backend": backend, "sandbox": first_bad, "stderr": stderr,
                                      "sessions": sessions, "failed": failed[:10]}
