"""The time budget of one test in ``make test``: a test of the default set (not marked ``matrix``) whose set-up
and call together take longer than the budget fails, unless ``tests/slow_tests.toml`` lists it with its reason.
So the suite stays within its time as it grows: a slow new test is made faster, moved to ``tests/matrix/``
behind a fast representative, or listed with why it must stay in ``make test``.

The budget is ``DEFAULT_BUDGET_S`` seconds (what a test may take on the slowest developer machine, 2 cores);
``GSPO_TEST_BUDGET_S`` sets another (``0`` switches the check off, e.g. on a machine much slower than ours).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from tests.helpers import REPO_ROOT

BUDGET_ENV = "GSPO_TEST_BUDGET_S"
DEFAULT_BUDGET_S = 90.0
SLOW_TESTS = REPO_ROOT / "tests" / "slow_tests.toml"


def budget_s() -> float:
    """Seconds one test may take (``GSPO_TEST_BUDGET_S``, default ``DEFAULT_BUDGET_S``); 0 = no budget.

    Raises:
        ValueError: ``GSPO_TEST_BUDGET_S`` is not a number >= 0.
    """
    text = os.environ.get(BUDGET_ENV, "")
    if not text:
        return DEFAULT_BUDGET_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{BUDGET_ENV}={text!r}: seconds >= 0 (0 switches the test budget off)")
    return value


def slow_tests(path: Path = SLOW_TESTS) -> dict[str, str]:
    """The tests allowed over the budget: ``{node id: reason}`` from ``path`` (a ``[tests]`` table of
    ``"tests/...py::test_name[param]" = "why it stays in make test"``).

    Raises:
        ValueError: the file has no ``[tests]`` table, or an entry whose reason is not a non-empty string.
    """
    data = tomllib.loads(path.read_text())
    table = data.get("tests")
    if not isinstance(table, dict):
        raise ValueError(f"{path}: needs a [tests] table of node id = reason")
    for node_id, reason in table.items():
        if not (isinstance(reason, str) and reason.strip()):
            raise ValueError(f"{path}: {node_id!r} needs its reason (a non-empty string), got {reason!r}")
    return dict(table)


def over_budget(node_id: str, seconds: float, budget: float, allowed: dict[str, str]) -> str | None:
    """Why test ``node_id`` fails the budget after ``seconds`` of set-up and call, or None when it does not."""
    if budget <= 0 or seconds <= budget or node_id in allowed:
        return None
    return (f"{node_id} took {seconds:.0f} s (set-up and call), over the budget of {budget:g} s a test of "
            f"`make test` has: make it faster, move it to tests/matrix/ behind a fast representative, or list it "
            f"in {SLOW_TESTS.relative_to(REPO_ROOT)} with the reason it stays ({BUDGET_ENV} sets the budget)")
