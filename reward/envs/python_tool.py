"""A Python tool for agents, ``env.tools: [reward.envs.python_tool:python]``: the model's code runs in the code
verifier's sandbox (``reward.sandbox.run_python``), never in the env worker's process.

**Where it runs.** Each call starts a helper process (this interpreter, ``-I``) that calls
``reward.sandbox.run_python`` on the code and sends the ``SandboxResult`` back as JSON; the env worker's
thread only waits for it. The sandbox is the code verifier's own, with its isolation and limits: under
``bwrap`` (the default) new namespaces, a read-only file system whose only writable place is a per-run tmpfs,
no network, and the run's processes all killed when it ends; under ``plain`` (chosen in the config only) what
``reward.sandbox.PLAIN_WARNING`` says. The helper exists because the sandbox keeps its bookkeeping per
owner process: as root every run of a process gets that process's sandbox uid (``sandbox_uid``), shares its
``RLIMIT_NPROC`` and is swept by the uid-wide kill that ends each run, so two runs of one process at once
would stop each other (episodes step in parallel threads of one worker). A helper per call gives each run an
owner process of its own, as the reward worker's forked children do for the ``code`` verifier. Cost: an
interpreter start with ``reward.sandbox``'s imports (pydantic) and bubblewrap's probe run per call: 0.8 s a
call for ``print(1)`` in all, of which the run 0.1-0.2 s, measured on 2 cores at a load average of 12 (other
jobs running). A fork server per worker would save most of it (not built).

**Limits: where they come from.** The ``reward.sandbox`` section of the run's config (``SandboxConfig``),
the one the ``code`` verifier uses: the env worker gets the ``reward`` section (``EnvWorker(env_cfg,
reward_cfg)``) and hands its ``sandbox`` to each tool call (``reward.environment.tool_context``). Outside an
env worker's step (a direct call) the defaults of ``SandboxConfig()`` apply. No environment variables are
read. So a call runs for at most ``sandbox.wall_s`` seconds (default 3) of wall-clock time and
``sandbox.cpu_s`` of CPU time, with ``sandbox.memory_mb`` of address space, ``sandbox.max_procs`` processes,
files of at most ``sandbox.file_size_mb``, ``sandbox.scratch_mb`` of writable space (bwrap), and at most
``sandbox.max_output_kb`` of stdout and stderr together. Under the env worker the run is also cut to end
``STOP_MARGIN_S`` before the tool call's deadline (``env.tool_timeout_s``), so that a program that runs too
long comes back to the model as an error observation instead of ending the episode with status ``timeout``;
should the helper itself overrun, it is killed (with every sandbox process started on its behalf,
``reward.sandbox_procs.reap_owner``) just before the deadline. With no deadline the helper is given
``HELPER_START_S`` on top of the run's limit.

**What the model sees.** The program's standard output, cut to ``MAX_OUTPUT_CHARS`` characters (the cut is
said on a last line); standard error is not shown for a program that exits 0. Anything else raises
``ProgramError`` with a short text (time limit, CPU-time limit, output over the cap, a full scratch space, a
signal, or a non-zero exit with the last line of standard error, a Python exception's ``Type: message``),
which ``reward.environment.run_tool_call`` turns into an ``Error: ProgramError: ...`` observation (kind
``raised``; the episode goes on). A run the sandbox could not start, or whose helper died without an answer,
raises ``reward.infra.InfraFailure`` (``sandbox_start``): the episode ends as the service's failure, invalid by
default (``reward.on_infra_failure``). ``reward.sandbox.SandboxUnavailable`` (bubblewrap required and missing)
is raised as it is; an env worker with this tool refuses to start then (``reward.environment.uses_sandbox``).

**From an Environment class.** ``python = tool(staticmethod(python))`` in the class body (or return it from
``tools()``) offers it as the tool ``python``.

Nothing the program does reaches the episode: it runs in other processes, with a file-system view of its
own, and what comes back is text for the model; the episode's reward is the environment's (for
``env.tools``, the row's verifier on the final assistant text).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from reward.config import SandboxConfig
from reward.environment import SANDBOX_MARK, tool_context
from reward.sandbox import SandboxResult

MAX_OUTPUT_CHARS = 2000  # stdout shown to the model; the rest is cut (and the cut said)
STDERR_LINE_CHARS = 300  # longest last line of stderr quoted in an error
STOP_MARGIN_S = 1.0  # under a deadline, the run's own limit ends this long before it (for its clean-up)
RETURN_MARGIN_S = 0.2  # under a deadline, the helper is killed this long before it
HELPER_START_S = 30.0  # without a deadline: the helper's start-up allowed on top of the run's limit
STOP_S = 10.0  # without a deadline: the run's clean-up allowed after its limit

# Runs as ``python -I -c _HELPER`` with a JSON request on stdin; writes one JSON object to stdout.
_HELPER = r'''
import json, os, sys
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: dies with the thread that started it
except Exception:
    pass
req = json.loads(sys.stdin.buffer.read())
if os.getppid() != req["parent"]:
    os._exit(3)
sys.path[:0] = req["sys_path"]
from reward import sandbox
from reward.config import SandboxConfig
sandbox.CALL_DEADLINE = req["deadline"]
try:
    cfg = SandboxConfig(**req["sandbox"])
    limit = sandbox.time_limit(cfg)
    res = sandbox.run_python(req["code"], cfg)
    out = {"status": res.status, "returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr,
           "elapsed_s": res.elapsed_s, "backend": res.backend, "leftover_killed": res.leftover_killed,
           "run_id": res.run_id, "limit_s": limit, "detail": {k: str(v) for k, v in res.detail.items()}}
except sandbox.SandboxUnavailable as err:
    out = {"status": "unavailable", "detail": {"reason": str(err)}}
except Exception as err:
    out = {"status": "error", "detail": {"reason": f"{type(err).__name__}: {err}"}}
sys.stdout.write(json.dumps(out))
sys.stdout.flush()
'''


class ProgramError(RuntimeError):
    """The program did not finish cleanly (the message says how, in a few words, for the model)."""


@dataclass
class ProgramRun(SandboxResult):
    """One run of model-written code (``run_program``).

    Attributes:
        status: a ``reward.sandbox.SandboxResult`` status (``ok``, ``exit``, ``timeout``, ``cpu_limit``,
            ``output_limit``, ``scratch_limit``, ``killed``, ``error``), or ``unavailable`` (bubblewrap required
            and missing), or ``lost`` (the helper died without an answer).
        returncode, stdout, stderr, elapsed_s, backend, leftover_killed, run_id: as ``SandboxResult``.
        limit_s: the wall-clock limit the run had (None when it never got as far).
        helper_pid: the helper process that owned the run (its sandbox processes carry it as their owner).
        detail: why, for ``error``, ``unavailable``, ``lost`` and a ``timeout`` without a run.
    """

    returncode: int | None = None  # None: no run (SandboxResult's own has no default)
    limit_s: float | None = None
    helper_pid: int | None = None


def run_program(code: str, cfg: SandboxConfig | None = None, deadline: float | None = None) -> ProgramRun:
    """Run ``code`` once in the sandbox, from a helper process of its own; never raises for what the code does.

    Args:
        code: Python source, run as a program (``main.py``) with empty stdin.
        cfg: the sandbox settings (default ``SandboxConfig()``).
        deadline: ``time.monotonic()`` by which this must have returned (the tool call's deadline), or None.

    Returns:
        ``ProgramRun``. Past ``deadline - STOP_MARGIN_S`` the run is stopped by the sandbox (``timeout``); a
        helper still alive at ``deadline - RETURN_MARGIN_S`` is killed with its runs (``timeout``).

    Raises:
        TypeError: ``code`` is not a string.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}")
    cfg = cfg if cfg is not None else SandboxConfig()
    now = time.monotonic()
    if deadline is None:
        run_deadline, wait_s = None, HELPER_START_S + cfg.wall_s + STOP_S
    else:
        run_deadline, wait_s = deadline - STOP_MARGIN_S, deadline - RETURN_MARGIN_S - now
        if run_deadline - now <= 0.25:
            return ProgramRun("timeout", limit_s=0.0, detail={"reason": "no time left before the deadline"})
    request = {"parent": os.getpid(), "sys_path": list(sys.path), "code": code, "sandbox": cfg.model_dump(),
               "deadline": run_deadline}
    proc = subprocess.Popen([sys.executable, "-I", "-c", _HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
    try:
        out, err = proc.communicate(json.dumps(request).encode(), timeout=wait_s)
    except subprocess.TimeoutExpired:
        _kill_helper(proc)
        return ProgramRun("timeout", elapsed_s=time.monotonic() - now, helper_pid=proc.pid,
                          limit_s=cfg.wall_s if run_deadline is None else max(0.0, run_deadline - now),
                          detail={"reason": f"the sandbox helper did not answer within {wait_s:.3g} s"})
    try:
        answer = json.loads(out)
        if not isinstance(answer, dict) or not isinstance(answer.get("status"), str):
            raise ValueError(f"not a result: {answer!r}"[:200])
    except ValueError:
        _kill_helper(proc)  # it answered nothing usable: whatever it started goes too
        return ProgramRun("lost", elapsed_s=time.monotonic() - now, helper_pid=proc.pid,
                          detail={"reason": f"the sandbox helper exited with {proc.returncode} without a result",
                                  "stderr": _last_line(err.decode("utf-8", "replace"))})
    known = ProgramRun.__dataclass_fields__
    return ProgramRun(**{k: v for k, v in answer.items() if k in known}, helper_pid=proc.pid)


def _kill_helper(proc: subprocess.Popen) -> None:
    """Kill the helper's process group, wait for it, and kill every sandbox process it started."""
    from reward.sandbox_procs import reap_owner

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        proc.kill()
        proc.wait()
    reap_owner(proc.pid)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:STDERR_LINE_CHARS] if lines else ""


def _signal_name(rc: int | None) -> str:
    try:
        return signal.Signals(-rc).name if rc is not None and rc < 0 else str(rc)
    except ValueError:
        return f"signal {-rc}"


def observation(run: ProgramRun, cfg: SandboxConfig | None = None) -> str:
    """What the model sees of ``run``: its stdout, cut to ``MAX_OUTPUT_CHARS`` (the cut said on a last line).

    Raises:
        ProgramError: the run did not exit 0; the message says why in a few words (with the last line of
            stderr for a non-zero exit or a signal).
        reward.infra.InfraFailure: ``sandbox_start``: the sandbox could not start the run, or its helper died
            without an answer (the episode ends as the service's failure, not the model's).
        reward.sandbox.SandboxUnavailable: bubblewrap is required and does not work here.
    """
    cfg = cfg if cfg is not None else SandboxConfig()
    status = run.status
    if status == "ok":
        text = run.stdout
        if len(text) > MAX_OUTPUT_CHARS:
            text = f"{text[:MAX_OUTPUT_CHARS]}\n[output cut: the first {MAX_OUTPUT_CHARS} of {len(text)} characters]"
        return text
    if status == "unavailable":
        from reward.sandbox import SandboxUnavailable

        raise SandboxUnavailable(run.detail.get("reason", "bubblewrap does not work here"))
    stderr = _last_line(run.stderr)
    if status == "exit":
        why = f"the program exited with status {run.returncode}"
    elif status == "timeout":
        if run.limit_s is None or run.limit_s <= 0:
            why = "not run: no time left before the tool call's deadline"
        else:
            why = f"the program was stopped at its time limit of {round(run.limit_s, 1):g} s"
    elif status == "cpu_limit":
        why = f"the program was killed ({_signal_name(run.returncode)}) at its CPU-time limit of {cfg.cpu_s} s"
    elif status == "output_limit":
        why = f"the program was stopped: more than {cfg.max_output_kb} KiB of output"
    elif status == "scratch_limit":
        why = f"the program was stopped: its writable space of {cfg.scratch_mb} MiB is full"
    elif status == "killed":
        why = f"the program was killed by {_signal_name(run.returncode)}"
    else:  # "error" (a run that could not start), "lost" (the helper died without an answer): not the program's
        from reward.infra import Cause, InfraFailure

        why, stderr = f"the sandbox could not run the program: {run.detail.get('reason', status)}", \
            run.detail.get("stderr", "")
        raise InfraFailure(Cause.SANDBOX_START, f"{why}: {stderr}" if stderr else why)
    raise ProgramError(f"{why}: {stderr}" if stderr and status in ("exit", "killed", "cpu_limit") else why)


def python(code: str) -> str:
    """Run a Python 3 program and return what it prints to standard output.

    Each call is a fresh program in a sandbox: no network, no files kept from earlier calls, and limits on
    time, memory and output. Use print() to see values. A program that fails returns its error instead.

    Args:
        code: the whole program, Python 3 source code

    Returns:
        The program's standard output (long output is cut), or an error.
    """
    context = tool_context()
    cfg = context.sandbox if isinstance(context.sandbox, SandboxConfig) else SandboxConfig()
    return observation(run_program(code, cfg, context.deadline), cfg)


setattr(python, SANDBOX_MARK, True)
