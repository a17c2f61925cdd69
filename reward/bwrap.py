"""The bubblewrap (``bwrap``) backend of the code sandbox: its command line, its probe, and its scratch space.

A run's file system holds ``/usr`` (and the interpreter's prefix) read-only, ``/proc``, a minimal ``/dev``
and one writable place: a tmpfs of ``scratch_bytes`` at ``/sandbox`` (the working directory, ``HOME`` and
``TMPDIR``; ``/tmp`` is a link to it), with the program's ``main.py`` bound read-only into it. The root and
``/dev`` are remounted read-only (bubblewrap's own tmpfs for them would otherwise be writable and unbounded:
there is no ``/dev/shm``), and new user namespaces are disabled inside (``--disable-userns``), so the
solution cannot mount a tmpfs of its own. Everything it writes is therefore in kernel memory bounded by
``scratch_bytes``, counted by the kernel, and freed when the run's mount namespace goes: nothing lands on the
host's disk.

The scratch tmpfs is watched from outside: ``start`` makes bubblewrap wait (``--block-fd``) until this
process has opened the run's ``/sandbox`` through ``/proc/<pid>/root`` (``--info-fd`` gives the pid), so
that ``is_full`` can read its usage at any time, also after the run's processes ended, until the
descriptor is closed.

Needs bubblewrap 0.8 or newer (``--size``, ``--disable-userns``), unprivileged (not setuid: bubblewrap
refuses ``--size`` in setuid mode). Debian 12 and Ubuntu 24.04 ship it (``apt-get install -y bubblewrap``).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time

from reward.cleanup import remove_tree

MOUNT_POINT = "/sandbox"
FULL_SLACK_BYTES = 64 * 1024  # a scratch space with less than this free is full
PROBE_SCRATCH_BYTES = 1 << 20


def executable() -> str | None:
    """Absolute path of ``bwrap`` on this process's ``PATH`` (runs get a minimal ``PATH``), or None."""
    found = shutil.which("bwrap")
    return os.path.realpath(found) if found else None


def argv(python: str, workdir: str, scratch_bytes: int) -> list[str]:
    """The ``bwrap`` command line of one run, up to (not including) ``--`` and the command (``start`` adds the
    descriptors it talks to bubblewrap through).

    Args:
        python: the interpreter that will run in the sandbox (its prefix is bound read-only when outside /usr).
        workdir: host directory holding ``main.py`` (bound read-only at ``/sandbox/main.py``).
        scratch_bytes: size of the writable tmpfs at ``/sandbox``, bytes.
    """
    cmd = [executable() or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
           "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    if prefix not in ("/usr", "/") and not prefix.startswith("/usr/"):
        cmd += ["--ro-bind", prefix, prefix]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(int(scratch_bytes)), "--tmpfs", MOUNT_POINT,
            "--ro-bind", os.path.join(workdir, "main.py"), f"{MOUNT_POINT}/main.py",
            "--symlink", MOUNT_POINT, "/tmp", "--remount-ro", "/dev", "--remount-ro", "/",
            "--chdir", MOUNT_POINT, "--clearenv"]
    return cmd


def start(cmd: list[str], scratch_bytes: int, deadline: float, **popen) -> tuple[subprocess.Popen, int]:
    """Start ``cmd`` (``argv(...) + ["--setenv", ...] + ["--", command...]``) and open its scratch space.

    Bubblewrap sets the sandbox up and then waits on the block descriptor; meanwhile the pid it reports on
    the info descriptor gives the run's ``/sandbox`` as ``/proc/<pid>/root/sandbox``, which is opened here
    (and checked to be the tmpfs of ``scratch_bytes``) before the command may start: nothing of the
    solution runs before the descriptor is held. ``popen`` goes to ``subprocess.Popen``.

    Returns:
        ``(process, scratch descriptor)``; the caller closes the descriptor when the run is over.

    Raises:
        OSError: bubblewrap did not start, ended before reporting, or its scratch did not appear before
            ``deadline`` (``time.monotonic()``); the process is killed and waited for then.
    """
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    proc = None
    try:
        full = cmd[:1] + ["--info-fd", str(info_w), "--block-fd", str(block_r)] + cmd[1:]
        proc = subprocess.Popen(full, pass_fds=(info_w, block_r), **popen)
        os.close(info_w)
        os.close(block_r)
        info_w = block_r = -1
        fd = _open_scratch(proc, _child_pid(info_r, deadline), scratch_bytes, deadline)
        os.write(block_w, b"1")
        return proc, fd
    except BaseException:
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        raise
    finally:
        for f in (info_r, info_w, block_r, block_w):
            if f >= 0:
                os.close(f)


def _child_pid(info_r: int, deadline: float) -> int:
    buf = b""
    while True:
        if not select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise OSError("bubblewrap did not report its child in time")
        chunk = os.read(info_r, 4096)
        if not chunk:
            raise OSError(f"bubblewrap ended before reporting its child: {buf[:200]!r}")
        buf += chunk
        try:
            return int(json.loads(buf)["child-pid"])
        except ValueError:
            continue
        except (KeyError, TypeError):
            raise OSError(f"bubblewrap's info is not understood: {buf[:200]!r}") from None


def _open_scratch(proc: subprocess.Popen, pid: int, scratch_bytes: int, deadline: float) -> int:
    path = f"/proc/{pid}/root{MOUNT_POINT}"
    while True:
        if proc.poll() is not None:
            raise OSError(f"bubblewrap exited with {proc.returncode} while setting the sandbox up")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            st = os.fstatvfs(fd)
            if st.f_blocks * st.f_frsize == _rounded(scratch_bytes, st.f_frsize):
                return fd
            os.close(fd)  # the mount is not there yet: the host directory under it
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise OSError(f"the sandbox's scratch space {path} did not appear in time")
        time.sleep(0.001)


def _rounded(n: int, block: int) -> int:
    return -(-int(n) // block) * block


def is_full(scratch_fd: int) -> bool:
    """Whether the scratch tmpfs open as ``scratch_fd`` has less than ``FULL_SLACK_BYTES`` free (or no free
    inode)."""
    try:
        st = os.fstatvfs(scratch_fd)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_SLACK_BYTES or (st.f_files > 0 and st.f_favail == 0)


_probed: dict[str, str | None] = {}


def probe(python: str, uid: int | None) -> str | None:
    """Why bubblewrap cannot run sandboxes here (None when a probe run, with every option a run uses and as
    the sandbox uid ``uid``, prints ``/sandbox`` from inside): it is missing, too old, setuid, or namespaces
    are not allowed. Cached per process and ``python`` (not per uid: the verifier's forked children, each
    with a uid of its own, inherit the fork server's answer); ``probe.cache_clear()`` forgets it."""
    if python not in _probed:
        _probed[python] = _probe(python, uid)
    return _probed[python]


probe.cache_clear = _probed.clear  # type: ignore[attr-defined]


def _probe(python: str, uid: int | None) -> str | None:
    bwrap = executable()
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed"
    work = tempfile.mkdtemp(prefix="bwrap-probe-")
    err = tempfile.TemporaryFile()
    try:
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write("import os\nprint(os.getcwd())\n")
        if uid is not None:
            os.chown(work, uid, uid)
        os.chmod(work, 0o755)
        cmd = argv(python, work, PROBE_SCRATCH_BYTES) + ["--", python, "-I", "main.py"]
        proc, fd = start(cmd, PROBE_SCRATCH_BYTES, time.monotonic() + 20, stdout=subprocess.PIPE, stderr=err,
                         user=uid, group=uid, extra_groups=[] if uid is not None else None,
                         env={"PATH": "/usr/bin:/bin"})
        os.close(fd)
        out, _ = proc.communicate(timeout=20)
        if proc.returncode == 0 and out.strip() == MOUNT_POINT.encode():
            return None
        return f"{bwrap} failed its probe run (exit {proc.returncode}): {_tail(err)}"
    except (OSError, subprocess.SubprocessError) as why:
        return f"{bwrap} failed its probe run ({why}): {_tail(err)}"
    finally:
        err.close()
        remove_tree(work)


def _tail(f) -> str:
    f.seek(0)
    return f.read()[-300:].decode(errors="replace").strip()
