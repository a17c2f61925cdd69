"""The judge for assert-style code tests: the tests run here, the solution runs in the sandbox.

``run_python_tests`` is what the ``code`` verifier calls. For snippet tests it starts a ``SolutionSession``
(one sandbox run serving the solution through ``reward/_harness.py``) and runs each snippet in this
process, in a namespace holding the solution's globals as plain values and ``RemoteObject`` proxies
(``reward.channel``). The verdict of a snippet is whether it raised here. Threat model: ``reward/README.md``.
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import selectors
import subprocess
import time
from pathlib import Path
from typing import Any

from reward.channel import (
    ModuleRef,
    ProtocolError,
    RemoteObject,
    SessionLost,
    decode_plain,
    remote_exception,
)
from reward.config import SandboxConfig
from reward.sandbox import (SandboxResult, choose_backend, exit_status, run_python, scratch_full, start_run, stop_run,
                            time_limit)

HARNESS_SOURCE = (Path(__file__).resolve().parent / "_harness.py").read_text(encoding="utf-8")
MAX_MESSAGE_BYTES = 4 << 20  # one answer of the solution (a call's result), bytes
# Modules a solution's global may stand for in the tests' namespace (tests often use the solution's
# ``import math``): the judge binds its own, genuine copy of the module, never the solution's.
SAFE_MODULES = frozenset({
    "math", "cmath", "re", "string", "collections", "itertools", "functools", "heapq", "bisect", "operator",
    "fractions", "decimal", "statistics", "random", "copy", "typing", "json", "datetime", "time", "array",
    "numbers", "dataclasses", "enum", "textwrap", "unicodedata", "calendar",
})


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
            ``exit``, ``killed``, ``cpu_limit``, ``scratch_limit``, ``load_error``, ``error``).
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
        run = start_run(code, cfg, deadline - time.monotonic(), harness=HARNESS_SOURCE)
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
            if status == "exit" and self.run is not None:
                try:  # a closed channel is read before the dying process can be waited for: give it a moment
                    self.run.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            if status == "exit" and self.run is not None and self.run.proc.poll() is not None:
                ended, _ = exit_status(self.run)  # it ended by itself: say how
                status = ended if ended != "ok" else "exit"
            self.status, self.lost = status, True
            if why:
                self.detail["reason"] = why
        if self.run is not None and self._sel is not None:
            self._sel.close()
            self._sel = None
            self.detail["leftover_killed"] = stop_run(self.run)
            self.detail["returncode"] = self.run.proc.returncode

    def _receive(self) -> Any:
        """Pump the pipes until the pending request is written and one answer line has arrived; decode its
        JSON. Raises SessionLost (after ending the session) on timeout, death, flood or garbage."""
        if self.lost:
            raise SessionLost(self.status)
        run = self.run
        while True:
            if scratch_full(run):  # checked before every answer is taken: a full scratch space ends the run
                self._lose("scratch_limit")
                raise SessionLost(self.status)
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
                raise remote_exception(answer)
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
            self.detail["leftover_killed"] = stop_run(self.run)


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
    when the solution did not load, else ``"ok"``), ``stderr`` (a short tail), ``runs`` (the ids of the sandbox
    runs started, in order: the ``GSPO_SANDBOX_RUN`` tag in their processes' environment), ``sessions``
    (snippet sessions started) and ``failed`` (the first few failing snippets as ``[index, reason]``).

    Raises:
        ValueError: ``tests`` is not a non-empty list, or a test is neither a string nor an input/output dict.
        SandboxUnavailable: bubblewrap required but missing.
    """
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"tests must be a non-empty list, got {tests!r}"[:300])
    total = len(tests)
    if all(isinstance(t, str) for t in tests):
        return _run_snippets(code, tests, cfg)
    passed, first_bad, backend, stderr, runs = 0, "ok", "", "", []
    for i, t in enumerate(tests):
        if not (isinstance(t, dict) and "input" in t and "output" in t):
            raise ValueError(f"code test {i} must be a string or an {{'input', 'output'}} dict, got {t!r}"[:300])
    for t in tests:
        res = run_python(code, cfg, stdin=str(t["input"]))
        backend = res.backend
        runs.append(res.run_id)
        good = res.status == "ok" and res.stdout.strip() == str(t["output"]).strip()
        passed += good
        if not good and first_bad == "ok":
            first_bad, stderr = res.status, res.stderr[-300:]
    return passed, total, {"backend": backend, "sandbox": first_bad, "stderr": stderr, "runs": runs}


def _run_snippets(code: str, tests: list[str], cfg: SandboxConfig) -> tuple[int, int, dict]:
    limit = time_limit(cfg)
    deadline = time.monotonic() + limit
    ns: dict[str, Any] = {"__builtins__": builtins, "__name__": "__tests__"}
    results = [False] * len(tests)
    failed: list[list] = []
    session: SolutionSession | None = None
    bound: dict[str, Any] = {}
    first_bad, stderr, runs, backend = "ok", "", [], choose_backend(cfg)

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
                runs.append(session.run_id)
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
    return sum(results), len(tests), {"backend": backend, "sandbox": first_bad, "stderr": stderr, "runs": runs,
                                      "sessions": len(runs), "failed": failed[:10]}
