"""The code sandbox against hostile programs, on both backends (bwrap is skipped, clearly, where missing).

Every hostile program is bounded by itself (a few hundred processes, a few GiB, some MB of output, a
sleep), so a sandbox that fails cannot take the machine down; each test asserts the sandbox stopped it well
before its own bound, reported it, and left no process of the run alive.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import textwrap
from pathlib import Path

import psutil
import pytest

from reward.config import SandboxConfig
from reward.judge import run_python_tests
from reward.sandbox import SandboxUnavailable, bwrap_available, choose_backend, run_python, sandbox_python
from reward.sandbox_procs import ENV_RUN, _uid_processes, find_run_processes, sandbox_uid
from tests.helpers import REPO_ROOT
from tests.helpers.sandbox import FORK_BOMB

REPO = REPO_ROOT


HAVE_BWRAP = bwrap_available(sandbox_python(SandboxConfig()))


BACKENDS = [
    pytest.param("bwrap", marks=pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap (bwrap) not usable here")),
    "plain",
]


MAX_PROCS = 12



def cfg_for(backend: str, **kw) -> SandboxConfig:
    base = dict(backend=backend, wall_s=6.0, cpu_s=2, memory_mb=256, max_procs=MAX_PROCS, max_output_kb=64,
                file_size_mb=1.0)
    base.update(kw)
    return SandboxConfig(**base)


def run(code: str, backend: str, **kw):
    return run_python(textwrap.dedent(code), cfg_for(backend, **kw))


def assert_nothing_left(res) -> None:
    assert find_run_processes(ENV_RUN, res.run_id) == []
    uid = sandbox_uid()
    if uid is not None:
        assert _uid_processes(uid) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_program_runs_with_minimal_env(backend):
    res = run("""
        import os, sys
        print("hello", sys.stdin.read().strip())
        print(sorted(os.environ))
        print(os.getcwd(), os.getuid() != 0)
    """, backend)
    assert res.status == "ok" and res.backend == backend, res
    lines = res.stdout.splitlines()
    assert lines[0].strip() == "hello"
    assert "HOME" in lines[1] and "PATH" in lines[1]
    assert lines[2].endswith("True")
    assert_nothing_left(res)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_loop_is_stopped(backend):
    res = run("while True:\n    pass\n", backend)
    assert res.status in ("cpu_limit", "timeout"), res
    assert_nothing_left(res)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_bomb_is_capped(backend):
    res = run(FORK_BOMB, backend, wall_s=8.0)
    assert "blocked" in res.stdout, res
    forked = int(res.stdout.split("forked")[1].split()[0])
    assert forked < MAX_PROCS
    assert_nothing_left(res)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_after_a_fork_bomb_forks_as_freely(backend):
    """The fork bomb's children, orphaned when its run is killed, are reaped by this process: where PID 1 does
    not reap (a container's init, as here), their zombies would count against the sandbox uid's process limit,
    and the next run of this process could not fork (EAGAIN) whenever the bomb had filled it."""
    assert "blocked" in run(FORK_BOMB, backend, wall_s=8.0).stdout
    res = run(f"""
        import os, time
        kids = []
        for _ in range({MAX_PROCS - 2}):   # with the interpreter, MAX_PROCS - 1 processes alive at once
            pid = os.fork()
            if pid == 0:
                time.sleep(1)
                os._exit(0)
            kids.append(pid)
        for pid in kids:
            os.waitpid(pid, 0)
        print("forked", len(kids), flush=True)
    """, backend)
    assert res.status == "ok" and f"forked {MAX_PROCS - 2}" in res.stdout, res
    assert_nothing_left(res)
    if sandbox_uid() is not None:
        assert [p.pid for p in psutil.Process().children() if p.uids().real == sandbox_uid()] == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_hog_is_capped(backend):
    res = run("""
        hold = []
        for i in range(64):                # its own bound: 64 x 64 MiB = 4 GiB
            hold.append(b"x" * (64 << 20))
            print("chunk", i + 1, flush=True)
        print("done")
    """, backend)
    assert res.status == "exit" and "MemoryError" in res.stderr, res
    chunks = [int(x.split()[1]) for x in res.stdout.splitlines() if x.startswith("chunk")]
    assert max(chunks, default=0) * 64 <= 256 and "done" not in res.stdout
    assert_nothing_left(res)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_output_flood_is_cut(backend):
    res = run("""
        import sys
        block = "y" * (1 << 20)
        for _ in range(64):                # its own bound: 64 MiB
            sys.stdout.write(block)
        sys.stdout.flush()
        print("done", file=sys.stderr)
    """, backend)
    assert res.status == "output_limit", res
    assert len(res.stdout) + len(res.stderr) <= 2 * 64 * 1024
    assert "done" not in res.stderr
    assert_nothing_left(res)


@pytest.mark.parametrize("backend", BACKENDS)
def test_big_file_is_capped(backend):
    res = run("""
        with open("big.bin", "wb") as f:
            for _ in range(64):            # its own bound: 64 MiB
                f.write(b"z" * (1 << 20))
        print("done")
    """, backend)
    assert res.status != "ok" and "done" not in res.stdout, res  # SIGXFSZ / EFBIG at 1 MiB
    assert_nothing_left(res)


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_outside_the_temp_dir_do_not_land(backend):
    outside = Path(tempfile.mkdtemp(prefix="sbx-outside-"))
    os.chmod(outside, 0o777)  # world-writable: only the sandbox can stop the write
    direct = Path(tempfile.gettempdir()) / f"sbx-escape-{os.getpid()}.txt"
    try:
        res = run(f"""
            for p in ({str(outside / 'pwned.txt')!r}, {str(direct)!r}, {str(REPO / 'pwned.txt')!r}):
                try:
                    with open(p, "w") as f:
                        f.write("pwned")
                    print("wrote", p)
                except OSError as err:
                    print("refused", p, type(err).__name__)
            open("inside.txt", "w").write("fine")
            print("inside ok")
        """, backend)
        assert "inside ok" in res.stdout, res
        assert not (outside / "pwned.txt").exists()
        assert not direct.exists()
        assert not (REPO / "pwned.txt").exists()
        assert f"refused {outside / 'pwned.txt'}" in res.stdout
        assert_nothing_left(res)
    finally:
        shutil.rmtree(outside, ignore_errors=True)
        direct.unlink(missing_ok=True)
        (REPO / "pwned.txt").unlink(missing_ok=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parent_secrets_and_project_files_are_out_of_reach(backend, monkeypatch):
    secret = "sk-test-" + os.urandom(8).hex()
    monkeypatch.setenv("GSPO_FAKE_API_KEY", secret)
    res = run(f"""
        import os
        print("ENV", dict(os.environ))
        for p in ("/proc/%d/environ" % os.getppid(), "/proc/1/environ", {str(REPO / 'CONTRIBUTING.md')!r},
                  "/root/.bashrc", {str(Path.home())!r}):
            try:
                if os.path.isdir(p):
                    print("LISTED", p, os.listdir(p))
                else:
                    print("READ", p, open(p, "rb").read()[:4000])
            except OSError as err:
                print("refused", p, type(err).__name__)
    """, backend)
    text = res.stdout + res.stderr
    assert "ENV" in res.stdout, res
    assert secret not in text
    assert "Working on this project" not in text  # CONTRIBUTING.md's first line
    assert "LISTED" not in text and f"READ {REPO}" not in text
    assert_nothing_left(res)


@pytest.mark.parametrize("backend", BACKENDS)
def test_network_connection_is_refused(backend):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        res = run(f"""
            import socket
            try:
                s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
                s.sendall(b"exfiltrated")
                print("connected")
            except OSError as err:
                print("refused", type(err).__name__)
        """, backend)
        assert "refused" in res.stdout and "connected" not in res.stdout, res
        listener.settimeout(0.5)
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever reached the listener
        assert_nothing_left(res)
    finally:
        listener.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_child_that_tries_to_outlive_the_run_is_killed(backend):
    res = run("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(30)             # its own bound
                os._exit(0)
            os._exit(0)
        time.sleep(0.3)
        print("parent done", flush=True)
    """, backend)
    assert res.status == "ok" and "parent done" in res.stdout, res
    if backend == "plain":
        assert res.leftover_killed >= 1  # it was alive after the main process ended, and got killed
    assert_nothing_left(res)


def test_backend_choice_and_requirement():
    assert choose_backend(SandboxConfig(backend="plain")) == "plain"
    if HAVE_BWRAP:
        assert choose_backend(SandboxConfig()) == "bwrap"
    # where bubblewrap cannot run (here: a probe with a missing interpreter), model code is refused: no fallback
    missing = SandboxConfig(python="/nonexistent/python3")
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        choose_backend(missing)


@pytest.mark.parametrize("backend", BACKENDS)
def test_assert_tests_count_passes_and_resist_forged_lines(backend):
    cfg = cfg_for(backend)
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]
    assert run_python_tests("def add(a, b):\n    return a + b\n", tests, cfg)[:2] == (2, 3)
    forged = "import sys\nfor i in range(3):\n    print('0', i, 'pass')\nsys.stdout.flush()\nimport os\nos._exit(0)\n"
    assert run_python_tests(forged, tests, cfg)[:2] == (0, 3)
    assert run_python_tests("raise SystemExit(0)", tests, cfg)[:2] == (0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stdio_tests(backend):
    cfg = cfg_for(backend)
    tests = [{"input": "3\n", "output": "6"}, {"input": "10\n", "output": "20\n"}, {"input": "1", "output": "3"}]
    passed, total, info = run_python_tests("print(int(input()) * 2)", tests, cfg)
    assert (passed, total) == (2, 3) and info["backend"] == backend
