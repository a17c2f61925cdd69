"""A user's own folder submitted with the job (cluster/submit/folder.py, cluster.submit.job.prepare_config): what
travels, and the errors before submission. No cluster is started."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from cluster.submit import folder as submit_folder
from cluster.submit import job as submit
from cluster.config import ConfigError
from tests.helpers import REPO_ROOT
from tests.helpers.submit import _cli, _env

EXCLUDES = submit.WORKING_DIR_EXCLUDES


def _project(root, verifier="myrew_t1:score", mod="myrew_t1"):
    """A user folder: a config naming a verifier in it, data beside it, junk that must not travel."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{mod}.py").write_text("import helper_t1\ndef score(response, row):\n    return helper_t1.one()\n")
    (root / "helper_t1.py").write_text("def one():\n    return 1.0\n")
    (root / "pkg_t1").mkdir(exist_ok=True)
    (root / "pkg_t1" / "__init__.py").write_text("")
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 8)
    for junk in ("outputs/x.bin", ".git/objects/y", "__pycache__/z.pyc", ".venv/lib/w.py"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_bytes(b"0" * 100)
    (root / "conf.yaml").write_text(f"reward:\n  verifier: {verifier}\ndata:\n  task: files\n"
                                    "  train_path: data/rows.jsonl\n  eval_fraction: 0.25\n")
    return root / "conf.yaml"


def test_choose_folder(tmp_path):
    conf = _project(tmp_path / "proj")
    assert submit_folder.choose_folder(str(conf), cwd=tmp_path / "proj") == tmp_path / "proj"
    assert submit_folder.choose_folder(str(conf), cwd=tmp_path / "elsewhere") == tmp_path / "proj"  # config's folder
    assert submit_folder.choose_folder(str(conf), folder=str(tmp_path)) == tmp_path
    with pytest.raises(ConfigError, match="not inside the folder"):
        submit_folder.choose_folder(str(conf), folder=str(REPO_ROOT / "configs"))
    with pytest.raises(ConfigError, match="holds this repository"):
        submit_folder.choose_folder(str(conf), folder="/")


def test_files_excludes_and_gitignore(tmp_path):
    conf = _project(tmp_path / "proj")
    root = conf.parent
    (root / ".gitignore").write_text("secret.txt\n")
    (root / "secret.txt").write_text("x")
    names = {p.relative_to(root).as_posix() for p, _ in submit_folder.folder_files(root, EXCLUDES)}
    assert {"conf.yaml", "myrew_t1.py", "helper_t1.py", "pkg_t1/__init__.py", "data/rows.jsonl"} <= names
    assert not any(n.startswith(("outputs/", ".git/", "__pycache__/", ".venv/")) for n in names)
    assert "secret.txt" not in names
    files = submit_folder.folder_files(root, EXCLUDES)
    assert submit_folder.top_level_modules(root, files) == sorted(
        str(root / n) for n in ("helper_t1.py", "myrew_t1.py", "pkg_t1"))


def test_size_limit_names_largest_files(tmp_path):
    conf = _project(tmp_path / "proj")
    root = conf.parent
    (root / "data" / "big.bin").write_bytes(__import__("os").urandom(300_000))
    assert submit_folder.check_folder_size(root, EXCLUDES, limit=10_000_000) > 300_000
    with pytest.raises(ConfigError, match=r"too large.*Largest files: data/big\.bin \(0\.3 MiB\)") as err:
        submit_folder.check_folder_size(root, EXCLUDES, limit=200_000)
    assert "RAY_max_grpc_message_size" in str(err.value) and ".rayignore" in str(err.value)
    (root / ".rayignore").write_text("data/big.bin\n")  # left out: under the limit again
    submit_folder.check_folder_size(root, EXCLUDES, limit=200_000)
    assert submit_folder.ray_package_limit() == 512 * 1024 * 1024  # Ray's default


def test_module_clash_with_the_repository(tmp_path):
    (tmp_path / "reward.py").write_text("")
    files = submit_folder.folder_files(tmp_path, EXCLUDES)
    with pytest.raises(ConfigError, match="named like this project's own \\(reward\\)"):
        submit_folder.top_level_modules(tmp_path, files)


def test_prepare_config_ships_the_folder_as_the_working_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    conf = _project(tmp_path / "proj")
    root = conf.parent
    prep = submit.prepare_config(str(conf), ["trainer.output_dir=runs"])
    assert prep["root"] == root
    # the folder's own modules travel with it (the working_dir): only this project's packages go as py_modules
    assert prep["py_modules"] == [str(REPO_ROOT / n) for n in ("rollout", "learner", "reward", "cluster")]
    assert all(Path(m).is_dir() for m in prep["py_modules"])  # Ray's job client ships folders only
    assert not any(o.startswith("data.train_path=") for o in prep["overrides"])  # stays relative: travels
    assert any(o.startswith("trainer.output_dir=/") for o in prep["overrides"])
    cmd = submit_folder.folder_entrypoint(root, str(conf), prep["overrides"], "python")
    assert cmd[:4] == ["python", "-m", "cluster.train", "conf.yaml"]
    rt = submit.job_runtime_env(py_modules=prep["py_modules"], working_dir=root)
    assert rt["working_dir"] == str(root) and rt["py_modules"] == prep["py_modules"]
    assert submit.job_runtime_env()["working_dir"] == str(REPO_ROOT)


def test_single_file_modules_outside_what_travels_are_refused(tmp_path, monkeypatch):
    """Ray 2.60's job client packs every py_modules entry as a folder: a single-file module outside the shipped
    folder (or, for a config in the repository, outside the repository) is refused, naming it."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "farrew_t3.py").write_text("def score(response, row):\n    return 1.0\n")
    monkeypatch.setenv("PYTHONPATH", str(lib))
    sys.path.insert(0, str(lib))
    conf = _project(tmp_path / "proj", "farrew_t3:score", "unused_t3")
    with pytest.raises(ConfigError, match="farrew_t3.py.*single file"):
        submit.prepare_config(str(conf), [])
    with pytest.raises(ConfigError, match="farrew_t3.py.*single file outside the repository"):
        submit.prepare_config(str(REPO_ROOT / "configs/tiny_moe_zero2.yaml"), ["reward.verifier=farrew_t3:score"])


def test_prepare_config_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    conf = _project(tmp_path / "p1", verifier="nosuchmod_t1:score")
    with pytest.raises(ConfigError, match="reward.verifier='nosuchmod_t1:score'.*nosuchmod_t1"):
        submit.prepare_config(str(conf), [])
    conf = _project(tmp_path / "p2", "myrew_t2:score", "myrew_t2")  # a module not imported before
    with pytest.raises(ConfigError, match="data.train_path='nope.jsonl' does not exist"):
        submit.prepare_config(str(conf), ["data.train_path=nope.jsonl"])
    with pytest.raises(ConfigError, match="too large"):
        submit.prepare_config(str(conf), [], limit=1000)
    (conf.parent / ".rayignore").write_text("myrew_t2.py\n")
    with pytest.raises(ConfigError, match="left out of the shipped folder"):
        submit.prepare_config(str(conf), [])
    with pytest.raises(ConfigError, match="--folder is for a config outside"):
        submit.prepare_config(str(REPO_ROOT / "configs/tiny_moe_zero2.yaml"), [], folder=str(tmp_path))


def test_cli_refuses_an_oversized_folder_before_submitting(tmp_path):
    conf = _project(tmp_path / "proj")
    r = _cli(str(conf), env=_env(RAY_max_grpc_message_size="1000", RAY_ADDRESS="http://127.0.0.1:9"),
             cwd=tmp_path / "proj")
    assert r.returncode == 2 and "too large to travel with the job" in r.stderr, r.stderr[-2000:]
    assert shlex.quote(str(tmp_path / "proj")) in r.stderr or str(tmp_path / "proj") in r.stderr
