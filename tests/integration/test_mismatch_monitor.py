"""The mismatch monitor (issue 28, item 5): with ``learner.pre_update_pass='auto'`` and nothing that needs the
pass, ``learner.mismatch_monitor_every=N`` still runs it on rollout batches 1, N+1, ..., so
``actor/train_rollout_logprob_diff`` is measured, on a dense model too, and a broken weight sync shows up in it.

Real DeepSpeed (CPU accelerator, gloo), one rank in this process, the tiny dense Llama of
``cluster.models.tiny_archs``.
"""

from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from learner.contracts import TrainBatch
from learner.objectives import loss_normalisers
from tests.helpers.learner import TEMPERATURE, _ref_log_probs, _ref_model, make_batch

KEY = "actor/train_rollout_logprob_diff"


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory) -> str:
    from cluster.models.tiny_archs import build_tiny_arch

    return str(build_tiny_arch(tmp_path_factory.mktemp("dense") / "llama", "llama", seed=0))


def _rank(model_path: str, cfg: LearnerConfig):
    from learner.service import LearnerRank

    return LearnerRank(model_path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0,
                       seed=0, temperature=TEMPERATURE)


def _train(learner, batch: TrainBatch, monitor: bool | None = None) -> dict:
    """One rollout batch; its logged metrics (``RolloutTrainResult.metrics``)."""
    s, t = loss_normalisers(batch.response_mask)
    return learner.train_rollout_batch([batch], [s], [t], guard={"max_grad_norm": 1000.0}, monitor=monitor).metrics


def _broken_sync_log_probs(model_path: str, batch: TrainBatch) -> torch.Tensor:
    """Behaviour log-probs of an engine whose weight sync garbled one tensor: the learner's weights with the first
    layer's MLP up-projection rows permuted (the right bytes in the wrong places)."""
    model = _ref_model(model_path)
    w = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        w.copy_(w[torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(0))])
        lp = _ref_log_probs(model, batch)
    return torch.where(batch.response_mask, lp, 0.0).float()


def test_monitor_measures_every_nth_batch_and_sees_a_broken_sync(dense_path):
    """Dense model, auto, no guard pre-check, N=2: batches 1 and 3 carry the metric, 2 and 4 do not; with the
    engine's log-probs from the learner's weights it is the rollout noise (~1e-3 nats), with a garbled tensor
    in the engine it is far larger. The monitored updates equal the unmonitored ones bit for bit."""
    cfg = LearnerConfig(zero_stage=0, micro_batch_size=4, lr=1e-9, num_minibatches=1, mismatch_monitor_every=2)
    learner = _rank(dense_path, cfg)
    assert learner.replica.tap is None  # dense: no MoE diagnostics would run the pass
    assert cfg.pre_update_pass_needs({"max_grad_norm": 1000.0}, is_moe=False) == []
    clean = [make_batch(dense_path, 6, seed=s, noise=1e-3) for s in (1, 2)]
    broken = make_batch(dense_path, 6, seed=3, noise=0.0)
    broken.old_log_probs = _broken_sync_log_probs(dense_path, broken)
    outs = [_train(learner, b) for b in (clean[0], clean[1], broken)]
    digest = learner.state_digest()
    outs.append(_train(learner, clean[0]))
    assert [KEY in o for o in outs] == [True, False, True, False]
    assert "actor/entropy" in outs[0] and "mismatch/log_ratio_mean" in outs[0]
    assert 1e-4 < outs[0][KEY] < 2e-3  # |N(0, 1e-3)| has mean 8e-4
    assert outs[2][KEY] > 10 * outs[0][KEY], outs[2][KEY]  # measured: 0.019 against 9e-4

    off = _rank(dense_path, cfg.model_copy(update={"mismatch_monitor_every": 0}))
    offs = [_train(off, b) for b in (clean[0], clean[1], broken)]
    assert not any(KEY in o for o in offs)
    assert off.state_digest() == digest  # the monitor's pass changes no update
    assert [o["loss/policy"] for o in offs] == [o["loss/policy"] for o in outs[:3]]


def test_the_callers_decision_overrides_the_ranks_count(dense_path):
    """The driver passes ``monitor`` (by global step): True runs the pass on a batch the rank's own count would
    skip, False skips it on one the count would take; with mismatch_monitor_every=0 True runs nothing."""
    cfg = LearnerConfig(zero_stage=0, micro_batch_size=4, lr=1e-9, num_minibatches=1, mismatch_monitor_every=2)
    learner = _rank(dense_path, cfg)
    b = make_batch(dense_path, 6, seed=1, noise=1e-3)
    outs = [_train(learner, b, monitor=m) for m in (False, True, None, None)]  # the count: due on batches 1, 3
    assert [KEY in o for o in outs] == [False, True, True, False]
    off = _rank(dense_path, cfg.model_copy(update={"mismatch_monitor_every": 0}))
    assert KEY not in _train(off, b, monitor=True)


def _train_sources(learner, batch: TrainBatch, behaviour: str) -> dict:
    """``batch`` as two minibatches of 4 rows, with the step's behaviour source given as the driver gives it."""
    parts = [batch.select(list(range(0, 4))), batch.select(list(range(4, 8)))]
    norms = [loss_normalisers(p.response_mask) for p in parts]
    return learner.train_rollout_batch(parts, [s for s, _ in norms], [t for _, t in norms], guard=None,
                                       behaviour=behaviour).metrics


def test_a_check_step_keeps_the_engines_log_probs_within_the_bound_and_trains_on_the_recomputed_above(dense_path):
    """``old_logprob_source=auto``'s check step (``behaviour='check'``), two minibatches, the engine's log-probs
    being the rank's own plus noise: 1e-5 (gap ~8e-6 < 1e-4) trains as ``rollout`` would, bit for bit; 1e-2
    (~8e-3) as ``recompute`` would (its pass unfused, as the check's is), recomputed=1; older rows far off beside
    newest rows close are left out of the gap (partial rollouts' carried samples). Every update identical to the
    reference rank's."""
    cfg = LearnerConfig(zero_stage=0, micro_batch_size=4, lr=1e-3, num_minibatches=2, mismatch_monitor_every=1)
    checked = _rank(dense_path, cfg)
    ref = _rank(dense_path, cfg.model_copy(update={"fuse_first_minibatch": False}))
    g = torch.Generator().manual_seed(0)
    for seed, noise, source in ((4, 1e-5, "rollout"), (5, 1e-2, "recompute"), (6, 1e-5, "rollout")):
        batch = make_batch(dense_path, 8, seed=seed, noise=0.0)  # the engine: this rank's weights now, plus noise
        batch.old_log_probs = torch.where(batch.response_mask, checked.compute_log_probs(batch)
                                          + noise * torch.randn(batch.response_mask.shape, generator=g), 0.0)
        now = checked.current_version()  # 0 before the first update, then 1 (updated, never synced)
        batch.weight_versions = torch.full((8,), now)
        if seed == 6:  # rows 0-3 sampled a version earlier, 0.05 nats off: left out of the gap
            batch.weight_versions[:4] = now - 1
            batch.old_log_probs[:4] = torch.where(batch.response_mask[:4], batch.old_log_probs[:4] + 0.05, 0.0)
        out = _train_sources(checked, batch, "check")
        want = _train_sources(ref, batch, source)
        assert out["actor/old_logprob_recomputed"] == float(source == "recompute"), (source, out["actor/old_logprob_gap"])
        assert want["actor/old_logprob_recomputed"] == float(source == "recompute")
        assert (out["actor/old_logprob_gap"] > 1e-4) == (source == "recompute"), out["actor/old_logprob_gap"]
        assert out["loss/policy"] == want["loss/policy"]
        assert checked.state_digest() == ref.state_digest(), source
    newest = float(batch.response_mask[4:].sum())
    assert out["actor/old_logprob_gap_tokens"] == newest > 0
    assert out[KEY] > 0.01 > 1e-4 > out["actor/old_logprob_gap"]  # the whole batch's gap, the newest rows' gap
    assert "actor/old_logprob_gap" not in want
