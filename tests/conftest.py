"""What the tests share: the environment of every test process, the markers each folder sets, the embedded tiny
model and a private local Ray cluster.

The folders say what a test starts, and set its markers (so ``-m`` and the make targets select by folder):

- ``unit/<room>/`` (``learner``, ``rollout``, ``reward``, ``cluster``): no DeepSpeed, Ray or vLLM; seconds.
  ``make test-fast`` runs these. ``unit/conftest.py`` fails a unit test that leaves Ray or a process group up.
- ``integration/``: real Ray, vLLM and DeepSpeed on the CPU; marked ``slow``. A parameter marked ``matrix``
  is a wide case of an integration test (``make test-matrix``).
- ``matrix/``: the wide matrices kept out of ``make test``; marked ``slow`` and ``matrix``.

Helpers several test modules use live in ``tests/helpers/`` (a test module never imports another one); paths
into the checkout are built from ``tests.helpers.REPO_ROOT``, never relative to the working directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, TEST_ENV  # noqa: E402 - read before any heavy import
from tests.helpers import budget

for _key, _value in TEST_ENV.items():
    os.environ.setdefault(_key, _value)

TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = {"integration": ("slow",), "matrix": ("slow", "matrix")}


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by -m
def pytest_collection_modifyitems(config, items):
    """Mark each test by its folder (``FOLDER_MARKERS``); a test outside the three folders is refused."""
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if not path.is_relative_to(TESTS):
            continue
        kind = path.relative_to(TESTS).parts[0]
        if kind not in ("unit", "integration", "matrix"):
            raise pytest.UsageError(f"{path}: tests live in tests/unit/<room>/, tests/integration/ or tests/matrix/")
        for name in FOLDER_MARKERS.get(kind, ()):
            item.add_marker(getattr(pytest.mark, name))


SETUP_S = pytest.StashKey[float]()  # a test's set-up seconds, until its call is reported
BUDGET = pytest.StashKey[tuple[float, dict[str, str]]]()  # (budget in seconds, {node id: reason} over it)


def pytest_configure(config):
    """Read the test budget and the tests allowed over it once (``tests.helpers.budget``); a bad list or
    ``GSPO_TEST_BUDGET_S`` stops the session before any test runs."""
    config.stash[BUDGET] = (budget.budget_s(), budget.slow_tests())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fail a passing test of the default set (not ``matrix``) whose set-up and call took longer than the budget
    and that ``tests/slow_tests.toml`` does not list (``tests.helpers.budget``)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup":
        item.stash[SETUP_S] = report.duration
    elif report.when == "call" and report.passed and item.get_closest_marker("matrix") is None:
        limit, allowed = item.config.stash[BUDGET]
        why = budget.over_budget(item.nodeid, item.stash.get(SETUP_S, 0.0) + report.duration, limit, allowed)
        if why is not None:
            report.outcome, report.longrepr = "failed", why


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    """The embedded tiny Qwen3-MoE (default shape, ``build_seed`` 0), built once per session. Tests only read
    it: one that needs to change a model builds its own."""
    from cluster.models.tiny_model import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny_moe") / "tiny_moe", seed=0)


@pytest.fixture(scope="session")
def model_path(tiny_moe: Path) -> str:
    """``tiny_moe`` as a string (what ``LearnerRank`` and the learner tests' ``make_batch`` take)."""
    return str(tiny_moe)


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local Ray for one test module: 2 CPUs, node address 127.0.0.1, no dashboard; its workers get
    this process's values of the ``TEST_ENV`` keys and the checkout on ``PYTHONPATH``. Yields the ``ray``
    module; shut down after the module."""
    import ray

    env = {**{key: os.environ[key] for key in TEST_ENV}, "PYTHONPATH": str(REPO_ROOT)}
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def ray_down_after_module():
    """Shut Ray down after every test module that left it initialised, whatever its tests did (a failed test
    skips its own clean-up): a module never inherits another module's Ray, whose leftover connection made a
    later ``ray.init`` fail with "Maybe you called ray.init twice"."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def local_cluster():
    """Starts ``ray.cluster_utils.Cluster``s for one test: ``local_cluster(head_node_args)`` returns a started
    cluster (head initialised). After the test, whatever happened in it, this process leaves Ray and every
    cluster it started is shut down (its raylets, object stores and GCS end)."""
    from ray.cluster_utils import Cluster

    started: list[Cluster] = []

    def start(head_node_args: dict) -> Cluster:
        cluster = Cluster(initialize_head=True, head_node_args=head_node_args)
        started.append(cluster)
        return cluster

    try:
        yield start
    finally:
        import ray

        ray.shutdown()
        for cluster in started:
            cluster.shutdown()
