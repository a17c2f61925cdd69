"""The verifier fork server: ``python -m reward._forkserver``, started and spoken to by ``reward.runner``.

A clean single-threaded process (no Ray, no gRPC threads) that imports the verifiers once, warms
math-verify, then for each batch of calls forks one child per call (at most ``parallel`` alive), enforces
each call's wall-clock limit by killing the child's whole process group, and answers with the outcomes.

Protocol on stdin/stdout: frames of an 8-byte big-endian length and a pickle.
    in:  {"sys_path": [...], "preload": [...], "memory_mb": int}     out: "ready"
    in:  {"import": [module, ...]}                                    out: {module: error} (failed ones)
    in:  {"calls": [pickled (fn, response, row), ...], "timeout_s": float, "parallel": int}
    out: [(status, value, detail, elapsed_s), ...]  in call order
"""

from __future__ import annotations

import importlib
import os
import pickle
import selectors
import signal
import struct
import sys
import time

_MAX_TEXT = 500
_MAX_RESULT = 1 << 20  # bytes a child may send back


def read_frame(fd: int) -> bytes | None:
    """One frame from ``fd`` (blocking), or None at end of file."""
    head = _read_exact(fd, 8)
    if head is None:
        return None
    body = _read_exact(fd, struct.unpack(">Q", head)[0])
    if body is None:
        return None
    return body


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def write_frame(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(struct.pack(">Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def plain(value, depth: int = 0):
    """A small, picklable copy of a verifier's return value (long strings cut, unknown types repr'd)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value[:_MAX_TEXT]
    if depth < 2 and isinstance(value, dict):
        return {str(k)[:100]: plain(v, depth + 1) for k, v in list(value.items())[:32]}
    if depth < 2 and isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in list(value)[:32]]
    try:
        return float(value)  # numpy / torch scalars
    except (TypeError, ValueError):
        return repr(value)[:_MAX_TEXT]


def _prctl_pdeathsig() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(blob: bytes, wfd: int, deadline: float, memory_mb: int) -> None:
    """Body of one forked call; never returns."""
    code = 0
    try:
        os.setsid()
        _prctl_pdeathsig()
        if memory_mb:
            import resource

            lim = memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        from reward import sandbox

        sandbox.CALL_DEADLINE = deadline
        try:
            fn, response, row = pickle.loads(blob)
            msg = ("ok", plain(fn(response, row)))
        except BaseException as err:  # noqa: BLE001 - every failure is an outcome
            msg = ("error", {"error": type(err).__name__, "message": str(err)[:_MAX_TEXT]})
        try:
            data = pickle.dumps(msg)
        except Exception as err:  # noqa: BLE001
            data = pickle.dumps(("error", {"error": type(err).__name__, "message": "result not picklable"}))
        view = memoryview(data[:_MAX_RESULT])
        while view:
            view = view[os.write(wfd, view):]
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        os._exit(code)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_batch(blobs: list[bytes], timeout_s: float, parallel: int, memory_mb: int) -> list[tuple]:
    """Outcomes ``(status, value, detail, elapsed_s)`` of ``blobs`` (pickled calls), in order.

    A call ends when its child process exits (seen through a pidfd, so a grandchild that inherited the result
    pipe cannot hold it open) or when its time is up; either way its whole process group is killed.
    """
    from reward.sandbox import reap_owner

    outcomes: list[tuple | None] = [None] * len(blobs)
    todo = list(range(len(blobs)))[::-1]
    active: dict[int, dict] = {}  # index -> {pid, pidfd, r, start, buf}
    sel = selectors.DefaultSelector()

    def finish(i: int, outcome_if_silent: tuple | None) -> None:
        a = active.pop(i)
        sel.unregister(a["pidfd"])
        if a["r_open"]:
            sel.unregister(a["r"])
        _kill_group(a["pid"])
        try:
            os.kill(a["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(a["pid"], 0)
        os.set_blocking(a["r"], False)
        try:
            while chunk := os.read(a["r"], 1 << 16):
                a["buf"] += chunk
        except BlockingIOError:
            pass
        os.close(a["r"])
        os.close(a["pidfd"])
        elapsed = time.monotonic() - a["start"]
        if outcome_if_silent is not None:  # timed out
            reap_owner(a["pid"])
            outcomes[i] = outcome_if_silent[:3] + (elapsed,)
            return
        try:
            kind, payload = pickle.loads(bytes(a["buf"]))
            outcomes[i] = (kind, payload if kind == "ok" else None, {} if kind == "ok" else payload, elapsed)
        except Exception:  # noqa: BLE001 - died before answering
            reap_owner(a["pid"])
            detail = {"error": "VerifierDied", "wait_status": status}
            if os.WIFSIGNALED(status):
                detail["signal"] = os.WTERMSIG(status)
            outcomes[i] = ("error", None, detail, elapsed)

    while todo or active:
        while todo and len(active) < parallel:
            i = todo.pop()
            r, w = os.pipe()
            start = time.monotonic()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(blobs[i], w, start + timeout_s, memory_mb)
            os.close(w)
            pidfd = os.pidfd_open(pid)
            active[i] = {"pid": pid, "pidfd": pidfd, "r": r, "start": start, "buf": bytearray(),
                         "r_open": True}
            sel.register(r, selectors.EVENT_READ, ("r", i))
            sel.register(pidfd, selectors.EVENT_READ, ("p", i))
        nearest = min(a["start"] + timeout_s for a in active.values())
        for key, _ in sel.select(timeout=max(0.0, nearest - time.monotonic())):
            kind, i = key.data
            if i not in active:
                continue
            if kind == "p":
                finish(i, None)
                continue
            chunk = os.read(key.fd, 1 << 16)
            if chunk:
                active[i]["buf"] += chunk
            else:  # end of file: wait for the pidfd
                sel.unregister(key.fd)
                active[i]["r_open"] = False
        now = time.monotonic()
        for i in [i for i, a in active.items() if now >= a["start"] + timeout_s]:
            finish(i, ("timeout", None, {"timeout_s": timeout_s}))
    sel.close()
    return outcomes  # type: ignore[return-value]


def serve() -> None:
    """Main loop (stdin/stdout frames, see the module docstring)."""
    _prctl_pdeathsig()
    rfd, wfd = sys.stdin.fileno(), sys.stdout.fileno()
    # keep protocol fds private: verifier output goes to stderr, never into the frames
    rfd, wfd = os.dup(rfd), os.dup(wfd)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    hello = read_frame(rfd)
    if hello is None:
        return
    setup = pickle.loads(hello)
    sys.path[:] = setup["sys_path"]
    for mod in setup["preload"]:
        importlib.import_module(mod)
    write_frame(wfd, "ready")
    while True:
        frame = read_frame(rfd)
        if frame is None:
            return
        req = pickle.loads(frame)
        if "import" in req:
            failed = {}
            for mod in req["import"]:
                try:
                    importlib.import_module(mod)
                except BaseException as err:  # noqa: BLE001 - reported, the server keeps serving
                    failed[mod] = f"{type(err).__name__}: {err}"[:_MAX_TEXT]
            write_frame(wfd, failed)
            continue
        write_frame(wfd, run_batch(req["calls"], req["timeout_s"], req["parallel"], setup["memory_mb"]))


if __name__ == "__main__":
    serve()
