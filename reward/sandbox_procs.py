"""The processes of sandbox runs (``reward.sandbox``): the tags and the uid they carry, and finding, killing and
reaping them.

A run's processes carry ``GSPO_SANDBOX_RUN=<run id>`` and ``GSPO_SANDBOX_OWNER=<pid of the process that started
it>`` in their initial environment and, when we are root, run as the owner's dedicated uid (``sandbox_uid``).
The owner is the child subreaper of its runs (``adopt_orphans``, root only), so a run's processes orphaned when
it is killed become the owner's children and are reaped here, also where PID 1 does not reap.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys

import psutil

UID_BASE = 200_000  # dedicated sandbox uids (root only): UID_BASE + owner_pid % UID_SPAN
UID_SPAN = 60_000
ENV_RUN = "GSPO_SANDBOX_RUN"
ENV_OWNER = "GSPO_SANDBOX_OWNER"
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h

log = logging.getLogger(__name__)
_subreaper_pid: int | None = None  # the process that made itself the subreaper of its runs (adopt_orphans)

def sandbox_uid(owner_pid: int | None = None) -> int | None:
    """The dedicated uid of sandbox runs started by process ``owner_pid`` (default: this one), or None when
    this process is not root (then runs keep our uid)."""
    if os.geteuid() != 0:
        return None
    return UID_BASE + (owner_pid if owner_pid is not None else os.getpid()) % UID_SPAN


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
    if uid is not None:
        reap_children(keep={pgid} if pgid is not None else set(), uid=uid)
    return len(alive)


def adopt_orphans() -> None:
    """Make this process the child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``) of the processes it
    starts; once per process, root only (``start_run`` and the verifiers' fork server call it). A sandbox run's
    processes orphaned when the run is killed then become this process's children, and ``kill_run`` (or the
    fork server, ``reap_children``) reaps them. Without it they go to PID 1, and where PID 1 does not reap (a
    container's or a microVM's init), their zombies stay and count against the sandbox uid's
    ``RLIMIT_NPROC``: a later run of the same owner then fails to fork (EAGAIN)."""
    global _subreaper_pid
    if _subreaper_pid == os.getpid() or sandbox_uid() is None:
        return
    _subreaper_pid = os.getpid()  # the attribute is not inherited over fork: a forked child sets its own
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("sandbox: prctl(PR_SET_CHILD_SUBREAPER) failed (errno %d)", ctypes.get_errno())
    except (OSError, AttributeError) as err:  # not Linux/glibc
        log.warning("sandbox: cannot become the subreaper of sandbox runs: %r", err)


def reap_children(keep: set[int], uid: int | None = None) -> None:
    """Kill and reap this process's children (of ``uid`` only, when given), zombies included, but those in
    ``keep`` (children their owner still waits for: a run's own ``Popen``, a fork server's live verifiers).
    The others are a run's processes orphaned when it was killed, which ``adopt_orphans`` made ours."""
    adopted = []
    for p in psutil.Process().children():
        try:
            if p.pid not in keep and (uid is None or p.uids().real == uid):
                adopted.append(p)
        except psutil.Error:
            continue
    _kill_and_wait(adopted)


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
