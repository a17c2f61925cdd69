"""User verifiers in the user's own folder, the command-line entry points and the quiet terminal.

The fast tests check the pieces: which ``module:function`` verifiers a run names and where, the driver's
import check and what is shipped to the workers (``cluster.runtime.user_code``), the job's runtime env, relative CLI
paths, the ``[project.scripts]`` entries, and the terminal filter and worker-output redirection
(``cluster.runtime.console``). The slow test runs ``python -m cluster.train`` with ``reward.verifier=myrew:score`` and
``myrew.py`` on the user's PYTHONPATH (not in the working directory) and checks that the rewards are that
function's.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass

import pytest

from cluster.config import ConfigError, load_config
from cluster.runtime.user_code import check_user_loss, check_user_verifiers, module_source, verifier_names
from tests.helpers import REPO_ROOT, TEST_ENV
from tests.helpers.user_code import TINY


@dataclass
class Row:  # the two PromptRow fields verifier_names reads
    uid: str
    verifier: str


@pytest.fixture
def clean_path(monkeypatch):
    """sys.path and sys.modules restored after the test (the check imports user modules)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_verifier_names_and_their_keys():
    cfg = load_config(TINY, ["reward.verifier=myrew:score",
                             "reward.extra_terms=[{verifier: format, weight: 0.1}, {verifier: 'x.y:z'}]"])
    rows = [Row("r1", "rowmod:fn")]
    assert verifier_names(cfg, rows) == {"myrew:score": "reward.verifier", "x.y:z": "reward.extra_terms[1].verifier"}
    # Without reward.verifier, each row's own verifier scores it: a module:function there is checked too.
    cfg = load_config(TINY, [])
    assert verifier_names(cfg, [Row("r1", "rowmod:fn"), Row("r2", "exact"), Row("r3", "rowmod:fn")]) == {
        "rowmod:fn": "the 'verifier' of data row 'r1'"}


def test_module_in_working_dir_is_checked_and_shipped(tmp_path, clean_path):
    (tmp_path / "myrew_cwd.py").write_text("def score(response, row):\n    return 0.5\n")
    ship = check_user_verifiers({"myrew_cwd:score": "reward.verifier"}, cwd=tmp_path)
    assert ship == [str((tmp_path / "myrew_cwd.py").resolve())]
    assert sys.path[0] == str(tmp_path.resolve())


def test_package_on_pythonpath_ships_its_folder(tmp_path, clean_path):
    pkg = tmp_path / "elsewhere" / "mypkg_pp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text("from mypkg_pp import helper\n\ndef fn(response, row):\n    return helper.X\n")
    (pkg / "helper.py").write_text("X = 1.0\n")
    sys.path.append(str(tmp_path / "elsewhere"))  # what PYTHONPATH does
    ship = check_user_verifiers({"mypkg_pp.scores:fn": "reward.extra_terms[0].verifier"}, cwd=tmp_path)
    assert ship == [str(pkg.resolve())]


def test_modules_workers_already_have_are_not_shipped(tmp_path, clean_path):
    named = {"tests.helpers.userfns:half_with_extra": "reward.verifier", "json:dumps": "reward.extra_terms[0].verifier"}
    assert check_user_verifiers(named, cwd=tmp_path) == []
    import json as stdlib_json

    import tests.helpers.userfns as in_repo

    assert module_source(stdlib_json) is None and module_source(in_repo) is None


def test_missing_module_or_function_is_a_config_error(tmp_path, clean_path):
    with pytest.raises(ConfigError) as err:
        check_user_verifiers({"nosuch_mod_13:score": "reward.verifier"}, cwd=tmp_path)
    msg = str(err.value)
    assert msg.startswith("reward.verifier='nosuch_mod_13:score'") and "cannot import module 'nosuch_mod_13'" in msg
    assert str(tmp_path.resolve()) in msg
    (tmp_path / "myrew_nofn.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match=r"reward.verifier='myrew_nofn:score'.*has no callable 'score'"):
        check_user_verifiers({"myrew_nofn:score": "reward.verifier"}, cwd=tmp_path)


def test_cli_refuses_missing_verifier_before_anything_starts(tmp_path):
    env = {**os.environ, **TEST_ENV, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-m", "cluster.train", TINY, "reward.verifier=nosuch_mod_13:score", "--dry-run"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "error: reward.verifier='nosuch_mod_13:score'" in r.stderr and "'nosuch_mod_13'" in r.stderr


def test_cli_paths_are_from_the_working_dir(tmp_path):
    """A relative config path, output dir and model folder are taken from where the command runs (the folder
    exists: an ``owner/name`` path naming nothing there is a hub id, cluster/models/hub_model.py)."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "cfg" / "mine.yaml").write_text((REPO_ROOT / "configs" / "tiny_moe_zero2.yaml").read_text())
    (tmp_path / "myrew_cli.py").write_text("def score(response, row):\n    return 1.0\n")
    env = {**os.environ, **TEST_ENV, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-m", "cluster.train", "cfg/mine.yaml", "model.path=models/m", "--dry-run",
                        "trainer.output_dir=runs", "reward.verifier=myrew_cli:score"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import yaml

    cfg = yaml.safe_load(r.stdout)["config"]
    assert cfg["model"]["path"] == str(tmp_path.resolve() / "models" / "m")
    assert cfg["trainer"]["output_dir"] == str(tmp_path.resolve() / "runs")


def test_absolute_paths_leaves_builtin_and_absolute_alone(tmp_path):
    from cluster.config import absolute_paths

    cfg = absolute_paths(load_config(TINY, ["trainer.output_dir=/abs/out"]), cwd=tmp_path)
    assert cfg.model.path == "builtin:tiny_moe" and cfg.trainer.output_dir == "/abs/out"


def test_job_runtime_env_carries_user_modules(tmp_path):
    from cluster.submit.job import job_runtime_env

    rt = job_runtime_env(py_modules=[str(tmp_path / "myrew.py")], extra={"py_modules": ["s3://b/m.zip"]})
    assert rt["py_modules"] == [str(tmp_path / "myrew.py"), "s3://b/m.zip"]
    assert rt["working_dir"] == str(REPO_ROOT)
    assert "py_modules" not in job_runtime_env()


def test_project_scripts_point_to_main_functions():
    import importlib

    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"gspo-train", "gspo-submit", "gspo-compare", "gspo-audit", "gspo-cluster",
                            "gspo-import-gguf", "gspo-merge-lora", "gspo-upcycle"}
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        main = getattr(importlib.import_module(module), attr)
        with pytest.raises(SystemExit) as done:  # --help: argparse prints usage naming the command and exits 0
            main(["--help"])
        assert done.value.code == 0, name


def test_terminal_filter_passes_own_records_and_errors():
    from cluster.runtime.console import OwnOrErrors

    f = OwnOrErrors()

    def rec(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    assert f.filter(rec("cluster.train", logging.INFO)) and f.filter(rec("reward.pool", logging.WARNING))
    assert not f.filter(rec("vllm.engine", logging.WARNING)) and not f.filter(rec("py.warnings", logging.WARNING))
    assert f.filter(rec("ray", logging.ERROR)) and f.filter(rec("transformers", logging.CRITICAL))


def test_worker_output_goes_to_the_log_folder(tmp_path):
    """The worker setup hook moves file descriptors 1 and 2: Python prints, raw fd writes and a child's
    output land in worker-<pid>.log, nothing on the process's own stdout/stderr."""
    code = ("import os, subprocess, sys; from cluster.runtime.console import redirect_worker_output; "
            "redirect_worker_output(); print('py-out'); print('py-err', file=sys.stderr); sys.stdout.flush(); "
            "os.write(2, b'fd-err\\n'); subprocess.run(['echo', 'child-out']); print(os.getpid(), file=sys.__stdout__)")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "GSPO_WORKER_LOG_DIR": str(tmp_path / "w")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
    (log,) = (tmp_path / "w").glob("worker-*.log")
    text = log.read_text()
    for piece in ("py-out", "py-err", "fd-err", "child-out"):
        assert piece in text
    # Without the variable (a verbose run) the hook changes nothing.
    env.pop("GSPO_WORKER_LOG_DIR")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "py-out" in r.stdout and "fd-err" in r.stderr


USER_LOSS = """from dataclasses import dataclass

import torch

from learner.loss_registry import LossTerms, RatioUnits, register_policy_loss


@dataclass(frozen=True)
class Settings:
    scale: float = 1.0
    loss_agg: str = "token_mean"


@register_policy_loss(settings=Settings)
def my_loss(x, s):
    zero = torch.zeros_like(x.lp)
    return LossTerms(-s.scale * x.aggregate(x.adv * x.lp, s.loss_agg), RatioUnits(x.mask, zero + 1, zero, zero, zero))
"""


def test_user_loss_is_checked_and_shipped(tmp_path, clean_path):
    """learner.algorithm=module:function: imported on the driver, its settings built from the config, its
    module shipped to the workers; a built-in loss ships nothing."""
    (tmp_path / "myloss_cwd.py").write_text(USER_LOSS)
    cfg = load_config(TINY, ["learner.algorithm=myloss_cwd:my_loss", "learner.loss_options={scale: 2}"])
    assert check_user_loss(cfg, cwd=tmp_path) == [str((tmp_path / "myloss_cwd.py").resolve())]
    assert check_user_loss(load_config(TINY, []), cwd=tmp_path) == []
    bad = load_config(TINY, ["learner.algorithm=myloss_cwd:my_loss", "learner.loss_options={beta: 2}"])
    with pytest.raises(ConfigError, match="learner.algorithm='myloss_cwd:my_loss': loss_options.beta=2 is not a"):
        check_user_loss(bad, cwd=tmp_path)
    missing = load_config(TINY, ["learner.algorithm=no_such_loss_mod:f"])
    with pytest.raises(ConfigError, match="cannot import module 'no_such_loss_mod'.*working directory"):
        check_user_loss(missing, cwd=tmp_path)
