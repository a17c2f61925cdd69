"""User verifiers in the user's own folder, the command-line entry points and the quiet terminal.

The fast tests check the pieces: which ``module:function`` verifiers a run names and where, the driver's
import check and what is shipped to the workers (``cluster.runtime.user_code``), the job's runtime env, relative CLI
paths, the ``[project.scripts]`` entries, and the terminal filter and worker-output redirection
(``cluster.runtime.console``). The slow test runs ``python -m cluster.train`` with ``reward.verifier=myrew:score`` and
``myrew.py`` on the user's PYTHONPATH (not in the working directory) and checks that the rewards are that
function's.
"""

from __future__ import annotations

from tests.helpers import REPO_ROOT

TINY = str(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml")
