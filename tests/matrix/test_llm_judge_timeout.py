"""An LLM judge engine that does not answer within ``reward.judge.timeout_s`` gives its share NaN judgements
(status ``timeout``), is replaced, and the new engine answers. Not in ``make test`` (two engine starts, about a
minute on 2 cores): ``make test-matrix``.
"""

from __future__ import annotations

import math

import pytest

from cluster.runtime.judge import JudgeFleet
from tests.helpers.judge import judge_requests, tiny_judge_config


@pytest.fixture(scope="module")
def fleet(ray_cluster, tiny_moe, tmp_path_factory):
    f = JudgeFleet(tiny_judge_config(tiny_moe), str(tiny_moe), tmp_path_factory.mktemp("judge_cache"))
    yield f
    f.shutdown()


def test_a_timed_out_judge_gives_nan_and_is_replaced(fleet):
    jc = fleet.settings
    fleet.settings = jc.model_copy(update={"timeout_s": 1e-3})
    try:
        out = fleet.judge(judge_requests())
    finally:
        fleet.settings = jc
    assert all(math.isnan(j.score) and j.status == "timeout" for j in out)
    assert fleet.replaced == 1
    assert all(j.status in ("ok", "unparsed") for j in fleet.judge(judge_requests()))  # the new engine answers
