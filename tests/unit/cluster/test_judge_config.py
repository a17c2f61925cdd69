"""``reward.judge`` in the run config: refused with multi-turn episodes, its relative model folder made absolute
like ``model.path``, and its engines' CPUs counted in what the run reserves."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, absolute_paths, load_config
from cluster.runtime.services import resource_demand


def test_judge_with_episodes_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"reward.judge.model_path='builtin:tiny_moe' is refused with env set"):
        load_config("configs/tiny_agent_calc.yaml", ["reward.judge.model_path=builtin:tiny_moe"])


def test_relative_judge_folder_becomes_absolute_and_builtins_stay(tmp_path):
    (tmp_path / "models" / "judge").mkdir(parents=True)  # exists: an owner/name path that does not is a hub id
    cfg = absolute_paths(load_config(None, ["reward.judge.model_path=models/judge"]), cwd=tmp_path)
    assert cfg.reward.judge.model_path == str(tmp_path.resolve() / "models" / "judge")
    cfg = absolute_paths(load_config(None, ["reward.judge.model_path=builtin:tiny_moe"]), cwd=tmp_path)
    assert cfg.reward.judge.model_path == "builtin:tiny_moe"


def test_judge_engines_count_in_the_reserved_cpus():
    base = load_config(None)
    judged = load_config(None, ["reward.judge.model_path=builtin:tiny_moe", "reward.judge.num_engines=2",
                                "reward.judge.num_cpus_per_engine=0.5"])
    assert resource_demand(judged) == pytest.approx(resource_demand(base) + 1.0)
