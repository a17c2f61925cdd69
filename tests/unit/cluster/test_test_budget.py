"""The per-test time budget of ``make test`` (tests/helpers/budget.py, applied by tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.helpers import budget


def test_over_budget_only_past_the_budget_and_unlisted():
    allowed = {"tests/integration/test_e2e.py::test_slow": "the one end-to-end run"}
    assert budget.over_budget("tests/a.py::t", 90.0, 90.0, {}) is None  # at the budget: fine
    why = budget.over_budget("tests/a.py::t", 90.5, 90.0, {})
    assert why is not None and "tests/a.py::t took 90 s" in why and "budget of 90 s" in why
    assert "tests/slow_tests.toml" in why
    assert budget.over_budget("tests/integration/test_e2e.py::test_slow", 500.0, 90.0, allowed) is None
    assert budget.over_budget("tests/a.py::t", 500.0, 0.0, {}) is None  # 0 switches it off


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv(budget.BUDGET_ENV, raising=False)
    assert budget.budget_s() == budget.DEFAULT_BUDGET_S == 90.0
    monkeypatch.setenv(budget.BUDGET_ENV, "150")
    assert budget.budget_s() == 150.0
    for bad in ("-1", "fast", "nan"):
        monkeypatch.setenv(budget.BUDGET_ENV, bad)
        with pytest.raises(ValueError, match=budget.BUDGET_ENV):
            budget.budget_s()


def test_slow_list_needs_a_reason_per_test(tmp_path):
    path = tmp_path / "slow.toml"
    path.write_text('[tests]\n"tests/a.py::t" = "why"\n')
    assert budget.slow_tests(path) == {"tests/a.py::t": "why"}
    path.write_text('[tests]\n"tests/a.py::t" = ""\n')
    with pytest.raises(ValueError, match="needs its reason"):
        budget.slow_tests(path)
    path.write_text('"tests/a.py::t" = "why"\n')
    with pytest.raises(ValueError, match=r"\[tests\] table"):
        budget.slow_tests(path)


def test_the_shipped_list_names_tests_that_exist():
    """Every listed node id names a test function in its file (a renamed or moved test is not listed forever)."""
    for node_id in budget.slow_tests():
        path, _, name = node_id.partition("::")
        func = name.split("[", 1)[0]
        source = (budget.REPO_ROOT / path).read_text()
        assert f"def {func}(" in source, f"tests/slow_tests.toml lists {node_id}, not in {path}"
