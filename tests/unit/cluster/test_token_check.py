"""The token check's pure parts: the engine's and the learner's digests of a turn agree, the trained rows' turns
are found from the response mask, and the driver's comparison counts a drift on either side, leaves out by id what
does not train, and keeps its pool across a checkpoint; the debug switch's re-rendered history differs."""

from __future__ import annotations

import pickle

import torch

from cluster.driver.batching import build_train_batch
from cluster.driver.episodes import Episode, rerendered_context
from cluster.driver.token_check import TokenCheck
from learner.microbatch import MicroBatch
from learner.token_digests import trained_turn_digests
from learner.token_digests import turn_digest as learner_digest
from rollout.contracts import PromptRow
from rollout.token_records import TokenRecords
from rollout.token_records import turn_digest as engine_digest


def _episode(episode_id: str = "p#1@1.0") -> tuple[Episode, TokenRecords]:
    """An episode of two turns and the records an engine would have kept while sampling them."""
    e = Episode(episode_id, PromptRow("p", "1+2=", [5, 6], "3"), 1, seed=7, worker=0, prompt_ids=[5, 6])
    records = TokenRecords()
    for ids, reply in (([7, 8], [20, 21]), ([9, 2], None)):
        records.add(e.episode_id, e.branch, e.prompt_ids + e.response_ids, ids)  # what the engine conditioned on
        e.add(ids, [-0.5] * len(ids), version=1)
        if reply:
            e.add(reply, None, version=1)
    return e, records


def _trained(episodes: list[Episode]) -> list[tuple[int, int, str]]:
    """The turns as a learner rank digests them: the batch cut into micro-batches of one row, trimmed."""
    b = build_train_batch([e.completion() for e in episodes], torch.ones(len(episodes)), torch.ones(len(episodes)),
                          pad_token_id=0)
    out = []
    for i in range(len(b)):
        mb = MicroBatch(b, i, i + 1, torch.device("cpu"), "response_mask")
        out += trained_turn_digests(mb.input_ids, mb.mask)
    return out


def test_the_engine_and_the_learner_digest_a_turn_alike():
    ctx, ids = [1, 5, 70000, 3], [9, 2]
    assert engine_digest(ctx, ids) == learner_digest(torch.tensor(ctx), torch.tensor(ids))
    assert engine_digest(ctx, ids) != engine_digest(ctx + [9], [2])  # the split is kept by the lengths beside it
    assert engine_digest(ctx, ids) != engine_digest(ctx, [9, 3])


def test_trained_turns_are_the_runs_of_the_response_mask():
    e, records = _episode()
    got = _trained([e])
    assert [(c, n) for c, n, _ in got] == [(2, 2), (6, 2)]  # turn 2's context: prompt, turn 1, the reply
    assert got == [r[2:] for r in records.take()[0]]


def test_the_check_is_zero_for_the_sampled_ids_and_counts_a_drift_on_either_side():
    (a, ra), (b, rb) = _episode("p#0@1.0"), _episode("p#1@1.0")
    check = TokenCheck()
    check.add(ra.take()[0] + rb.take()[0])
    m = check.compare(_trained([a, b]), [(a.episode_id, 0), (b.episode_id, 0)])
    assert m["agent/token_mismatch"] == 0.0 and m["agent/token_turns"] == 4.0 and not check.pool

    (a, ra), _ = _episode("p#0@2.0"), None
    check.add(ra.take()[0])
    a.response_ids[4] = 3  # the second turn trained on another id than the engine sampled
    m = check.compare(_trained([a]), [(a.episode_id, 0)])
    assert m["agent/token_unsampled"] == 1.0 and m["agent/token_untrained"] == 1.0
    assert m["agent/token_mismatch"] == 2.0

    (a, ra) = _episode("p#0@3.0")
    check.add(ra.take()[0])
    a.response_ids[2] = 22  # the reply re-tokenized: turn 2 trains on a context the engine never ran
    assert check.compare(_trained([a]), [(a.episode_id, 0)])["agent/token_mismatch"] == 2.0


def test_what_does_not_train_is_left_out_by_id_not_by_loosening():
    (a, ra), (late, rl) = _episode("p#0@1.0"), _episode("p#5@1.0")
    check = TokenCheck(keep_drains=2)
    check.add(ra.take()[0] + rl.take()[0])
    check.add([(a.episode_id, 1, 2, 3, "an unchosen branch's turn")])  # a forked branch that does not train
    m = check.compare(_trained([a]), [(a.episode_id, 0)])
    assert m["agent/token_mismatch"] == 0.0 and list(check.pool) == [late.episode_id]  # waits for its step
    assert check.compare(_trained([late]), [(late.episode_id, 0)])["agent/token_mismatch"] == 0.0
    check.add([("eval#0@9.0", 0, 2, 1, "x")])  # never trained: forgotten after keep_drains drains
    check.drains += 3
    check.drain([])
    assert not check.pool
    m = check.compare(_trained([a]), [(a.episode_id, 0)])  # records gone: every trained turn is counted
    assert m["agent/token_unsampled"] == 2.0
    assert check.compare([], [(a.episode_id, 0)], checked=False) == {"agent/token_checked": 0.0}


def test_the_pool_survives_a_checkpoint_and_the_engine_buffer_is_bounded():
    (a, ra) = _episode()
    check = TokenCheck()
    check.add(ra.take()[0])
    again = TokenCheck.from_state(pickle.loads(pickle.dumps(check.state())))
    assert again.compare(_trained([a]), [(a.episode_id, 0)])["agent/token_mismatch"] == 0.0
    small = TokenRecords(max_records=2)
    for i in range(5):
        small.add("e", 0, [1], [i])
    records, lost = small.take()
    assert [r[4] for r in records] == [engine_digest([1], [3]), engine_digest([1], [4])] and lost == 3
    assert small.take() == ([], 0)


def test_the_debug_rerendering_is_not_the_sampled_ids():
    from cluster.models.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer()
    e = Episode("p#0", PromptRow("p", "1+2=", tok("1+2=")["input_ids"], "3"), 0, seed=1, worker=0,
                prompt_ids=tok("1+2=")["input_ids"])
    e.add(tok("<call>calc 1+2</call>")["input_ids"], [-0.1] * 21, version=0)
    e.add(tok("<result>3</result>")["input_ids"], None, version=0)
    again = rerendered_context(tok, e, chat=False)
    assert tok.decode(again) == "1+2=\n<call>calc 1+2</call>\n<result>3</result>"
    assert again != e.prompt_ids + e.response_ids
