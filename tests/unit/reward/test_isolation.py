"""Issue 27: model code runs only under bubblewrap unless the config opts into ``plain`` (which then says, once,
what it does not stop); the scratch space is bounded and a run that fills it fails; any tree a run leaves is
removed without raising.

Hostile programs bound themselves (at most 256 MiB written, 1500 directory levels), so a sandbox that fails
cannot fill the machine; bwrap cases skip with a reason where bubblewrap does not work here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from reward import bwrap, sandbox
from reward.cleanup import remove_tree
from reward.config import RewardConfig, SandboxConfig
from reward.judge import run_python_tests
from reward.sandbox import SandboxUnavailable, bwrap_available, run_python, sandbox_python
from reward.worker import RewardWorker
from tests.helpers import REPO_ROOT

HAVE_BWRAP = bwrap_available(sandbox_python(SandboxConfig()))
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap (bwrap >= 0.8) not usable here: "
                                 "apt-get install -y bubblewrap")
BACKENDS = [pytest.param("bwrap", marks=needs_bwrap), "plain"]


def cfg_for(backend: str, tmp_root: Path | None = None, **kw) -> SandboxConfig:
    base = dict(backend=backend, wall_s=8.0, cpu_s=4, memory_mb=256, max_procs=12, file_size_mb=64.0,
                scratch_mb=16, tmp_root=str(tmp_root) if tmp_root else None)
    base.update(kw)
    return SandboxConfig(**base)


@pytest.fixture
def runs():
    """An empty directory for the runs' temp dirs that the sandbox uid can reach (pytest's tmp_path is in a
    directory only root may enter); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="sbx-runs-"))
    os.chmod(path, 0o711)
    yield path
    remove_tree(str(path))


@pytest.fixture
def no_bwrap(tmp_path, monkeypatch):
    """This process sees no ``bwrap`` (an empty ``PATH`` directory first is not enough: ``PATH`` is only it)."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    bwrap.probe.cache_clear()
    yield
    bwrap.probe.cache_clear()


# --- 1. secure by default -------------------------------------------------------------------------------------

def test_default_is_bwrap_and_removed_keys_are_refused_clearly():
    assert SandboxConfig().backend == "bwrap"
    with pytest.raises(ValueError, match="backend='auto' was removed"):
        SandboxConfig(backend="auto")
    with pytest.raises(ValueError, match="require_bwrap=True was removed"):
        SandboxConfig(require_bwrap=True)
    with pytest.raises(ValueError, match="backend"):
        RewardConfig(sandbox={"backend": "none"})


def test_without_bubblewrap_model_code_is_refused_not_run_unsandboxed(no_bwrap, tmp_path):
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\nprint('ran')\n"
    with pytest.raises(SandboxUnavailable, match="not installed.*apt-get install -y bubblewrap.*backend: plain"):
        run_python(code, SandboxConfig())
    with pytest.raises(SandboxUnavailable):
        run_python_tests("def f(x):\n    return x\n", ["assert f(1) == 1"], SandboxConfig())
    assert not marker.exists()


def test_plain_says_once_what_it_does_not_stop(caplog, monkeypatch):
    monkeypatch.setattr(sandbox, "_plain_warned", False)
    cfg = cfg_for("plain")
    with caplog.at_level(logging.WARNING, logger="reward.sandbox"):
        for _ in range(3):
            assert run_python("print('hi')", cfg).stdout.strip() == "hi"
        run_python_tests("def f(x):\n    return x\n", ["assert f(1) == 1"], cfg)
    warned = [r for r in caplog.records if "WITHOUT a sandbox" in r.getMessage()]
    assert len(warned) == 1
    text = warned[0].getMessage()
    for what in ("switching off", "reading any file", "starting programs", "network", "bubblewrap"):
        assert what in text


def test_worker_refuses_at_start_when_code_needs_missing_bubblewrap(no_bwrap):
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        RewardWorker(RewardConfig(verifier="code"))


@pytest.mark.timeout(120)
def test_worker_stops_scoring_when_a_code_row_meets_missing_bubblewrap(no_bwrap):
    """A row's own ``code`` verifier (not known at the worker's start): its call finds no bubblewrap, and the
    worker raises instead of scoring the row 0 (which would train the policy on a configuration problem)."""
    from reward.contracts import RewardRequest
    from rollout.contracts import PromptRow

    w = RewardWorker(RewardConfig(timeout_s=20.0))
    try:
        row = PromptRow(uid="c", prompt="", prompt_token_ids=[1], answer="", verifier="code", meta={"tests": ["assert f(1) == 1"]})
        math_row = PromptRow(uid="m", prompt="", prompt_token_ids=[1], answer="18", verifier="math", meta={})
        assert w.score([RewardRequest("#### 18", math_row)])[0].score == 1.0  # math needs no sandbox
        with pytest.raises(SandboxUnavailable, match="bubblewrap"):
            w.score([RewardRequest("def f(x):\n    return x\n", row)])
    finally:
        w.close()


def test_worker_with_plain_announces_once(caplog, monkeypatch):
    monkeypatch.setattr(sandbox, "_plain_warned", False)
    with caplog.at_level(logging.WARNING, logger="reward.sandbox"):
        assert sandbox.announce(cfg_for("plain")) == "plain"
        assert sandbox.announce(cfg_for("plain")) == "plain"
    assert sum("WITHOUT a sandbox" in r.getMessage() for r in caplog.records) == 1


@needs_bwrap
def test_guard_tricks_do_not_reach_the_host_under_bwrap():
    """What beats plain's in-process guard (switching the hook off is moot here: there is none; a spawn
    through libc directly) reaches nothing of the host under bubblewrap."""
    secret = REPO_ROOT / "CONTRIBUTING.md"
    res = run_python(textwrap.dedent(f"""
        import ctypes, os
        libc = ctypes.CDLL(None)
        pid = ctypes.c_int()
        argv = (ctypes.c_char_p * 3)(b"/bin/cat", {str(secret).encode()!r}, None)
        rc = libc.posix_spawn(ctypes.byref(pid), b"/bin/cat", None, None, argv, None)
        if rc == 0:
            os.waitpid(pid.value, 0)
        for p in ({str(secret)!r}, "/root", "/etc/passwd"):
            print(p, os.path.exists(p))
    """), cfg_for("bwrap"))
    assert "Working on this project" not in res.stdout + res.stderr
    assert f"{secret} False" in res.stdout and "/root False" in res.stdout and "/etc/passwd False" in res.stdout


# --- 2. bounded scratch space ---------------------------------------------------------------------------------

FILL = """
import os
n = 0
try:
    for i in range(256):                        # its own bound: 256 MiB
        with open(os.path.join({where!r}, f"fill{{i}}.bin"), "wb") as f:
            f.write(b"z" * (1 << 20))
        n += 1
except OSError as err:
    print("stopped", n, err.errno, flush=True)
print("done", n, flush=True)
"""


@needs_bwrap
@pytest.mark.parametrize("where", [".", "/tmp"])
def test_filling_the_scratch_space_is_stopped_and_lands_nowhere_outside(where, runs):
    res = run_python(FILL.format(where=where), cfg_for("bwrap", runs, scratch_mb=16))
    assert res.status == "scratch_limit", res
    written = int(res.stdout.split("done")[1].split()[0]) if "done" in res.stdout else 0
    assert written <= 16
    assert list(runs.iterdir()) == []  # the temp dir is gone, and nothing was ever written there


@needs_bwrap
def test_only_the_scratch_space_is_writable():
    res = run_python(textwrap.dedent("""
        import ctypes, os
        for d in ("/", "/dev", "/dev/shm", "/usr", "/proc"):
            try:
                with open(os.path.join(d, "x"), "wb") as f:
                    f.write(b"x")
                print("wrote", d)
            except OSError as err:
                print("refused", d)
        libc = ctypes.CDLL(None, use_errno=True)
        print("unshare", libc.unshare(0x10000000 | 0x00020000))  # a user + mount namespace: a tmpfs of its own
        open("ok.txt", "w").write("fine")
        print("scratch ok")
    """), cfg_for("bwrap"))
    assert "wrote" not in res.stdout and "scratch ok" in res.stdout, res
    assert "unshare -1" in res.stdout


@needs_bwrap
def test_a_solution_that_fills_its_scratch_scores_zero():
    fill_then_answer = FILL.format(where="/tmp") + "def f(x):\n    return x * x\n"
    tests = ["assert f(2) == 4", "assert f(3) == 9"]
    passed, total, info = run_python_tests(fill_then_answer, tests, cfg_for("bwrap"))
    assert (passed, total) == (0, 2) and info["sandbox"] == "scratch_limit", info
    stdio = FILL.format(where=".") + "print(int(input()) * 2)\n"
    passed, _, info = run_python_tests(stdio, [{"input": "3", "output": "6"}], cfg_for("bwrap"))
    assert passed == 0 and info["sandbox"] == "scratch_limit", info
    honest = "def f(x):\n    open('/tmp/note', 'w').write('x' * 1000)\n    return x * x\n"
    assert run_python_tests(honest, tests, cfg_for("bwrap"))[:2] == (2, 2)


# --- 3. any tree cleaned --------------------------------------------------------------------------------------

TREE = """
import os
os.mkdir("locked"); os.mkdir("locked/inner"); open("locked/inner/f", "w").write("x")
os.chmod("locked/inner", 0); os.chmod("locked", 0o500)
for target, name in ((".", "loop"), ("loop", "loop2"), ("/", "host_root")):
    try:
        os.symlink(target, name)
    except OSError:                              # plain's guard refuses a link out: the rest still counts
        pass
base = os.getcwd()
for i in range(1500):                            # its own bound: 1500 levels (rmtree's recursion gives up at ~1000)
    os.mkdir("d")
    os.chdir("d")
open("deep.txt", "w").write("bottom")
os.chdir(base)
print("built", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_any_tree_a_run_leaves_is_removed_without_raising(backend, runs):
    res = run_python(TREE, cfg_for(backend, runs, wall_s=30.0, cpu_s=20))
    assert res.status == "ok" and "built" in res.stdout, res
    assert list(runs.iterdir()) == []
    assert Path("/").exists() and REPO_ROOT.joinpath("CONTRIBUTING.md").exists()  # links were not followed


# builds ``depth`` nested directories through descriptors (the path is longer than PATH_MAX), a file and a link
# up every 500 levels, a FIFO, a directory without any permission, and links to itself and to /; then removes it
REMOVE = """
import os, sys
sys.path.insert(0, {repo!r})
sys.setrecursionlimit(1000)
from reward.cleanup import remove_tree
root = {root!r}
os.mkdir(root)
fd = os.open(root, os.O_RDONLY)
for i in range(3000):
    os.mkdir("d", dir_fd=fd)
    nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    fd = nxt
    if i % 500 == 0:
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
        os.symlink("..", "up", dir_fd=fd)
os.mkfifo("fifo", dir_fd=fd)
os.mkdir("shut", dir_fd=fd)
os.close(os.open("shut/x", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
os.chmod("shut", 0, dir_fd=fd)
os.fchmod(fd, 0o500)
os.close(fd)
os.symlink(root, root + "/self")
os.symlink("/", root + "/host")
print(remove_tree(root), os.path.lexists(root))
"""


@pytest.mark.timeout(120)
def test_remove_tree_survives_depth_permissions_and_link_loops(runs):
    """Run as an unprivileged uid where we are root, so the missing permissions are real."""
    os.chmod(runs, 0o777)
    user = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    python = "/usr/bin/python3" if user and os.path.exists("/usr/bin/python3") else sys.executable
    out = subprocess.run([python, "-I", "-c", REMOVE.format(repo=str(REPO_ROOT), root=str(runs / "t"))],
                         capture_output=True, text=True, timeout=100, cwd="/", **user)
    assert out.returncode == 0 and out.stdout.split() == ["True", "False"], out.stderr[-2000:]
    assert Path("/").exists() and REPO_ROOT.joinpath("reward").is_dir()
