"""User verifiers in the user's own folder, the command-line entry points and the quiet terminal.

The fast tests check the pieces: which ``module:function`` verifiers a run names and where, the driver's
import check and what is shipped to the workers (``cluster.runtime.user_code``), the job's runtime env, relative CLI
paths, the ``[project.scripts]`` entries, and the terminal filter and worker-output redirection
(``cluster.runtime.console``). The slow test runs ``python -m cluster.train`` with ``reward.verifier=myrew:score`` and
``myrew.py`` on the user's PYTHONPATH (not in the working directory) and checks that the rewards are that
function's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, TEST_ENV
from tests.helpers.user_code import TINY


@pytest.mark.timeout(1200)
def test_run_with_verifier_on_user_pythonpath_scores_with_it(tmp_path):
    """``python -m cluster.train`` with ``reward.verifier=myrew:score``, ``myrew.py`` in a folder of the
    user's ``PYTHONPATH`` and the run started from another folder (as ``make -C repo train`` does; Ray itself
    puts only the driver's working directory on the workers' ``sys.path``): the reward workers import it
    (shipped with ``py_modules``, the user's PYTHONPATH kept after the repository's), every reward is its 0.123
    (no built-in verifier gives that mean over 0/1 scores), the terminal stays quiet and the services' output
    is in the run's logs folder."""
    lib, cwd = tmp_path / "lib", tmp_path / "run"
    lib.mkdir()
    cwd.mkdir()
    pids = tmp_path / "pids.txt"  # where the shipped copy records its calls (its own __file__ is Ray's copy)
    (lib / "myrew.py").write_text(
        "import os\n\n"
        "def score(response, row):\n"
        f"    with open({str(pids)!r}, 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n"
        "    print('myrew scored', flush=True)\n"
        "    return 0.123\n")
    env = {**os.environ, **TEST_ENV, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{lib}"}
    overrides = ["reward.verifier=myrew:score", "trainer.total_steps=1", "warm_start.steps=0",
                 "trainer.prompts_per_step=8", "trainer.group_size=4", "learner.micro_batch_size=2",
                 "data.num_eval=8", "wandb.mode=disabled", "trainer.output_dir=runs", "trainer.run_name=mine",
                 "trainer.plots=false"]
    r = subprocess.run([sys.executable, "-m", "cluster.train", TINY, *overrides], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=1100)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    run = cwd / "runs" / "mine"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step1 = [row for row in rows if row["step"] == 1][0]
    assert step1["reward/mean"] == pytest.approx(0.123) and step1["reward/accuracy"] == 0.0
    # It ran in the reward workers (not in the driver) and every call of it was recorded.
    calls = pids.read_text().split()
    assert len(calls) >= 8 * 4 + 8 and str(os.getpid()) not in calls
    # Quiet terminal: the workers' output (the verifier's print, vLLM's and DeepSpeed's messages) is in the
    # run's log folder, not on the terminal; the step line is.
    assert "myrew scored" not in r.stderr + r.stdout and "(RolloutEngine pid=" not in r.stderr
    worker_logs = "".join(p.read_text(errors="replace") for p in (run / "logs" / "workers").glob("*.log"))
    assert "myrew scored" in worker_logs
    assert "step 1/1" in r.stderr and (run / "logs" / "driver.log").is_file()
