"""The verifier fork server: ``python -m reward._forkserver``, started and spoken to by ``reward.runner``.

A clean single-threaded process (no Ray, no gRPC threads) that imports the verifiers once, warms
math-verify, freezes its heap for the garbage collector (so forked children do not copy it page by page),
then for each batch of calls forks child processes that run the calls (at most ``parallel`` children alive),
enforces each call's wall-clock limit by killing the child's whole process group, and answers with the
outcomes.

Batching: a child runs a *chunk* of up to ``chunk_size`` calls one after the other and streams one result
frame per call as soon as that call is done, stamped with the (system-wide) monotonic time it ended; the
next call's time limit starts at that stamp. The server tracks the limit of the call each child is on. When
it expires, the child's process group is killed, that call is recorded as ``timeout``, and the chunk's
remaining calls go to a new child; a child that dies mid-call (a crash, ``os._exit``, the memory limit) costs
that call an ``error`` (``VerifierDied``) and its remaining calls likewise go to a new child. Every call gets
exactly one outcome: a result is taken only from the child running it, in chunk order, and each new child
starts with the first call that has none. ``chunk_size=1`` is a fresh process per call. Calls flagged
``alone`` always run in a child of their own.

Protocol on stdin/stdout: frames of an 8-byte big-endian length and a pickle.
    in:  {"sys_path": [...], "preload": [...], "memory_mb": int}     out: "ready"
    in:  {"import": [module, ...]}                                    out: {module: error} (failed ones)
    in:  {"calls": [pickled (fn, response, row), ...], "timeout_s": float, "parallel": int,
          "chunk_size": int, "alone": [bool, ...] (optional)}
    out: [(status, value, detail, elapsed_s), ...]  in call order
Child to server (one pipe per child): frames ``(call index, end time, status, payload)``.
"""

from __future__ import annotations

import gc
import importlib
import math
import os
import pickle
import selectors
import signal
import struct
import sys
import time
from collections import deque

from reward.infra import DETAIL_KEY, cause_of

_MAX_TEXT = 500
_MAX_RESULT = 1 << 20  # bytes of one call's result frame


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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_frame(fd: int, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    _write_all(fd, struct.pack(">Q", len(data)) + data)


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


def _error(err: BaseException, message: str | None = None) -> dict:
    out = {"error": type(err).__name__, "message": (message or str(err))[:_MAX_TEXT]}
    if cause_of(err):  # a reward.infra.InfraFailure: the service's failure, not the model's
        out[DETAIL_KEY] = cause_of(err)
    return out


def _result_frame(i: int, t_end: float, msg: tuple) -> bytes:
    try:
        data = pickle.dumps((i, t_end) + msg, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:  # noqa: BLE001
        data = pickle.dumps((i, t_end, "error", _error(err, "result not picklable")))
    if len(data) > _MAX_RESULT:
        data = pickle.dumps((i, t_end, "error", {"error": "ResultTooLarge",
                                                 "message": f"result of {len(data)} bytes"}))
    return struct.pack(">Q", len(data)) + data


def _child(blobs: list[bytes], chunk: list[int], wfd: int, start: float, timeout_s: float,
           memory_mb: int) -> None:
    """Body of one forked child: runs the calls ``chunk`` (indices into ``blobs``) in order, one result frame
    each, the first call's limit counted from ``start`` and every later one's from the previous end stamp.
    Never returns."""
    code = 0
    try:
        os.setsid()
        _prctl_pdeathsig()
        if memory_mb:
            import resource

            lim = memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        from reward import sandbox

        me = os.getpid()
        t_prev = start
        for i in chunk:
            sandbox.CALL_DEADLINE = t_prev + timeout_s
            try:
                fn, response, row = pickle.loads(blobs[i])
                msg = ("ok", plain(fn(response, row)))
            except BaseException as err:  # noqa: BLE001 - every failure is an outcome
                msg = ("error", _error(err))
            if os.getpid() != me:  # a verifier forked and its child came back here: never answer twice
                os._exit(0)
            t_prev = time.monotonic()
            _write_all(wfd, _result_frame(i, t_prev, msg))
    except BaseException:  # noqa: BLE001
        code = 1
    finally:
        os._exit(code)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def make_chunks(n: int, chunk_size: int, parallel: int, alone: list[bool] | None = None) -> list[list[int]]:
    """Calls ``0..n-1`` grouped into chunks in index order: each ``alone`` call by itself, the others in
    chunks of at most ``chunk_size`` and small enough that ``parallel`` children all get work."""
    alone = alone or [False] * n
    batchable = n - sum(bool(a) for a in alone)
    size = max(1, min(chunk_size, math.ceil(batchable / parallel))) if batchable else 1
    chunks, cur = [], []
    for i in range(n):
        if alone[i]:
            chunks.append([i])
            continue
        cur.append(i)
        if len(cur) == size:
            chunks.append(cur)
            cur = []
    if cur:
        chunks.append(cur)
    return chunks


class _Batch:
    """One ``run_batch`` call: the outcomes so far, the chunks not yet started and the live children.

    Each child is a dict ``{pid, pidfd, r, r_open, buf, pending, t_prev, bad}``: its pidfd and the read end of
    its result pipe (both registered with ``sel``), the bytes read but not yet parsed, the calls of its chunk
    that have no outcome yet, the end stamp of its last call (its current call's limit runs from there), and
    why its stream was refused (None while it is well-formed).
    """

    def __init__(self, blobs: list[bytes], timeout_s: float, parallel: int, memory_mb: int, chunk_size: int,
                 alone: list[bool] | None) -> None:
        # imported before any fork: the children inherit the module
        from reward.sandbox_procs import adopt_orphans, reap_children, reap_owner

        adopt_orphans()  # what a killed verifier child started (sandbox runs too) comes to this process when orphaned
        self.reap_owner, self.reap_children = reap_owner, reap_children
        self.blobs, self.timeout_s, self.parallel, self.memory_mb = blobs, timeout_s, parallel, memory_mb
        self.outcomes: list[tuple | None] = [None] * len(blobs)
        self.todo = deque(make_chunks(len(blobs), chunk_size, parallel, alone))
        self.active: dict[int, dict] = {}  # pid -> child
        self.sel = selectors.DefaultSelector()

    def run(self) -> list[tuple]:
        """Start chunks while there are free slots, wait for results, exits and the nearest time limit."""
        while self.todo or self.active:
            while self.todo and len(self.active) < self.parallel:
                self.launch(self.todo.popleft())
            nearest = min(a["t_prev"] + self.timeout_s for a in self.active.values())
            for key, _ in self.sel.select(timeout=max(0.0, nearest - time.monotonic())):
                self.on_event(*key.data)
            now = time.monotonic()
            for a in [a for a in self.active.values() if now >= a["t_prev"] + self.timeout_s]:
                self.finish(a, timed_out=True)
        self.sel.close()
        return self.outcomes  # type: ignore[return-value]

    def on_event(self, pid: int, kind: str) -> None:
        """Child ``pid`` sent results (``kind == "r"``: a refused stream ends it) or exited (``"p"``)."""
        a = self.active.get(pid)
        if a is None:
            return
        if kind == "r":
            self.drain(a)
            if a["bad"] is not None:
                self.finish(a, timed_out=False)
        else:
            self.finish(a, timed_out=False)

    def launch(self, chunk: list[int]) -> None:
        """Fork a child for ``chunk`` (it closes the parent's fds of the other children) and watch it."""
        r, w = os.pipe()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            for fd in [r] + [x for a in self.active.values() for x in (a["r"], a["pidfd"])]:
                os.close(fd)
            _child(self.blobs, chunk, w, start, self.timeout_s, self.memory_mb)
        os.close(w)
        os.set_blocking(r, False)
        pidfd = os.pidfd_open(pid)
        self.active[pid] = {"pid": pid, "pidfd": pidfd, "r": r, "r_open": True, "buf": bytearray(),
                            "pending": deque(chunk), "t_prev": start, "bad": None}
        self.sel.register(r, selectors.EVENT_READ, (pid, "r"))
        self.sel.register(pidfd, selectors.EVENT_READ, (pid, "p"))

    def take_frames(self, a: dict) -> None:
        """Record the complete result frames in ``a``'s buffer; an oversized, unreadable or out-of-order
        frame sets ``a["bad"]`` and stops the parsing."""
        buf = a["buf"]
        while a["bad"] is None and len(buf) >= 8:
            size = struct.unpack(">Q", buf[:8])[0]
            if size > _MAX_RESULT + 4096:
                a["bad"] = f"result frame of {size} bytes"
                return
            if len(buf) < 8 + size:
                return
            body = bytes(buf[8:8 + size])
            del buf[:8 + size]
            try:
                i, t_end, kind, payload = pickle.loads(body)
            except Exception as err:  # noqa: BLE001
                a["bad"] = f"unreadable result frame ({type(err).__name__})"
                return
            if not a["pending"] or i != a["pending"][0]:
                a["bad"] = f"result for call {i} out of order"
                return
            a["pending"].popleft()
            self.outcomes[i] = (kind, payload if kind == "ok" else None, {} if kind == "ok" else payload,
                                t_end - a["t_prev"])
            a["t_prev"] = t_end

    def drain(self, a: dict) -> None:
        """Read what ``a``'s pipe holds now (noting its end of file) and take the complete frames."""
        if not a["r_open"]:
            return
        try:
            while chunk := os.read(a["r"], 1 << 16):
                a["buf"] += chunk
            self.sel.unregister(a["r"])  # end of file
            a["r_open"] = False
        except BlockingIOError:
            pass
        self.take_frames(a)

    def finish(self, a: dict, timed_out: bool) -> None:
        """End child ``a``: kill its group, keep the results it sent, settle the call it was on, requeue
        the rest of its chunk."""
        self.active.pop(a["pid"])
        self.drain(a)  # what it sent before the end
        on = a["pending"][0] if a["pending"] else None
        _kill_group(a["pid"])
        try:
            os.kill(a["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(a["pid"], 0)
        self.drain(a)  # a result written just before the kill still counts
        if a["r_open"]:
            self.sel.unregister(a["r"])
        self.sel.unregister(a["pidfd"])
        os.close(a["r"])
        os.close(a["pidfd"])
        cut_short = on is not None and self.outcomes[on] is None
        if cut_short:
            a["pending"].popleft()
            self.outcomes[on] = self.cut_short_outcome(a, timed_out, status)
        if a["pending"]:
            self.todo.appendleft(list(a["pending"]))
        if cut_short or a["bad"] is not None or status != 0:
            self.reap_owner(a["pid"])
        self.reap_children(keep=set(self.active))  # the ended child's orphans, adopted by this process

    def cut_short_outcome(self, a: dict, timed_out: bool, status: int) -> tuple:
        """The outcome of the call child ``a`` was on when it ended: ``timeout``, or an ``error``
        (``VerifierDied``, with its wait status, signal and the refused frame's reason when there is one)."""
        elapsed = time.monotonic() - a["t_prev"]
        if timed_out:
            return ("timeout", None, {"timeout_s": self.timeout_s}, elapsed)
        detail = {"error": "VerifierDied", "wait_status": status}
        if os.WIFSIGNALED(status):
            detail["signal"] = os.WTERMSIG(status)
        if a["bad"] is not None:
            detail["message"] = a["bad"]
        return ("error", None, detail, elapsed)


def run_batch(blobs: list[bytes], timeout_s: float, parallel: int, memory_mb: int, chunk_size: int = 1,
              alone: list[bool] | None = None) -> list[tuple]:
    """Outcomes ``(status, value, detail, elapsed_s)`` of ``blobs`` (pickled calls), in order.

    A child ends when it exits (seen through a pidfd, so a grandchild that inherited the result pipe cannot
    hold it open) or when the call it is on runs out of time; either way its whole process group is killed,
    and sandbox runs started on its behalf are reaped when it did not end cleanly.
    """
    return _Batch(blobs, timeout_s, parallel, memory_mb, chunk_size, alone).run()


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
    gc.collect()
    gc.freeze()  # children's collections leave the preloaded heap alone (no copy-on-write of it)
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
            gc.freeze()
            write_frame(wfd, failed)
            continue
        write_frame(wfd, run_batch(req["calls"], req["timeout_s"], req["parallel"], setup["memory_mb"],
                                   req.get("chunk_size", 1), req.get("alone")))


if __name__ == "__main__":
    serve()
