"""What the reward tests rely on in ``tests.helpers.userfns`` (the user verifiers they name): every function
there resolves through ``reward.verifiers.get_verifier("module:function")`` to itself, travels to a child
process by reference, has the verifier signature ``(response, row)``, and importing the module pulls in no
heavy package."""

from __future__ import annotations

from tests.helpers.userfns import MODULE, _user_verifiers, half_with_extra, raises, returns_junk


HEAVY = ("torch", "ray", "vllm", "deepspeed", "transformers", "pytest")


def test_every_user_verifier_resolves_by_name_to_itself_and_pickles_by_reference():
    import inspect
    import pickle

    from reward.config import RewardConfig
    from reward.verifiers import get_verifier

    fns = _user_verifiers()
    assert {"raises", "dies", "slow_exact", "exact_with_pid", "hang_in_c", "forks_and_returns"} <= set(fns)
    for name, fn in fns.items():
        assert get_verifier(f"{MODULE}:{name}") is fn, name
        assert get_verifier(f"{MODULE}:{name}", RewardConfig()) is fn, name  # options bind built-ins only
        assert pickle.loads(pickle.dumps(fn)) is fn, name  # the runner ships it to the fork server by name
        assert list(inspect.signature(fn).parameters) == ["response", "row"], name


def test_in_process_results_of_the_simple_user_verifiers():
    """What the runner and worker tests expect these to return or raise when called directly."""
    import math

    import pytest

    assert half_with_extra("anything", {}) == {"score": 0.5, "correct": True, "why": "partial"}
    assert math.isnan(returns_junk("nan", {})) and returns_junk("none", {}) is None
    with pytest.raises(KeyError, match="no such field"):
        raises("", {})


def test_importing_the_module_pulls_in_no_heavy_package():
    """The fork server preloads this module (``preload=[...]``); resolving all its verifiers by name must not
    import torch, Ray, vLLM, DeepSpeed, transformers or pytest (each would add seconds to a worker's start)."""
    import os
    import subprocess
    import sys

    from tests.helpers import REPO_ROOT

    code = (
        "import sys\n"
        "from reward.verifiers import get_verifier\n"
        f"import {MODULE} as m\n"
        "for name in m._user_verifiers():\n"
        f"    get_verifier('{MODULE}:' + name)\n"
        f"print(len(m._user_verifiers()), sorted(h for h in {HEAVY!r} if h in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    count, heavy = out.stdout.split(" ", 1)
    assert int(count) == len(_user_verifiers()) and heavy.strip() == "[]", out.stdout
