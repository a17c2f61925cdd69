"""The code verifier's verdict cannot be forged by the solution (issue 15, item 1), on both sandbox backends.

Each hostile solution tries one way to score tests it does not pass: writing pass lines, exiting early,
reading the harness through ``sys.modules['__main__']``, returning objects that equal everything, patching
builtins, modules or the tests' own helpers, shadowing built-in names, flooding or garbling the channel,
killing and signalling processes, forking. Every one scores only what its functions really return. The
hostile programs are bounded themselves (sleeps of at most 30 s, loops of a few thousand steps, some MB of
output), and after each run no process of it is left. Honest solutions in the same shapes pass, so the
suite can tell a sound judge from one that fails everything.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from reward.config import SandboxConfig
from reward.judge import run_python_tests
from reward.sandbox import bwrap_available, sandbox_python
from reward.sandbox_procs import ENV_OWNER, _uid_processes, find_run_processes, sandbox_uid
from reward.verifiers import code_verifier

HAVE_BWRAP = bwrap_available(sandbox_python(SandboxConfig()))


BACKENDS = [
    pytest.param("bwrap", marks=pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap (bwrap) not usable here")),
    "plain",
]


SQUARE_TESTS = ["assert f(2) == 4", "assert f(3) == 9", "assert f(-4) == 16"]


def cfg_for(backend: str, **kw) -> SandboxConfig:
    base = dict(backend=backend, wall_s=8.0, cpu_s=4, memory_mb=256, max_procs=12, max_output_kb=64,
                file_size_mb=1.0)
    base.update(kw)
    return SandboxConfig(**base)


def judge(code: str, tests: list, backend: str, **kw) -> tuple[int, int, dict]:
    out = run_python_tests(textwrap.dedent(code), tests, cfg_for(backend, **kw))
    assert_nothing_left()
    return out


def assert_nothing_left() -> None:
    assert find_run_processes(ENV_OWNER, str(os.getpid())) == []
    uid = sandbox_uid()
    if uid is not None:
        assert _uid_processes(uid) == []


def score(code: str, tests: list, backend: str) -> float:
    row = {"uid": "forgery", "answer": "", "meta": {"tests": tests}}
    out = code_verifier(f"```python\n{textwrap.dedent(code)}```", row, sandbox=cfg_for(backend))
    assert_nothing_left()
    return out["score"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_issue_a_main_globals_forged_pass_lines_and_exit(backend):
    """(a) read the harness's globals through sys.modules['__main__'], write its pass lines, os._exit(0)."""
    code = """
        import os, sys
        m = sys.modules["__main__"]
        ns = vars(m)
        nonce = ns.get("nonce") or ns.get("payload", {}).get("nonce", "")
        tests = ns.get("tests") or ns.get("payload", {}).get("tests", [])
        out = ns.get("report") or sys.stdout
        for i in range(max(len(tests), 3)):
            out.write(f"{nonce} {i} pass\\n")
        for name in ("report", "chan_out"):
            ch = ns.get(name)
            if ch is not None:
                for i in range(3):
                    ch.write(b'{"ok":4}\\n' if "b" in getattr(ch, "mode", "") else f"{nonce} {i} pass\\n")
                ch.flush()
        sys.stdout.flush()
        os._exit(0)
    """
    assert score(code, SQUARE_TESTS, backend) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_issue_b_object_equal_to_everything(backend):
    """(b) ``class A: __eq__ = lambda s, o: True`` with ``def f(x): return A()``."""
    code = """
        class A:
            __eq__ = lambda s, o: True
            __ne__ = lambda s, o: False
            __bool__ = lambda s: True
            __hash__ = lambda s: 0
        def f(x):
            return A()
    """
    assert score(code, SQUARE_TESTS, backend) == 0.0
    # the same object behind a plain-looking type: an int subclass that equals everything counts as its value
    code_int = """
        class I(int):
            __eq__ = lambda s, o: True
            __hash__ = lambda s: 0
        def f(x):
            return I(0)
    """
    assert score(code_int, SQUARE_TESTS, backend) == 0.0
    # ... and inside containers
    code_list = """
        class A:
            __eq__ = lambda s, o: True
        def f(x):
            return [A(), A()]
    """
    assert score(code_list, ["assert f(1) == [1, 2]", "assert f(2) in ([3, 4], [5, 6])"], backend) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_patched_builtins_do_not_reach_the_tests(backend):
    code = """
        import builtins
        real_compile = builtins.compile
        builtins.compile = lambda *a, **k: real_compile("pass", "<forged>", "exec")
        builtins.abs = lambda x: 0
        builtins.isinstance = lambda *a: True
        builtins.AssertionError = type("Swallowed", (Exception,), {})
        def f(x):
            return 10
    """
    tests = ["assert f(1) == 0.5", "assert abs(f(1) - 0.5) < 1e-9", "assert isinstance(f(1), str)"]
    passed, total, _ = judge(code, tests, backend)
    assert (passed, total) == (0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_solution_names_do_not_shadow_builtins(backend):
    code = """
        def abs(x):
            return 0
        def len(x):
            return 3
        def sorted(x):
            return [1, 2, 3]
        def f(x):
            return [9, 9]
    """
    tests = ["assert abs(f(1)[0] - 1) < 1e-9", "assert len(f(1)) == 3", "assert sorted(f(1)) == [1, 2, 3]"]
    passed, total, _ = judge(code, tests, backend)
    assert (passed, total) == (0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_patched_modules_do_not_reach_the_tests(backend):
    # the tests lean on the solution's ``import math`` (common in MBPP); they get the judge's own module
    code = """
        import math, operator
        math.isclose = lambda *a, **k: True
        math.sqrt = lambda x: 2.0
        operator.eq = lambda a, b: True
        def f(x):
            return 100.0
    """
    tests = ["assert math.isclose(f(4), 2.0)", "assert f(4) == math.sqrt(4)", "assert operator.eq(f(4), 2.0)"]
    passed, total, _ = judge(code, tests, backend)
    assert (passed, total) == (0, 3)
    honest = "import math, operator\ndef f(x):\n    return math.sqrt(x)\n"
    assert judge(honest, tests, backend)[:2] == (3, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tests_helpers_and_frames_are_out_of_reach(backend):
    # HumanEval shape: the test defines check(candidate) and calls it. The solution hunts for it through gc,
    # frames, threads and a trace hook, and tries to neuter AssertionError: there is nothing of the tests in
    # its interpreter.
    code = """
        import gc, sys, threading, builtins
        def neuter():
            for o in gc.get_objects():
                if isinstance(o, dict):
                    for k in list(o):
                        if k in ("check", "tests", "nonce"):
                            o[k] = (lambda *a, **kw: None) if k == "check" else o[k]
                if type(o).__name__ == "function" and o.__name__ == "check":
                    o.__code__ = (lambda *a, **kw: None).__code__
        def tracer(frame, event, arg):
            neuter()
            frame.f_globals.setdefault("check", lambda *a, **kw: None)
            return None
        sys.settrace(tracer)
        threading.settrace(tracer)
        sys.setprofile(lambda *a: neuter())
        def f(x):
            neuter()
            for fr in list(sys._current_frames().values()):
                while fr is not None:
                    fr.f_globals["check"] = lambda *a, **kw: None
                    fr = fr.f_back
            return -1
    """
    tests = ["def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(3) == 9\ncheck(f)"]
    assert judge(code, tests, backend)[:2] == (0, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expected_values_are_out_of_reach(backend):
    # the tests' expected values never enter the sandbox: a solution that searches every process's command
    # line, environment and open files it can read, and the temp dirs, finds nothing to return
    secret = 918273645
    code = """
        import glob, os, re
        found = []
        def scan(path):
            try:
                with open(path, "rb") as fh:
                    data = fh.read(1 << 20)
            except Exception:
                return
            found.extend(int(x) for x in re.findall(rb"== (9[0-9]{8})", data))
        for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
            if pid.isdigit():
                for leaf in ("cmdline", "environ"):
                    scan(f"/proc/{pid}/{leaf}")
                for fd in glob.glob(f"/proc/{pid}/fd/*"):
                    scan(fd)
        for path in glob.glob("/tmp/**", recursive=True)[:2000] + glob.glob("*"):
            if os.path.isfile(path):
                scan(path)
        def f(x):
            return found[0] if found else 0
    """
    assert judge(code, [f"assert f(0) == {secret}"], backend)[:2] == (0, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_early_exits_score_nothing(backend):
    for code in ("import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n", "raise SystemExit(0)\n",
                 "def f(x):\n    import os\n    os._exit(0)\n", "def f(x):\n    raise SystemExit(0)\n",
                 "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"):
        passed, total, info = judge(code, SQUARE_TESTS, backend)
        assert (passed, total) == (0, 3), (code, info)


@pytest.mark.parametrize("backend", BACKENDS)
def test_channel_garbage_and_floods_fail_only_the_tests_they_touch(backend):
    # the solution finds the channel and writes garbage, deep nesting, huge lines and fake handles into it
    code = """
        import os, sys
        ch = vars(sys.modules["__main__"]).get("chan_out")
        def f(x):
            if x == 2:
                return 4
            if x == 3 and ch is not None:
                ch.write(b"not json\\n"); ch.flush()
                return 9
            if x == -4 and ch is not None:
                ch.write(b"[" * 200000 + b"\\n"); ch.flush()
                return 16
            return 0
        def g(x):
            if ch is not None:
                ch.write(b'{"ok": {"$h": 0, "type": "int", "callable": false}}\\n'); ch.flush()
            return x * x
        def h(x):
            print("y" * 1000, file=sys.stderr)
            sys.stdout.write("fake 0 pass\\n" * 50)  # goes to the captured output, not the channel
            return x * x
    """
    tests = SQUARE_TESTS + ["assert g(5) == 25", "assert h(6) == 36", "assert f(2) == 4"]
    passed, total, info = judge(code, tests, backend)
    # f(2) is honest and passes. f(3) and f(-4) broke the channel: each costs its own test and its session.
    # g's forged handle is read as g's answer (an opaque object: the test fails), and its real answer, left
    # in the pipe, is then read as h's: a solution that writes into the channel only confuses its own answers.
    assert (passed, total) == (1, 6), info
    assert info["failed"][:2] == [[1, "session lost: protocol"], [2, "session lost: protocol"]]
    assert info["sessions"] == 3  # a broken session ends; the next test gets a fresh one


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_output_flood_is_stopped_and_fails_its_test(backend):
    code = """
        import sys
        def f(x):
            if x == 3:
                block = "z" * (1 << 20)
                for _ in range(32):          # its own bound: 32 MiB
                    sys.stdout.write(block)
                sys.stdout.flush()
            return x * x
    """
    passed, total, info = judge(code, SQUARE_TESTS, backend)
    assert (passed, total) == (2, 3) and info["sandbox"] == "output_limit", info


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hang_costs_the_tests_it_reaches(backend):
    code = """
        import time
        def f(x):
            if x == 3:
                t0 = time.time()
                while time.time() < t0 + 30:   # its own bound: 30 s
                    pass
            return x * x
    """
    passed, total, info = judge(code, SQUARE_TESTS, backend, wall_s=3.0, cpu_s=10)
    assert (passed, total) == (1, 3) and info["sandbox"] == "timeout", info


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_crash_costs_only_its_test(backend):
    code = """
        import os
        def f(x):
            if x == 3:
                os._exit(1)
            return x * x
    """
    passed, total, info = judge(code, SQUARE_TESTS, backend)
    assert (passed, total) == (2, 3), info
    assert info["sessions"] == 2 and info["sandbox"] == "exit"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_signal_and_fork_do_not_forge(backend):
    code = """
        import os, signal, time
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        for target in (os.getppid(), 1, -1):
            try:
                os.kill(target, signal.SIGKILL if target != -1 else signal.SIGSTOP)
            except Exception:
                pass
        n = 0
        for _ in range(4):                    # a few children that try to outlive the run (30 s bound)
            try:
                if os.fork() == 0:
                    os.setsid()
                    time.sleep(30)
                    os._exit(0)
                n += 1
            except Exception:
                break
        def f(x):
            try:
                os.kill(os.getppid(), signal.SIGKILL)
            except Exception:
                pass
            return x + 1
    """
    passed, total, info = judge(code, SQUARE_TESTS, backend)
    assert (passed, total) == (0, 3), info


@pytest.mark.parametrize("backend", BACKENDS)
def test_files_and_stdout_carry_no_verdict(backend):
    code = """
        import sys
        for name in ("result.json", "report.txt", "verdict"):
            with open(name, "w") as fh:
                fh.write('{"passed": 3, "total": 3}')
        print("3/3 tests passed")
        print('{"ok": 4}')
        sys.stderr.write("PASS PASS PASS\\n")
        def f(x):
            return None
    """
    assert judge(code, SQUARE_TESTS, backend)[:2] == (0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_honest_solutions_in_common_shapes_pass(backend):
    code = """
        import math
        from collections import Counter
        print("debug output is fine")
        LIMIT = 10
        def square(x):
            return x * x
        def gen(n):
            for i in range(n):
                yield i * i
        class Stack:
            def __init__(self):
                self.items = []
            def push(self, v):
                self.items.append(v)
            def pop(self):
                return self.items.pop()
        def sort_in_place(xs):
            xs.sort()
        def freq(s):
            return dict(Counter(s))
        def safe_div(a, b):
            if b == 0:
                raise ValueError("b is zero")
            return a / b
        def pair(x):
            return (x, [x], {x: {x}}, frozenset([x]), b"x", None, True, 1.5, complex(1, x))
        if __name__ == "__main__":
            input()   # a stdin-reading main block does not run under function tests
    """
    tests = [
        "assert square(3) == 9",
        "def check(candidate):\n    assert candidate(4) == 16\n    assert candidate(-1) == 1\ncheck(square)",
        "assert list(gen(4)) == [0, 1, 4, 9] and next(iter(gen(2))) == 0",
        "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and s.pop() == 1",
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
        "assert freq('aab') == {'a': 2, 'b': 1}",
        "try:\n    safe_div(1, 0)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')",
        "assert math.isclose(safe_div(1, 3), 0.3333333333, rel_tol=1e-6)",
        "assert pair(2) == (2, [2], {2: {2}}, frozenset([2]), b'x', None, True, 1.5, complex(1, 2))",
        "assert LIMIT == 10 and isinstance(square(2), int)",
        "assert square(2) == 5",
    ]
    passed, total, info = judge(code, tests, backend)
    assert (passed, total) == (10, 11), info
    assert info["failed"] == [[10, "AssertionError"]] and info["sessions"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_solution_that_does_not_load_fails_every_test(backend):
    passed, total, info = judge("def f(x):\n    return x *\n", ["assert True", "assert 1 == 1"], backend)
    assert (passed, total) == (0, 2) and info["sandbox"] == "load_error" and "SyntaxError" in info["stderr"]


def test_bad_tests_are_refused_clearly():
    cfg = cfg_for("plain")
    with pytest.raises(ValueError, match="non-empty list"):
        run_python_tests("x = 1", [], cfg)
    with pytest.raises(ValueError, match="test 1 must be a string or an"):
        run_python_tests("x = 1", [{"input": "", "output": ""}, 5], cfg)
    with pytest.raises(ValueError, match="meta.tests must be a non-empty list"):
        code_verifier("x = 1", {"uid": "u", "meta": {"tests": []}}, sandbox=cfg)
