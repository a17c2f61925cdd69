"""Partial rollouts' bookkeeping: token versions across syncs, the staleness bound (drop, count, sample again),
the segment length, the round scheduler and the config's refusals; a buffer pickled into a checkpoint keeps its
in-flight samples and its staleness accounting. The real engines are in
tests/integration/test_partial_rollouts.py; here a scripted stand-in fleet answers the rounds."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
from pydantic import ValidationError

from cluster.config import load_config
from cluster.data.prompts import PromptStream
from cluster.driver.collect import Collected
from cluster.driver.partial_buffer import PartialBuffer, to_completion
from cluster.driver.partial_rollout import PartialCollector, segment_tokens, slot_utilization
from rollout.contracts import Completion
from tests.helpers import REPO_ROOT
from tests.helpers.partial import AllCorrect, ScriptedFleet, collector, row

TINY = REPO_ROOT / "configs" / "tiny_moe.yaml"


def piece(tokens: list[int], version: int, reason: str, lp: float = -0.5) -> Completion:
    return Completion("r0", 0, [], tokens, [lp] * len(tokens), "x" * len(tokens), reason, version)


def test_segment_length_default_lets_every_sample_finish_within_the_bound():
    assert segment_tokens(32, 1) == 16
    assert segment_tokens(32, 3) == 8
    assert segment_tokens(30, 2) == 10
    assert segment_tokens(7, 1) == 7  # no divisor of 7 in [4, 6]
    assert segment_tokens(32, 1, configured=4) == 4
    with pytest.raises(ValueError, match="partial_segment_tokens=5 must divide"):
        segment_tokens(32, 1, configured=5)


def test_a_sample_spanning_a_sync_keeps_each_tokens_version_and_logprob():
    buf = PartialBuffer(group_size=2, max_response_tokens=8, max_staleness=1)
    buf.admit([row()])
    r0, r1 = buf.requests()
    buf.extend(r0, piece([1, 2, 3, 4], version=3, reason="length", lp=-0.1), segment_tokens=4)
    buf.extend(r1, piece([7, 9], version=3, reason="stop", lp=-0.2), segment_tokens=4)
    assert buf.num_ready() == 0 and buf.take(1, version=3) == []
    # the sync: version 4; the unfinished sample continues with its prefix in the prompt
    assert buf.expire(4) == 0
    (cont,) = buf.requests()
    assert cont.index == 0 and cont.prompt_token_ids == [5, 6, 1, 2, 3, 4]
    buf.extend(cont, piece([8, 8, 8, 8], version=4, reason="length", lp=-0.3), segment_tokens=4)
    (g,) = buf.take(1, version=4)
    c0, c1 = (to_completion(g, s) for s in g.samples)
    assert c0.response_token_ids == [1, 2, 3, 4, 8, 8, 8, 8] and c0.finish_reason == "length"  # at the limit
    assert c0.token_versions == [3, 3, 3, 3, 4, 4, 4, 4] and c0.weight_version == 3  # the oldest token's
    assert c0.response_logprobs == [-0.1] * 4 + [-0.3] * 4
    assert c1.token_versions == [3, 3] and c1.finish_reason == "stop"
    assert buf.groups == [] and buf.restarted_samples == 0


def test_samples_beyond_the_bound_are_dropped_counted_and_sampled_again():
    buf = PartialBuffer(group_size=2, max_response_tokens=8, max_staleness=1)
    buf.admit([row()])
    r0, r1 = buf.requests()
    buf.extend(r0, piece([1, 2, 3, 4], 3, "length"), 4)
    buf.extend(r1, piece([7], 3, "stop"), 4)  # finished, waiting for its sibling
    assert buf.expire(4) == 0  # 1 version old: within k=1
    assert buf.expire(5) == 2  # 2 versions old: both restarted, the finished one too
    assert (buf.restarted_samples, buf.dropped_tokens) == (2, 5)
    assert [r.prompt_token_ids for r in buf.requests()] == [[5, 6], [5, 6]]  # from the prompt again
    assert buf.num_unfinished() == 1


def test_take_refuses_a_sample_beyond_the_bound_and_extend_refuses_overruns():
    buf = PartialBuffer(group_size=1, max_response_tokens=4, max_staleness=2)
    buf.admit([row()])
    (r,) = buf.requests()
    buf.extend(r, piece([1], 1, "stop"), 4)
    with pytest.raises(RuntimeError, match="3 versions old at version 4, beyond trainer.max_staleness=2"):
        buf.take(1, version=4)
    buf.admit([row("r1")])
    (r,) = buf.requests()
    with pytest.raises(ValueError, match="exceed rollout.max_response_tokens=4"):
        buf.extend(r, piece([1] * 5, 1, "length"), 5)
    buf.extend(r, piece([1], 1, "stop"), 4)
    with pytest.raises(ValueError, match="has already finished"):
        buf.extend(r, piece([1], 1, "stop"), 4)
    with pytest.raises(ValueError, match="max_staleness=0 must be >= 1"):
        PartialBuffer(2, 4, 0)


def test_a_pickled_buffer_resumes_with_nothing_lost_and_the_same_staleness_accounting():
    buf = PartialBuffer(group_size=2, max_response_tokens=8, max_staleness=1)
    buf.admit([row("a"), row("b")])
    reqs = buf.requests()
    for r, v in zip(reqs, [3, 3, 4, 4]):
        buf.extend(r, piece([1, 2, 3, 4], v, "length"), 4)
    buf.rounds = 7
    back = pickle.loads(pickle.dumps(buf))  # what the checkpoint holds
    assert [(r.group.row.uid, r.index, r.prompt_token_ids) for r in back.requests()] == \
           [(r.group.row.uid, r.index, r.prompt_token_ids) for r in buf.requests()]
    assert (back.next_serial, back.rounds) == (2, 7)
    # after the restart the driver's weight version is 5: group a (version 3) is past the bound, b is not
    assert back.expire(5) == 2 and [s.versions for s in back.groups[1].samples] == [[4] * 4, [4] * 4]
    assert back.restarted_samples == 2 and back.dropped_tokens == 8





def test_the_collector_admits_rounds_and_carries_long_samples_across_syncs():
    cfg = load_config(TINY, ["trainer.partial_rollouts=true", "trainer.max_staleness=2", "trainer.prompts_per_step=4",
                             "trainer.group_size=2", "rollout.max_response_tokens=12", "rollout.max_model_len=40",
                             "trainer.partial_segment_tokens=4", "learner.world_size=1", "learner.num_minibatches=1",
                             "learner.micro_batch_size=8"])
    rows = [row(("long" if i % 4 == 0 else "short") + f"/{i}", (9,)) for i in range(64)]
    fleet = ScriptedFleet()
    col = PartialCollector(cfg, PromptStream(rows, seed=0), fleet, AllCorrect(), lambda: fleet.version)
    assert col.segment == 4
    seen_multi = False
    for step in range(6):
        c = col.collect(step)
        assert len(c.prompts) == 4 and len(c.completions) == 8 and len(c.results) == 8
        for x in c.completions:
            assert fleet.version - x.weight_version <= 2 and len(x.token_versions) == len(x.response_token_ids)
            assert len(x.response_token_ids) == (12 if x.prompt_uid.startswith("long") else 3)
            seen_multi |= len(set(x.token_versions)) > 1
        assert len(col.buffer.groups) <= 8  # at most 2 P groups in the buffer
        fleet.version += 1  # the sync after the step's update
    assert seen_multi and col.stats["partial/restarted_samples"] == 0
    assert max(fleet.calls) <= 16  # one request per unfinished sample: at most 2 P groups x G





def test_the_collector_reports_the_tokens_the_staleness_bound_dropped():
    """k=1 with 4-token segments of 12-token samples: a long sample carried over two syncs is dropped; each
    step's partial/dropped_tokens counts the tokens its own expiry threw away."""
    col, fleet = collector("trainer.max_staleness=1")
    reported = restarted = 0.0
    for step in range(6):
        col.collect(step)
        reported += col.stats["partial/dropped_tokens"]
        restarted += col.stats["partial/restarted_samples"]
        fleet.version += 1
    assert restarted == col.buffer.restarted_samples > 0
    assert reported == col.buffer.dropped_tokens > 0


class StoppingFleet(ScriptedFleet):
    """Sets ``stop`` during its ``rounds``-th call (as the learner finishing mid-round would)."""

    def __init__(self, rounds: int):
        super().__init__()
        self.stop, self.rounds = __import__("threading").Event(), rounds

    def generate_stream(self, rows, n, **kw):
        if len(self.calls) + 1 == self.rounds:
            self.stop.set()
        yield from super().generate_stream(rows, n, **kw)


def test_rounds_beside_the_learner_run_until_stopped_and_count_in_the_next_collection():
    col, fleet = collector("trainer.max_staleness=2", "trainer.deterministic=false", fleet=StoppingFleet(rounds=0))
    col.collect(0)
    fleet.rounds = len(fleet.calls) + 2  # the learner finishes during the second round beside it
    in_flight = col.buffer.num_unfinished()
    col.rounds_beside(fleet.stop)
    assert col.buffer.beside_rounds == 2 and col.buffer.beside_tokens > 0  # the round under way completed, no more
    beside_tokens = col.buffer.beside_tokens
    fleet.version += 1
    c = col.collect(1)
    assert col.stats["partial/rounds_beside_learner"] == 2 and c.rounds >= 2 and c.generated_tokens >= beside_tokens
    assert col.buffer.beside_rounds == col.buffer.beside_tokens == 0  # counted once
    assert in_flight > 0 and any(x.token_versions and x.token_versions[0] == 0 for x in c.completions)


def test_rounds_beside_the_learner_end_when_nothing_is_left_to_sample():
    import threading

    col, fleet = collector("trainer.max_staleness=2", "trainer.deterministic=false")
    col.collect(0)
    worker = threading.Thread(target=col.rounds_beside, args=(threading.Event(),))  # never stopped
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and col.buffer.num_unfinished() == 0
    assert col.buffer.num_ready() >= 4 and len(col.buffer.groups) <= 8  # admitted only what a step needs


class LongStoppingFleet(StoppingFleet):
    """Every sample 12 tokens long: 6 rounds of 2 before a group is ready."""

    def generate_stream(self, rows, n, **kw):
        yield from super().generate_stream([dataclasses.replace(r, uid="long" + r.uid) for r in rows], n, **kw)


@pytest.mark.parametrize("stop_in_round", [1, 2, 99])
def test_deterministic_rounds_beside_the_learner_do_not_follow_when_it_stops(stop_in_round):
    """trainer.deterministic (the default): the rounds beside the learner run until a step's groups are ready,
    wherever in them the learner finishes, so the buffer ends the same however long the learner took."""
    long = ("trainer.max_staleness=2", "trainer.partial_segment_tokens=2")
    col, fleet = collector(*long, fleet=LongStoppingFleet(rounds=0))
    fleet.rounds = stop_in_round
    col.rounds_beside(fleet.stop)
    assert col.buffer.num_ready() >= 4 and col.buffer.beside_rounds >= 2
    ends = [(g.row.uid, [len(s.token_ids) for s in g.samples]) for g in col.buffer.groups]
    again, _ = collector(*long, fleet=LongStoppingFleet(rounds=0))
    again.rounds_beside(__import__("threading").Event())  # never stopped
    assert again.buffer.beside_rounds == col.buffer.beside_rounds
    assert [(g.row.uid, [len(s.token_ids) for s in g.samples]) for g in again.buffer.groups] == ends


def test_rounds_beside_the_learner_are_counted_after_a_resume_from_the_checkpoint_that_holds_them():
    """The rounds beside the learner run before the step's checkpoint and are reported with the next step: the
    buffer (what a checkpoint saves) carries their counts, so a run resumed from it reports the same step."""
    long = ("trainer.max_staleness=2", "trainer.partial_segment_tokens=2")
    col, fleet = collector(*long, fleet=LongStoppingFleet(rounds=0))
    col.collect(0)
    col.rounds_beside(__import__("threading").Event())
    saved = pickle.dumps(col.buffer)
    resumed, _ = collector(*long, fleet=LongStoppingFleet(rounds=0))
    resumed.buffer, resumed.stream.position = pickle.loads(saved), col.stream.position
    col.collect(1)
    resumed.collect(1)
    assert col.stats["partial/rounds_beside_learner"] >= 1
    assert resumed.stats == col.stats  # rounds, rounds beside the learner, slot utilization: all of them


def test_slot_utilization_counts_the_tail():
    c = Collected(completions=[piece([1, 1], 0, "stop"), piece([1] * 8, 0, "stop")])
    assert slot_utilization(c) == pytest.approx(10 / 16)
    assert slot_utilization(Collected()) == 0.0


@pytest.mark.parametrize("overrides, match", [
    (["trainer.max_staleness=2"], "trainer.max_staleness=2 needs trainer.partial_rollouts=true"),
    (["trainer.partial_rollouts=true", "trainer.max_staleness=0"], "needs trainer.max_staleness >= 1"),
    (["trainer.partial_rollouts=true", "trainer.max_staleness=1", "trainer.dynamic_sampling=true"],
     "refused with trainer.dynamic_sampling"),
    (["trainer.partial_rollouts=true", "trainer.max_staleness=1", "trainer.partial_rollout_overlap=true"],
     "partial_rollout_overlap=true needs trainer.partial_rollouts=true and trainer.max_staleness >= 2"),
    (["trainer.max_staleness=1", "trainer.partial_rollout_overlap=true"], "got False and 1"),
    (["trainer.partial_rollouts=true", "trainer.max_staleness=1", "trainer.partial_segment_tokens=3"],
     "partial_segment_tokens=3 must divide rollout.max_response_tokens=4"),
])
def test_config_refuses_bad_partial_rollout_settings(overrides, match):
    with pytest.raises((ValidationError, ValueError), match=match):
        load_config(TINY, overrides)


def test_config_accepts_partial_rollouts_with_a_staleness_window_and_with_r3():
    cfg = load_config(TINY, ["trainer.partial_rollouts=true", "trainer.max_staleness=3"])
    assert cfg.trainer.max_staleness == 3 and cfg.trainer.partial_segment_tokens is None
    cfg = load_config(TINY, ["trainer.partial_rollouts=true", "trainer.max_staleness=1",
                             "learner.routing_replay=rollout", "rollout.return_routed_experts=true"])
    assert cfg.learner.routing_replay == "rollout"


def routed(rows: int, version: int) -> np.ndarray:
    """int16 [rows, 2 layers, 2]: row t ran experts (version, t) in both layers, so a row names its computation."""
    t = np.arange(rows, dtype=np.int16)[:, None, None]
    return np.concatenate([np.full((rows, 2, 1), version, np.int16), np.broadcast_to(t, (rows, 2, 1))], axis=-1)


def routed_piece(request, tokens: list[int], version: int, reason: str, rows: int | None = None) -> Completion:
    """A piece as the engine reports it: experts for the request's prompt and all new tokens but the last."""
    n = len(request.prompt_token_ids) + len(tokens) - 1 if rows is None else rows
    c = piece(tokens, version, reason)
    c.routed_experts = routed(n, version)
    return c


def test_r3_routing_of_a_sample_spanning_a_sync_is_spliced_per_token_version():
    """Prompt of 2 tokens, 3 tokens at v3 then 3 at v4. Row ``P - 1 + j`` sampled response token ``j``: rows
    0..3 (the prompt's row 0, rows 1..3 that sampled v3's tokens) come from the v3 piece, rows 4..6 (from the
    prefix's last token on: they sampled v4's tokens) from the v4 piece; the v4 piece's own rows 0..3 (the prompt
    and prefix computed again under v4) are not used."""
    buf = PartialBuffer(group_size=1, max_response_tokens=6, max_staleness=1)
    buf.admit([row()])
    (r,) = buf.requests()
    buf.extend(r, routed_piece(r, [1, 2, 3], 3, "length"), 3)
    assert buf.groups[0].samples[0].routing.shape == (4, 2, 2)  # P - 1 + 3
    buf.expire(4)
    (r,) = buf.requests()
    buf.extend(r, routed_piece(r, [4, 5, 6], 4, "length"), 3)  # the v4 request: 5 prompt tokens, 7 rows
    (g,) = buf.take(1, version=4)
    c = to_completion(g, g.samples[0])
    ids = c.routed_experts
    assert ids.shape == (2 + 6 - 1, 2, 2)  # [P + R - 1, layers, k], as an on-policy completion's
    # row P-1+j sampled response token j: its version is token_versions[j]; the prompt's rows the first version
    assert ids[:, 0, 0].tolist() == [3, 3, 3, 3, 4, 4, 4]
    assert ids[:1, 0, 0].tolist() == [c.token_versions[0]]
    assert [ids[1 + j, 0, 0] for j in range(6)] == c.token_versions
    assert ids[:, 0, 1].tolist() == [0, 1, 2, 3, 4, 5, 6]  # each row from its own position in its piece


def test_r3_routing_refuses_a_piece_of_the_wrong_length_or_mixed_capture():
    buf = PartialBuffer(group_size=1, max_response_tokens=6, max_staleness=1)
    buf.admit([row()])
    (r,) = buf.requests()
    with pytest.raises(ValueError, match="routed_experts has 5 rows, expected 4"):
        buf.extend(r, routed_piece(r, [1, 2, 3], 3, "length", rows=5), 3)
    buf.extend(r, routed_piece(r, [1, 2, 3], 3, "length"), 3)
    (r,) = buf.requests()
    with pytest.raises(ValueError, match="a piece without routed_experts after pieces with"):
        buf.extend(r, piece([4, 5, 6], 4, "length"), 3)
    assert buf.expire(5) == 1 and buf.groups[0].samples[0].routing is None  # a restart forgets the routing


def test_the_learner_batch_carries_each_tokens_own_behaviour_logprob():
    """The corrections and the ratio read ``old_log_probs`` per token: a two-version sample's tokens keep the
    log-prob of the version that sampled each of them, at their own positions."""
    import torch

    from cluster.driver.batching import build_train_batch

    buf = PartialBuffer(group_size=1, max_response_tokens=4, max_staleness=1)
    buf.admit([row()])
    (r,) = buf.requests()
    buf.extend(r, piece([1, 2], 3, "length", lp=-0.25), 2)
    buf.expire(4)
    (r,) = buf.requests()
    buf.extend(r, piece([3, 4], 4, "length", lp=-0.75), 2)
    (g,) = buf.take(1, 4)
    c = to_completion(g, g.samples[0])
    batch = build_train_batch([c], torch.tensor([1.0]), torch.tensor([0.5]), 0)
    assert batch.old_log_probs[0, 1:5].tolist() == [-0.25, -0.25, -0.75, -0.75]  # targets of response tokens 0..3
    assert batch.response_mask[0].tolist() == [False, True, True, True, True]
    assert batch.weight_versions.tolist() == [3]


def test_a_rollback_restarts_every_sample_and_keeps_the_groups_in_order():
    """After a health-guard rollback the buffer's samples came from weights rolled over: all are sampled again
    from their prompts (counted), and the groups stay admitted, so no prompt is lost or taken twice."""
    buf = PartialBuffer(group_size=2, max_response_tokens=8, max_staleness=1)
    buf.admit([row("a"), row("b"), row("c")])
    reqs = buf.requests()
    buf.extend(reqs[0], piece([1, 2, 3, 4], 3, "length"), 4)  # a#0 in flight
    buf.extend(reqs[1], piece([7], 3, "stop"), 4)  # a#1 finished
    buf.extend(reqs[2], piece([5, 5], 3, "stop"), 4)  # b#0 finished, b#1 and c untouched
    assert buf.restart_all() == 3 and (buf.restarted_samples, buf.dropped_tokens) == (3, 7)
    assert [g.row.uid for g in buf.groups] == ["a", "b", "c"] and buf.next_serial == 3
    assert [(r.group.row.uid, r.index, r.prompt_token_ids) for r in buf.requests()] == [
        (u, k, [5, 6]) for u in "abc" for k in (0, 1)]
    assert buf.restart_all() == 0  # nothing left to restart
