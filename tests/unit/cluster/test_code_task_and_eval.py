"""The procedural code task, pass@k / mean@k, and metrics sliced by response length (hand-computed values)."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.config import ConfigError, load_config
from cluster.data.code_task import FAMILIES, all_specs, code_rows, solution_code, unit_tests
from cluster.data.prompts import DataError
from cluster.driver.evaluation import pass_at_k, reported_ks, sampled_metrics
from cluster.driver.length_slices import bucket_index, bucket_ranges, learner_slices, plot_length_slices, rollout_slices
from cluster.models.tiny_model import CHARACTERS
from learner.objectives import policy_loss, resolve_objective
from tests.helpers import REPO_ROOT, assert_png
from tests.helpers.sandbox import sandbox_backend


def _tok(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def test_pass_at_k_hand_computed():
    # n=5 samples, c=2 correct: 1 - C(3,k)/C(5,k)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert pass_at_k(5, 2, 4) == 1.0  # fewer wrong samples (3) than k: some draw holds a correct one
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    for bad in [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(*bad)


def test_reported_ks():
    assert reported_ks(1) == [1]
    assert reported_ks(4) == [1, 2, 4]
    assert reported_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="trainer.eval_samples"):
        reported_ks(0)


def test_sampled_metrics_hand_computed():
    T, F = True, False
    out = sampled_metrics([[T, F, F, F], [T, T, F, F], [F, F, F, F]])  # c = 1, 2, 0 of n = 4
    assert set(out) == {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/mean@4"}
    assert out["eval/pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    # pass@2: 1 - C(3,2)/C(4,2) = 1/2; 1 - C(2,2)/C(4,2) = 5/6; 0
    assert out["eval/pass@2"] == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)
    assert out["eval/pass@4"] == pytest.approx(2 / 3)
    assert out["eval/mean@4"] == pytest.approx(out["eval/pass@1"])
    with pytest.raises(ValueError, match="same number of samples"):
        sampled_metrics([[T, F], [T]])
    with pytest.raises(ValueError, match="no held-out prompt"):
        sampled_metrics([])


def test_bucket_ranges_and_index():
    assert bucket_ranges(80, 4) == [(0, 20), (21, 40), (41, 60), (61, 80)]
    assert bucket_ranges(10, 3) == [(0, 4), (5, 7), (8, 10)]  # hi = ceil(10 * i / 3)
    assert bucket_ranges(4, 4) == [(0, 1), (2, 2), (3, 3), (4, 4)]
    assert bucket_ranges(5, 1) == [(0, 5)]
    for n in (0, 11):
        with pytest.raises(ValueError, match="trainer.length_buckets"):
            bucket_ranges(10, n)
    r = bucket_ranges(80, 4)
    assert [bucket_index(n, r) for n in (0, 1, 20, 21, 40, 41, 80, 200)] == [0, 0, 0, 1, 1, 2, 3, 3]
    with pytest.raises(ValueError, match="negative"):
        bucket_index(-1, r)


def test_rollout_slices_hand_computed():
    r = [(0, 4), (5, 7), (8, 10)]
    out = rollout_slices([2, 3, 6, 9, 10], [1.0, 0.5, float("nan"), 0.0, 0.25], [True, False, False, False, False], r)
    assert out == pytest.approx({
        "length/0-4/count": 2.0, "length/0-4/accuracy": 0.5, "length/0-4/reward_mean": 0.75,
        "length/5-7/count": 1.0, "length/5-7/accuracy": 0.0,  # its one reward is NaN: no reward_mean
        "length/8-10/count": 2.0, "length/8-10/accuracy": 0.0, "length/8-10/reward_mean": 0.125,
    })
    with pytest.raises(ValueError, match="2 lengths"):
        rollout_slices([1, 2], [1.0], [True], r)


def test_learner_slices_hand_computed():
    r = [(0, 4), (5, 7), (8, 10)]
    by_len = {3: [2.0, 2.1, 1.0, 2.0], 4: [1.0, 0.9, 0.0, 1.0], 9: [1.0, 1.2, 1.0, 1.0]}
    out = learner_slices(by_len, r)
    assert out == pytest.approx({
        "length/0-4/seq_ratio_mean": 3.0 / 3, "length/0-4/clip_fraction": 1 / 3,
        "length/8-10/seq_ratio_mean": 1.2, "length/8-10/clip_fraction": 1.0,
    })


@pytest.mark.parametrize("algorithm", ["gspo", "grpo"])
def test_policy_loss_per_sequence_counts(algorithm):
    """Row 0 (2 tokens, log-ratio +0.01 each, A > 0) is clipped high for GSPO (s = e^0.01 > 1 + 4e-4); row 1
    (1 token, log-ratio 0) is not; row 2 has no response token. For GRPO (clip 0.2) one token of row 0 with
    log-ratio 0.5 is clipped."""
    old = torch.zeros(3, 3)
    lp = torch.tensor([[0.01, 0.01 if algorithm == "gspo" else 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    adv = torch.tensor([1.0, -1.0, 0.5])
    result = policy_loss(lp, old, adv, mask, resolve_objective(algorithm))
    _, m, per = result.loss, result.metrics, result.per_sequence
    assert per.length.tolist() == [2, 1, 0]
    if algorithm == "gspo":
        assert per.units.tolist() == [1.0, 1.0, 0.0] and per.clipped.tolist() == [1.0, 0.0, 0.0]
    else:
        assert per.units.tolist() == [2.0, 1.0, 0.0] and per.clipped.tolist() == [1.0, 0.0, 0.0]
    assert float(per.units.sum()) == m["num_ratios"] and float(per.clipped.sum()) == m["num_clipped"]


def test_plot_length_slices(tmp_path):
    hist = [{"step": s, "length/0-4/reward_mean": 0.1 * s, "length/0-4/clip_fraction": 0.2,
             "length/5-9/accuracy": 0.5, "length/5-9/count": 3.0} for s in range(1, 4)]
    out = plot_length_slices(hist, tmp_path / "length_slices.png")
    assert out is not None
    assert_png(out, 1000, 700)
    assert plot_length_slices([{"step": 1, "reward/mean": 0.0}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_code_rows_split_is_disjoint_seeded_and_tokenizable():
    train, ev = code_rows(_tok, num_train=10_000, num_eval=64, seed=7, demo_slip_rate=0.5)
    assert len(ev) == 64 and len(train) == len(all_specs()) - 64
    assert not {r.uid.split("/", 1)[1] for r in train} & {r.uid.split("/", 1)[1] for r in ev}
    assert {r.meta["family"] for r in ev} == set(FAMILIES)
    again, _ = code_rows(_tok, num_train=10_000, num_eval=64, seed=7, demo_slip_rate=0.5)
    assert [(r.uid, r.meta["solution"]) for r in again] == [(r.uid, r.meta["solution"]) for r in train]
    other, _ = code_rows(_tok, num_train=10_000, num_eval=64, seed=8, demo_slip_rate=0.5)
    assert [r.uid for r in other] != [r.uid for r in train]
    slipped = sum(r.meta["solution"] != r.answer for r in train)
    assert 0.3 * len(train) < slipped < 0.5 * len(train)  # 50% drawn; some slips change nothing (b >= 0)
    assert all(r.meta["solution"] == r.answer for r in ev)
    assert all(r.verifier == "code" and len(r.meta["tests"]) == 4 for r in train + ev)
    text = "".join(r.prompt + r.meta["solution"] + "".join(r.meta["tests"]) for r in train + ev)
    assert set(text) <= set(CHARACTERS)  # the tiny model's character tokenizer reads and emits all of it
    clean, _ = code_rows(_tok, num_train=10_000, num_eval=64, seed=7, demo_slip_rate=0.0)
    assert all(r.meta["solution"] == r.answer for r in clean)
    with pytest.raises(DataError, match="data.num_eval=406"):
        code_rows(_tok, num_train=1, num_eval=406, seed=0)
    with pytest.raises(DataError, match="data.max_prompt_tokens=10"):
        code_rows(_tok, num_train=1, num_eval=1, seed=0, max_prompt_tokens=10)


@pytest.mark.timeout(120)
def test_reference_solutions_pass_and_slips_fail_in_the_sandbox():
    """Through the real code verifier (solution in the sandbox): every family's reference passes its four
    tests, and its slip fails at least one."""
    from reward.config import SandboxConfig
    from reward.verifiers import code_verifier

    picks = {"linear": (3, -2), "mod": (5, 3), "threshold": (4, 7), "sum": (2, 1)}
    sbx = SandboxConfig(backend=sandbox_backend(), wall_s=5.0)
    for spec in [s for s in all_specs() if picks[s.family] == s.p]:
        row = {"uid": spec.uid, "meta": {"tests": unit_tests(spec)}}
        good = code_verifier(solution_code(spec), row, sandbox=sbx)
        bad = code_verifier(solution_code(spec, slip=True), row, sandbox=sbx)
        assert good["correct"] and good["score"] == 1.0, (spec, good)
        assert not bad["correct"] and bad["score"] < 1.0, (spec, bad)


def test_code_config_loads_and_new_keys_are_checked():
    cfg = load_config(REPO_ROOT / "configs" / "tiny_code.yaml")
    assert cfg.data.task == "code" and cfg.trainer.eval_samples > 0 and cfg.trainer.length_buckets > 0
    with pytest.raises(ConfigError, match="trainer.length_buckets=81 exceeds rollout.max_response_tokens=80"):
        load_config(REPO_ROOT / "configs" / "tiny_code.yaml", ["trainer.length_buckets=81"])
    with pytest.raises(ConfigError, match="trainer.eval_samples"):
        load_config(REPO_ROOT / "configs" / "tiny_code.yaml", ["trainer.eval_samples=-1"])
    assert math.isclose(load_config(None).trainer.eval_samples, 0)  # off by default: make train is unchanged
