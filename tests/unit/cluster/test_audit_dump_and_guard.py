"""The driver's side of the learner's results, without Ray: the ratio audit's saved step
(``cluster.driver.audit_dump``, from the few things it needs: config, run folder, learner group, model folder, rows,
weight version) read back by the audit's own loader, and the health guard's policy on a refused
``RolloutTrainResult`` (``cluster.driver.guard``). The learner group is a stand-in that answers the collective
calls as rank 0 would; the real run is tests/matrix/test_audit.py and tests/integration/test_health_guard.py."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.config import load_config
from cluster.driver import audit_dump
from cluster.driver.batching import split_for_ranks
from cluster.driver.guard import GuardPolicy, HealthStop
from learner import audit
from learner.contracts import BY_LENGTH_KEY, RolloutTrainResult, TrainBatch
from rollout.contracts import Completion
from tests.helpers.partial import TINY, row


class StandInLearners:
    """Answers ``LearnerGroup.call`` as rank 0 does, and records the calls in order."""

    def __init__(self, n: int, width: int):
        self.calls: list[tuple] = []
        self.answers = {
            "compute_log_probs": torch.full((n, width - 1), -0.5),
            "checkpoint_state_dict": {"lm_head.weight": torch.arange(6.0).reshape(2, 3)},
            "captured_gradients": [{"lm_head.weight": torch.ones(2, 3)}],
        }

    def __len__(self) -> int:
        return 2

    def call(self, method: str, *args):
        self.calls.append((method, *args))
        return [self.answers.get(method)] * 2


def _batch(n: int = 8, width: int = 6) -> TrainBatch:
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(n, width - 1, dtype=torch.bool)
    mask[:, 2:] = True
    return TrainBatch(input_ids=torch.randint(3, 20, (n, width), generator=g),
                      attention_mask=torch.ones(n, width, dtype=torch.long), response_mask=mask,
                      old_log_probs=torch.where(mask, -1.0, 0.0), advantages=torch.randn(n, generator=g),
                      rewards=torch.ones(n), prompt_uids=[f"u{i // 2}" for i in range(n)],
                      weight_versions=torch.full((n,), 4, dtype=torch.long))


def test_save_inputs_and_outputs_write_a_step_the_audit_loads(tmp_path):
    cfg = load_config(TINY, ["learner.world_size=2", "learner.num_minibatches=2", "learner.micro_batch_size=2",
                             "trainer.group_size=2", "trainer.seed=7"])
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"not copied")
    batch = _batch()
    plans = split_for_ranks(batch, 2, 2, seed=7)
    learners = StandInLearners(len(batch), batch.input_ids.shape[1])
    rows = [row("u0", (5, 6)), row("u1", (5, 6, 7)), row("u2", (9,))]  # u3: not a training row

    out = audit_dump.save_inputs(cfg, tmp_path / "run", learners, 3, batch, plans, model_path=model,
                                 train_rows=rows, weight_version=4)
    assert out == audit.step_dir_for(tmp_path / "run", 3)
    assert [c[0] for c in learners.calls] == ["compute_log_probs", "checkpoint_state_dict", "capture_gradients"]
    assert learners.calls[-1] == ("capture_gradients", True)
    result = RolloutTrainResult.from_metrics({"loss/policy": 0.25, "actor/num_optimizer_steps": 2.0,
                                              "actor/grad_norm": 1.5, BY_LENGTH_KEY: {4: [1.0, 1.0, 0.0, 1.0]}})
    audit_dump.save_outputs(learners, out, result.record())
    assert learners.calls[-2:] == [("captured_gradients",), ("capture_gradients", False)]

    step = audit.load_step(out)
    assert step.tensors["prompt_lengths"].tolist() == [2, 2, 3, 3, 1, 1, -1, -1]
    assert torch.equal(step.tensors["learner_log_probs"], learners.answers["compute_log_probs"])
    assert step.meta["weight_version"] == 4 and step.meta["model_path"] == str(model)
    assert step.meta["group_size"] == 2 and step.meta["step"] == 3
    assert step.meta["prompt_token_ids"] == {"u0": [5, 6], "u1": [5, 6, 7], "u2": [9]}
    assert step.meta["objective"]["world_size"] == 2
    assert json.loads((out / audit.SPLIT_FILE).read_text())["seed"] == 7 + 3 - 1
    assert [mb["ranks"] for mb in step.split] == [[p.row_indices[m] for p in plans] for m in range(2)]
    assert sorted(f.name for f in (out / audit.MODEL_SUBDIR).iterdir()) == ["config.json", "model.safetensors"]
    assert (out / audit.MODEL_SUBDIR / "model.safetensors").read_bytes() != b"not copied"  # the learner's weights
    assert step.metrics == {"loss/policy": 0.25, "actor/num_optimizer_steps": 2.0, "actor/grad_norm": 1.5,
                            BY_LENGTH_KEY: {"4": [1.0, 1.0, 0.0, 1.0]}}
    assert torch.equal(step.gradient["lm_head.weight"], torch.ones(2, 3))


def _completion(uid: str, prompt: list[int], response: list[int], mask: list[int] | None) -> Completion:
    lps = [-0.5 if m else 0.0 for m in (mask or [1] * len(response))]
    return Completion(uid, 0, prompt, response, lps, "", "stop", 4, response_mask=mask)


def test_save_inputs_keeps_episode_masks_and_prompts(tmp_path):
    """Multi-turn episodes: the engines' sampled-token masks per row (-1 past a response and on single answers)
    and an episode's own prompt (its length; its ids where they are not the dataset row's)."""
    cfg = load_config(TINY, ["learner.world_size=2", "learner.num_minibatches=2", "learner.micro_batch_size=2",
                             "trainer.group_size=2"])
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    batch = _batch()
    plans = split_for_ranks(batch, 2, 2, seed=7)
    rows = [row("u0", (5, 6)), row("u1", (5, 6, 7)), row("u2", (9,))]
    completions = [_completion(uid, [5, 6] if i != 1 else [1, 2, 3, 4], [7, 8, 9][: 1 + i % 3], None)
                   for i, uid in enumerate(batch.prompt_uids)]
    completions[0] = _completion("u0", [5, 6], [7, 8, 9], [1, 0, 1])  # the dataset row's prompt
    completions[1] = _completion("u0", [1, 2, 3, 4], [7, 8], [1, 1])  # a prompt the environment rendered
    completions[6] = _completion("u3", [4], [7], [1])  # not a training row: its own prompt
    kw = dict(model_path=model, train_rows=rows, weight_version=4)

    out = audit_dump.save_inputs(cfg, tmp_path / "run", StandInLearners(8, 6), 1, batch, plans,
                                 completions=completions, **kw)
    step = audit.load_step(out)
    assert step.tensors[audit.EPISODE_MASK_KEY].tolist() == [[1, 0, 1], [1, 1, -1]] + [[-1] * 3] * 4 + [
        [1, -1, -1], [-1] * 3]
    assert step.tensors["prompt_lengths"].tolist() == [2, 4, 3, 3, 1, 1, 1, -1]
    assert step.meta["episode_prompt_token_ids"] == {"1": [1, 2, 3, 4], "6": [4]}
    assert step.meta["prompt_token_ids"] == {"u0": [5, 6], "u1": [5, 6, 7], "u2": [9]}

    # single answers: the step's files as before (no episode tensor, no episode prompts)
    singles = [_completion(c.prompt_uid, [5, 6], [7], None) for c in completions]
    out = audit_dump.save_inputs(cfg, tmp_path / "run", StandInLearners(8, 6), 2, batch, plans,
                                 completions=singles, **kw)
    step = audit.load_step(out)
    assert audit.EPISODE_MASK_KEY not in step.tensors and "episode_prompt_token_ids" not in step.meta
    assert step.tensors["prompt_lengths"].tolist() == [2, 2, 3, 3, 1, 1, -1, -1]
    with pytest.raises(ValueError, match="not the batch's 8 rows"):
        audit_dump.save_inputs(cfg, tmp_path / "run", StandInLearners(8, 6), 3, batch, plans,
                               completions=singles[::-1], **kw)


def test_save_outputs_without_learners_writes_the_metrics_alone(tmp_path):
    audit_dump.save_outputs(None, tmp_path / "step", {"loss/policy": float("nan"), "actor/grad_norm": float("inf")})
    assert json.loads((tmp_path / "step" / audit.METRICS_FILE).read_text()) == {"loss/policy": None,
                                                                               "actor/grad_norm": 1e308}
    assert not (tmp_path / "step" / audit.GRADIENT_FILE).exists()


def _refused(*checks: str) -> RolloutTrainResult:
    return RolloutTrainResult.from_metrics({
        "loss/policy": 0.0, "actor/num_optimizer_steps": 0.0, "actor/grad_norm": 0.0, "health/skipped": 1.0,
        "health/failed_checks": ",".join(checks), "health/reasons": "; ".join(f"{c}: x > 1" for c in checks)})


def test_guard_counts_refused_results_and_stops_without_a_checkpoint(tmp_path):
    cfg = load_config(TINY, ["health.enabled=true", "health.rollback_after=2"])
    guard = GuardPolicy(cfg, tmp_path)
    m: dict = {"loss/policy": 0.0}
    assert guard.refused(4, _refused("nonfinite_log_probs", "max_grad_norm"), m) is None
    assert m == {"loss/policy": 0.0, "health/consecutive_failures": 1.0}  # the step's metrics, key appended
    with pytest.raises(HealthStop, match="max_grad_norm, min_entropy"):
        guard.refused(5, _refused("min_entropy", "max_grad_norm"), {})
    report = json.loads((tmp_path / "health_report.json").read_text())
    assert report["failed_checks"] == ["max_grad_norm", "min_entropy", "nonfinite_log_probs"]
    assert report["recent_failures"][0] == {"step": 4, "checks": "nonfinite_log_probs,max_grad_norm",
                                            "reasons": "nonfinite_log_probs: x > 1; max_grad_norm: x > 1"}
    guard.good_step()
    assert guard.failures == 0
