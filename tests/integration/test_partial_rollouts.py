"""Partial rollouts for real (Ray, vLLM, DeepSpeed on the CPU): a sample cut at a round's segment continues after
a weight sync under the new weights; it then carries two weight versions, and each token's behaviour log-prob is
the one of the engine weights that sampled it (checked against the engine's own prefill log-probs at each
version). The step trained on it logs a staleness of 1, and the checkpoint keeps the samples still in flight."""

from __future__ import annotations

import pytest

from tests.helpers.driver import _trainer

# 4-token responses in 2-token segments: the tiny model rarely stops early, so most samples need two rounds
PARTIAL = ["trainer.partial_rollouts=true", "trainer.max_staleness=1", "trainer.partial_segment_tokens=2",
           "trainer.total_steps=1", "rollout.max_response_tokens=4"]


@pytest.fixture(scope="module")
def ray_session():
    yield
    import ray

    ray.shutdown()


def _engine_logprobs(trainer, completion) -> list[float]:
    import ray

    ids = list(completion.prompt_token_ids) + list(completion.response_token_ids)
    engine = trainer.fleet.engines[0]
    return ray.get(engine.sequence_logprobs.remote(ids, len(completion.prompt_token_ids)))


def test_a_sample_spanning_a_sync_carries_both_versions_and_their_logprobs(tmp_path, ray_session):
    from cluster.driver.resume import PARTIAL_FILE, find_resume_point

    t = _trainer(tmp_path, "partial", PARTIAL)
    t.start()
    try:
        v0 = t.weight_version
        t.collector.collect(0)  # groups finished at v0 are trained later; the rest stay in flight
        in_flight = {(g.row.uid, s.sample_index): (list(s.token_ids), list(s.logprobs))
                     for g in t.collector.buffer.groups for s in g.samples if s.token_ids and not s.finished}
        assert in_flight, "no sample was cut at the segment"
        # each in-flight prefix's log-probs are the v0 engine's
        for g in t.collector.buffer.groups:
            for s in g.samples:
                if (g.row.uid, s.sample_index) in in_flight:
                    assert _engine_logprobs(t, _as_completion(g, s)) == pytest.approx(s.logprobs, abs=1e-4)
        t.warm_start()  # a supervised update and a weight sync: the engines now hold v0 + 1
        assert t.weight_version == v0 + 1
        c = t.collector.collect(1)
        spanning = [x for x in c.completions if x.token_versions and len(set(x.token_versions)) == 2]
        assert spanning, "no trained sample spans the sync"
        moved = 0.0
        for x in spanning:
            k = x.token_versions.index(v0 + 1)
            assert x.token_versions == [v0] * k + [v0 + 1] * (len(x.token_versions) - k) and x.weight_version == v0
            prefix, prefix_lp = in_flight[(x.prompt_uid, x.sample_index)]
            assert x.response_token_ids[:k] == prefix and x.response_logprobs[:k] == prefix_lp  # kept from v0
            now = _engine_logprobs(t, x)
            assert now[k:] == pytest.approx(x.response_logprobs[k:], abs=1e-4)  # the v0+1 engine's
            moved = max(moved, max(abs(a - b) for a, b in zip(now[:k], prefix_lp)))
        assert moved > 1e-3, "the update did not move the prefix's log-probs: the test could not tell versions apart"
        t.pending = c
        m = t.rl_step()
        assert m["rollout/staleness_max"] == 1.0 and m["partial/multi_version_share"] > 0
        # step 1 is old_logprob_source=auto's check: its gap is measured on the rows sampled wholly by the
        # learner's current weights (v0 + 1) alone, so the tokens sampled by v0 (moved > 1e-3 above) do not switch
        # a float32 run to recompute
        assert m["actor/old_logprob_recomputed"] == 0.0 and m["actor/old_logprob_gap"] < 1e-4, m
        left = [(g.row.uid, [s.versions for s in g.samples]) for g in t.collector.buffer.groups]
        path = t.save()
        assert (path / PARTIAL_FILE).is_file()
        point = find_resume_point(t.cfg.model_copy(update={"trainer": t.cfg.trainer.model_copy(
            update={"resume": True})}), t.run_dir, t.data_fingerprint)
        assert [(g.row.uid, [s.versions for s in g.samples]) for g in point.partial.groups] == left
        assert point.state.weight_version == t.weight_version  # the staleness accounting's reference
    finally:
        t.shutdown()


def _as_completion(g, s):
    """An unfinished sample as a Completion, only to ask the engine for its prefix's log-probs."""
    from rollout.contracts import Completion

    return Completion(g.row.uid, s.sample_index, list(g.row.prompt_token_ids), list(s.token_ids), list(s.logprobs),
                      s.text, "length", 0)


def _engine_routing(trainer, token_ids: list[int]):
    """The experts the engine (at its current weights) runs for positions ``0 .. len(token_ids) - 1``: the
    routing of a one-token request whose prompt is ``token_ids``."""
    import ray

    from rollout.contracts import PromptRow

    row = PromptRow(uid="probe", prompt="", prompt_token_ids=list(token_ids), answer="")
    (c,) = ray.get(trainer.fleet.engines[0].generate.remote([row], 1, max_tokens=1, seed=0))
    return c.routed_experts[: len(token_ids)]


@pytest.mark.matrix  # wide case: the default set runs one partial rollout across a sync (test_a_sample_spanning_a_sync_...)
def test_r3_replays_each_token_under_the_experts_of_the_version_that_sampled_it(tmp_path, ray_session):
    """R3 with partial rollouts: a trained sample that spans a sync carries, for the positions that sampled its
    v0 tokens (and the prompt), the experts of the v0 engine, and for the positions that sampled its v0+1 tokens
    those of the v0+1 engine, which differ from what v0+1 runs on the prefix; the R3 step trains on it."""
    import numpy as np

    t = _trainer(tmp_path, "partial_r3", [*PARTIAL, "learner.routing_replay=rollout",
                                          "rollout.return_routed_experts=true"])
    t.start()
    try:
        v0 = t.weight_version
        t.collector.collect(0)
        before = {(g.row.uid, s.sample_index): _engine_routing(t, list(g.row.prompt_token_ids) + s.token_ids)
                  for g in t.collector.buffer.groups for s in g.samples if s.token_ids and not s.finished}
        assert before, "no sample was cut at the segment"
        t.warm_start()
        assert t.weight_version == v0 + 1
        c = t.collector.collect(1)
        spanning = [x for x in c.completions if x.token_versions and len(set(x.token_versions)) == 2]
        assert spanning, "no trained sample spans the sync"
        recomputed_differs = False
        for x in spanning:
            k, P = x.token_versions.index(v0 + 1), len(x.prompt_token_ids)
            seq = x.prompt_token_ids + x.response_token_ids
            rows = x.routed_experts
            assert rows.shape == (len(seq) - 1, 2, 2)
            old = before[(x.prompt_uid, x.sample_index)]  # the v0 engine on prompt + prefix: P + k rows
            now = _engine_routing(t, seq[:-1])  # the v0+1 engine on the whole sequence but its last token
            assert np.array_equal(rows[: P + k - 1], old[: P + k - 1])  # the prompt and v0's sampling positions
            assert np.array_equal(rows[P + k - 1 :], now[P + k - 1 :])  # v0+1's sampling positions
            recomputed_differs |= not np.array_equal(now[: P + k - 1], old[: P + k - 1])
        assert recomputed_differs, "the update moved no expert of any prefix: the test could not tell the splice"
        t.pending = c
        m = t.rl_step()
        assert m["rollout/staleness_max"] == 1.0 and np.isfinite(m["actor/train_rollout_logprob_diff"])
    finally:
        t.shutdown()


@pytest.mark.matrix  # wide case: the default set runs one partial rollout across a sync (test_a_sample_spanning_a_sync_...)
def test_a_rollback_samples_the_in_flight_prompts_again_without_losing_or_repeating_one(tmp_path, ray_session):
    """Partial rollouts under the health guard: after a rollback to a checkpoint, the samples in flight (sampled
    by the weights rolled over) are thrown away and their groups sampled again from their prompts, in order."""
    t = _trainer(tmp_path, "partial_rollback", [*PARTIAL, "trainer.total_steps=6", "health.enabled=true",
                                                "health.rollback_after=2", "health.max_rollbacks=1",
                                                "health.max_grad_norm=1e6"])
    t.start()
    try:
        assert t.rl_step().get("health/skipped") == 0.0
        t.save()
        t.cfg.health.min_entropy = 1e9  # every step now fails its check
        assert t.rl_step()["health/skipped"] == 1.0
        buf = t.collector.buffer
        t.pending = t.collector.collect(t.step)  # the next step's rollout, taken here to see the buffer after it
        before = [g.row.uid for g in buf.groups]
        assert any(s.token_ids for g in buf.groups for s in g.samples), "nothing in flight to throw away"
        restarted = buf.restarted_samples
        m = t.rl_step()  # trains on t.pending; the second failure in a row: roll back
        assert m["health/rollbacks"] == 1.0
        assert [g.row.uid for g in buf.groups] == before  # the same groups, in order: none lost, none added
        assert all(not s.token_ids and not s.finished for g in buf.groups for s in g.samples)
        assert buf.restarted_samples > restarted
    finally:
        t.shutdown()


@pytest.mark.matrix  # wide case: the default set runs one partial rollout across a sync (test_a_sample_spanning_a_sync_...)
def test_rounds_beside_the_learner_keep_the_engines_sampling_within_the_staleness_bound(tmp_path, ray_session):
    """trainer.partial_rollout_overlap: while the learner trains, the engines run rounds at the weights it started
    from; the next steps train on samples begun there (their first tokens one version older than the learner's
    weights), the oldest token never more than max_staleness=2 versions old, none dropped."""
    t = _trainer(tmp_path, "partial_overlap", [*PARTIAL, "trainer.max_staleness=2", "trainer.total_steps=4",
                                               "trainer.partial_rollout_overlap=true"])
    t.start()
    try:
        steps = [t.rl_step() for _ in range(3)]
        beside = [m["partial/rounds_beside_learner"] for m in steps]
        # (a step may find nothing to do beside: the tiny engine outruns the 2-rank learner and the buffer
        # already holds the next step's P finished groups)
        assert beside[0] == 0 and any(b >= 1 for b in beside[1:]), beside
        assert all(m["rollout/staleness_max"] <= 2 for m in steps)
        assert max(m["rollout/staleness_max"] for m in steps[1:]) >= 1  # trained on tokens sampled beside
        assert all(m["partial/restarted_samples"] == 0 for m in steps)
    finally:
        t.shutdown()
