"""The Python tool for agents (``reward.envs.python_tool``): model-written code runs only in the code verifier's
sandbox, from a helper process per call, and every outcome comes back to the model as an observation.

Real sandbox runs, on the backend ``tests.helpers.sandbox.sandbox_backend`` picks (bwrap where it works, else
plain, as the other tests that run code do). Hostile programs are bounded by themselves (a few hundred
processes, sleeps of at most 20 s, a few MB written), each test asserts the sandbox stopped them well before,
and after each run no process of it is left (its run id, its helper, the helper's sandbox uid).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from reward.config import EnvConfig, RewardConfig, SandboxConfig
from reward.deadline import DeadlineRunner
from reward.env_worker import EnvWorker
from reward.environment import Environment, needs_sandbox, run_with_tool_deadline, tool, tool_schema
from reward.envs import python_tool
from reward.envs.python_tool import (
    MAX_OUTPUT_CHARS,
    STOP_MARGIN_S,
    ProgramError,
    ProgramRun,
    observation,
    python,
    run_program,
)
from reward.infra import Cause, InfraFailure
from reward.sandbox import SandboxUnavailable
from reward.sandbox_procs import ENV_OWNER, ENV_RUN, _uid_processes, find_run_processes, sandbox_uid
from tests.helpers import REPO_ROOT
from tests.helpers.envs import row
from tests.helpers.sandbox import FORK_BOMB, sandbox_backend

BACKEND = sandbox_backend()
MAX_PROCS = 12
TOOL = "reward.envs.python_tool:python"


def cfg_for(**kw) -> SandboxConfig:
    base = dict(backend=BACKEND, wall_s=4.0, cpu_s=2, memory_mb=256, max_procs=MAX_PROCS, max_output_kb=64,
                file_size_mb=1.0)
    base.update(kw)
    return SandboxConfig(**base)


def run(code: str, **kw) -> ProgramRun:
    out = run_program(textwrap.dedent(code), cfg_for(**kw))
    assert_nothing_left(out)
    return out


def assert_nothing_left(out: ProgramRun) -> None:
    """No process of the run, of its helper or of the helper's sandbox uid is alive."""
    if out.run_id:
        assert find_run_processes(ENV_RUN, out.run_id) == []
    assert out.helper_pid is not None
    assert find_run_processes(ENV_OWNER, str(out.helper_pid)) == []
    uid = sandbox_uid(out.helper_pid)
    if uid is not None:
        assert _uid_processes(uid) == []
    assert out.helper_pid not in [p.pid for p in psutil.Process().children(recursive=True)]


@pytest.fixture
def recorded(monkeypatch) -> list[ProgramRun]:
    """The ``ProgramRun`` of every call of the tool while the test runs (for the no-process-left checks)."""
    runs: list[ProgramRun] = []
    real = python_tool.run_program

    def recording(*args, **kwargs):
        runs.append(real(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(python_tool, "run_program", recording)
    return runs


def test_schema_and_marks():
    schema = tool_schema(python)["function"]
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]
    assert schema["parameters"]["properties"]["code"]["type"] == "string"
    assert needs_sandbox(None, [python]) and not needs_sandbox(None, [len])


@pytest.mark.timeout(60)
def test_prints_come_back():
    out = run("print('hello', 6 * 7)\nimport sys; print('noise', file=sys.stderr)")
    assert out.status == "ok" and out.backend == BACKEND, out
    assert observation(out) == "hello 42\n"  # stdout only


@pytest.mark.timeout(60)
def test_an_exception_gives_its_error_text():
    out = run("print('before')\ndef f(x):\n    return x / 0\nf(1)\n")
    assert out.status == "exit" and out.returncode == 1, out
    with pytest.raises(ProgramError, match=r"^the program exited with status 1: ZeroDivisionError: division by zero$"):
        observation(out)


@pytest.mark.timeout(60)
def test_an_infinite_loop_ends_by_the_time_limit_as_an_error():
    start = time.monotonic()
    out = run("while True:\n    pass\n", wall_s=1.0, cpu_s=1)
    assert out.status in ("timeout", "cpu_limit"), out
    assert time.monotonic() - start < 20  # the limit (1 s) plus the helper's start and clean-up on a busy machine
    with pytest.raises(ProgramError, match="time limit"):
        observation(out, cfg_for(wall_s=1.0, cpu_s=1))


@pytest.mark.timeout(60)
def test_the_tool_deadline_cuts_a_run_with_more_time():
    """A deadline shorter than the sandbox's own limits stops the run before it, as a timeout of the run."""
    deadline = time.monotonic() + 4.0
    out = run_program("import time\ntime.sleep(20)\n", cfg_for(wall_s=30.0, cpu_s=30), deadline)
    assert_nothing_left(out)
    assert time.monotonic() < deadline
    assert out.status == "timeout" and out.limit_s is not None and out.limit_s <= 4.0 - STOP_MARGIN_S, out
    with pytest.raises(ProgramError, match="stopped at its time limit"):
        observation(out)
    late = run_program("print(1)", cfg_for(), time.monotonic() + STOP_MARGIN_S)  # no time left: not started
    assert late.status == "timeout" and late.helper_pid is None
    with pytest.raises(ProgramError, match="not run: no time left"):
        observation(late)


@pytest.mark.timeout(60)
def test_a_helper_that_hangs_or_dies_is_killed_and_reported(monkeypatch):
    """The helper itself overrunning (killed just before the deadline) or dying without an answer: an error
    observation either way, and nothing of it left."""
    monkeypatch.setattr(python_tool, "_HELPER", "import time\ntime.sleep(30)\n")  # its own bound: 30 s
    deadline = time.monotonic() + 2.0
    hung = run_program("print(1)", cfg_for(), deadline)
    assert hung.status == "timeout" and time.monotonic() < deadline + 0.5, hung
    assert_nothing_left(hung)
    with pytest.raises(ProgramError, match="stopped at its time limit of 1 s"):
        observation(hung)
    monkeypatch.setattr(python_tool, "_HELPER", "import sys\nprint('garbage')\nprint('died', file=sys.stderr)")
    lost = run_program("print(1)", cfg_for())
    assert lost.status == "lost", lost
    assert_nothing_left(lost)
    with pytest.raises(InfraFailure, match="could not run the program: the sandbox helper exited .*: died") as err:
        observation(lost)  # not the program's doing: the episode ends as the sandbox's failure
    assert err.value.cause == Cause.SANDBOX_START


def test_observation_texts():
    """What the model sees of each outcome (no run needed)."""
    cfg = cfg_for()
    long = "x" * (MAX_OUTPUT_CHARS + 500)
    cut = observation(ProgramRun("ok", 0, stdout=long), cfg)
    assert cut.startswith("x" * MAX_OUTPUT_CHARS) and cut.count("x") == MAX_OUTPUT_CHARS
    assert cut.endswith(f"[output cut: the first {MAX_OUTPUT_CHARS} of {len(long)} characters]")
    assert observation(ProgramRun("ok", 0, stdout=""), cfg) == ""
    cases = [
        (ProgramRun("output_limit", -9), "more than 64 KiB of output"),
        (ProgramRun("cpu_limit", -24, stderr=""), r"killed \(SIGXCPU\) at its CPU-time limit of 2 s"),
        (ProgramRun("killed", -25, stderr="x\n\n"), "killed by SIGXFSZ: x"),
        (ProgramRun("scratch_limit", -9), "writable space of 64 MiB is full"),
        (ProgramRun("exit", 3, stderr=""), r"exited with status 3$"),
        (ProgramRun("exit", 1, stderr="Traceback\n  ...\n" + "E" * 1000), "E" * 300 + "$"),
    ]
    for out, text in cases:
        with pytest.raises(ProgramError, match=text):
            observation(out, cfg)
    for out, text in [(ProgramRun("error", None, detail={"reason": "OSError(...)"}), "could not run the program: OSError"),
                      (ProgramRun("lost", None, detail={"stderr": "boom"}), "could not run the program: lost: boom")]:
        with pytest.raises(InfraFailure, match=text) as err:  # the sandbox's failure, not the program's
            observation(out, cfg)
        assert err.value.cause == Cause.SANDBOX_START
    with pytest.raises(SandboxUnavailable, match="no bwrap"):
        observation(ProgramRun("unavailable", detail={"reason": "no bwrap"}), cfg)
    with pytest.raises(TypeError, match="must be a string"):
        run_program(b"print(1)")


@pytest.mark.timeout(60)
def test_a_hostile_program_is_contained(monkeypatch):
    """Writes outside its folder, reads of the worker's files, environment and process, a signal to the worker:
    all refused, nothing lands, nothing leaks."""
    secret = "sk-test-" + os.urandom(8).hex()
    monkeypatch.setenv("GSPO_FAKE_API_KEY", secret)
    outside = Path(tempfile.mkdtemp(prefix="pytool-outside-"))
    os.chmod(outside, 0o777)  # world-writable and -readable: only the sandbox can stop the program
    (outside / "state.json").write_text(secret)
    os.chmod(outside / "state.json", 0o644)
    repo_file = REPO_ROOT / "pytool-pwned.txt"
    tmp_file = Path(tempfile.gettempdir()) / f"pytool-escape-{os.getpid()}.txt"
    me = os.getpid()
    try:
        out = run(f"""
            import os
            print("ENV", sorted(os.environ.items()))
            for p in ({str(outside / 'pwned.txt')!r}, {str(repo_file)!r}, {str(outside / 'state.json')!r}):
                try:
                    with open(p, "w") as f:
                        f.write("pwned")
                    print("wrote", p)
                except OSError as err:
                    print("refused write", p, type(err).__name__)
            try:  # under bwrap /tmp is the run's own scratch space: the write may succeed there
                open({str(tmp_file)!r}, "w").write("pwned")
            except OSError:
                pass
            for p in ({str(outside / 'state.json')!r}, {str(REPO_ROOT / 'CONTRIBUTING.md')!r},
                      "/proc/{me}/environ", "/proc/{me}/cmdline"):
                try:
                    print("READ", p, open(p, "rb").read()[:2000])
                except OSError as err:
                    print("refused read", p, type(err).__name__)
            try:
                os.kill({me}, 0)
                print("signalled the worker")
            except OSError as err:
                print("refused signal", type(err).__name__)
            open("inside.txt", "w").write("fine")
            print("inside", open("inside.txt").read())
        """)
        text = out.stdout + out.stderr
        assert out.status == "ok" and "inside fine" in out.stdout, out
        assert "wrote" not in text and "READ" not in text and "signalled" not in text, text
        assert text.count("refused write") == 3 and text.count("refused read") == 4, text
        assert "refused signal" in text
        assert secret not in text and "Working on this project" not in text  # CONTRIBUTING.md's first line
        assert not (outside / "pwned.txt").exists() and not repo_file.exists() and not tmp_file.exists()
        assert (outside / "state.json").read_text() == secret
    finally:
        shutil.rmtree(outside, ignore_errors=True)
        repo_file.unlink(missing_ok=True)
        tmp_file.unlink(missing_ok=True)


HOLDING_FORK_BOMB = FORK_BOMB + "    time.sleep(20)                    # holds its processes until the run is stopped\n"


@pytest.mark.timeout(90)
def test_a_fork_bomb_is_capped_and_does_not_disturb_a_call_beside_it():
    """Two calls at once (episodes step in parallel threads of one worker): a fork bomb that fills its process
    limit and holds it, and a program that needs MAX_PROCS - 1 processes. Each run has an owner process of its
    own, so the bomb neither takes the other's processes nor has them killed when it is stopped."""
    results: dict[str, ProgramRun] = {}

    def call(name: str, code: str, **kw) -> None:
        results[name] = run_program(textwrap.dedent(code), cfg_for(**kw))

    honest = f"""
        import os, time
        time.sleep(0.5)
        kids = []
        for _ in range({MAX_PROCS - 2}):   # with the interpreter, MAX_PROCS - 1 processes alive at once
            pid = os.fork()
            if pid == 0:
                time.sleep(1.5)
                os._exit(0)
            kids.append(pid)
        for pid in kids:
            os.waitpid(pid, 0)
        print("forked", len(kids), flush=True)
    """
    threads = [threading.Thread(target=call, args=("bomb", HOLDING_FORK_BOMB), kwargs={"wall_s": 3.0, "cpu_s": 3}),
               threading.Thread(target=call, args=("honest", honest), kwargs={"wall_s": 8.0, "cpu_s": 4})]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    bomb, ok = results["bomb"], results["honest"]
    assert "blocked" in bomb.stdout and int(bomb.stdout.split("forked")[1].split()[0]) < MAX_PROCS, bomb
    assert bomb.status in ("timeout", "cpu_limit"), bomb
    assert ok.status == "ok" and f"forked {MAX_PROCS - 2}" in ok.stdout, ok
    assert bomb.helper_pid != ok.helper_pid
    assert_nothing_left(bomb)
    assert_nothing_left(ok)


@pytest.mark.timeout(90)
def test_the_tool_in_an_env_worker_step(recorded):
    """Tool calls as the parser gives them: output, an exception and an infinite loop come back as observations
    (the loop ends at the run's limit, before env.tool_timeout_s: the episode goes on); the program cannot
    change the episode's reward (the row's verifier on the final assistant text)."""
    w = EnvWorker(EnvConfig(tools=[TOOL], tool_timeout_s=4.0),
                  RewardConfig(sandbox=cfg_for(wall_s=30.0, cpu_s=30)))
    start = w.start("p", row("py1", prompt="What is 6 * 7?", answer="42"), 0)
    assert start.status == "ok" and start.tool_schemas[0]["function"]["name"] == "python"
    step = w.step("p", "...", [
        {"name": "python", "arguments": {"code": "print(6 * 7)\nprint('#### 42')"}},
        {"name": "python", "arguments": '{"code": "import json\\njson.loads(\'{oops\')"}'},
    ], [])
    assert step.status == "ok" and not step.done, step
    assert step.messages[0] == {"role": "tool", "name": "python", "content": "42\n#### 42\n"}
    assert step.messages[1]["name"] == "python" and step.messages[1]["content"].startswith(
        "Error: ProgramError: the program exited with status 1: json.decoder.JSONDecodeError: Expecting property")
    assert step.tool_errors == {"raised": 1}
    t0 = time.monotonic()
    loop = w.step("p", "...", [{"name": "python", "arguments": {"code": "while True:\n    pass\n"}}], [])
    assert time.monotonic() - t0 < 4.0 + 1.0
    assert loop.status == "ok" and not loop.done, loop  # not an episode timeout
    assert loop.messages[0]["content"].startswith("Error: ProgramError: the program was"), loop.messages
    assert "time limit" in loop.messages[0]["content"]
    assert w.abandoned_threads() == 0
    w.step("p", "#### 41", [], [])  # the program printed the right answer; the model's answer is wrong
    outcome = w.finish("p")
    assert outcome.status == "ok" and outcome.reward == 0.0 and outcome.turns == 3
    assert len(recorded) == 3 and all(r.backend == BACKEND for r in recorded[:3])
    for out in recorded:
        assert_nothing_left(out)


class PyEnv(Environment):
    """An environment class offering the tool as a method."""

    python = tool(staticmethod(python))

    def reward(self) -> float:
        return 0.0


@pytest.mark.timeout(60)
def test_the_tool_from_an_environment_class(recorded):
    assert needs_sandbox(PyEnv)
    env = PyEnv(row("py2"), 0)
    assert [tool_schema(fn)["function"]["name"] for fn in env.tools()] == ["python"]
    runner = DeadlineRunner("test")
    result = run_with_tool_deadline(runner, 8.0, env.step, "...",
                                    [{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}],
                                    sandbox=cfg_for())
    assert result.messages == [{"role": "tool", "name": "python", "content": "45\n"}] and not result.tool_errors
    assert recorded[0].backend == BACKEND  # the settings handed to the call, not the defaults
    assert_nothing_left(recorded[0])


def test_an_env_worker_with_the_tool_refuses_to_start_without_bubblewrap(monkeypatch):
    from reward import bwrap

    monkeypatch.setattr(bwrap, "probe", lambda python, uid: "bwrap not found (test)")
    with pytest.raises(SandboxUnavailable, match="bwrap not found"):
        EnvWorker(EnvConfig(tools=[TOOL]), RewardConfig(sandbox=SandboxConfig(backend="bwrap")))
    EnvWorker(EnvConfig(tools=["reward.envs.calculator:calc"]),  # no sandbox tool: not checked
              RewardConfig(sandbox=SandboxConfig(backend="bwrap")))
