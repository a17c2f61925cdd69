"""Data loading (procedural task, GSM8K, bad rows), the resumable prompt stream, padding and the
minibatch/rank split with its global normalisers, and atomic checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cluster.data.files import gsm8k_rows
from cluster.data.prompts import DataError, PromptStream, arithmetic_rows
from cluster.driver import checkpoint
from cluster.driver.batching import build_sft_batch, build_train_batch, split_for_ranks
from learner.objectives import loss_normalisers
from rollout.contracts import Completion
from tests.helpers import REPO_ROOT

GSM8K_TEST = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def tok(text):
    return [ord(c) for c in text]


def test_arithmetic_split_is_disjoint_and_deterministic():
    tr, ev = arithmetic_rows(tok, max_operand=20, num_train=300, num_eval=50, seed=3)
    tr2, ev2 = arithmetic_rows(tok, max_operand=20, num_train=300, num_eval=50, seed=3)
    assert [r.uid for r in tr] == [r.uid for r in tr2] and [r.uid for r in ev] == [r.uid for r in ev2]
    assert not {r.prompt for r in tr} & {r.prompt for r in ev}
    r = ev[0]
    a, b = map(int, r.prompt[:-1].split("+"))
    assert r.answer == str(a + b) and r.prompt_token_ids == tok(r.prompt)
    assert len(r.prompt) == len("07+12=")  # fixed-width operands
    with pytest.raises(DataError, match="data.num_eval=500"):
        arithmetic_rows(tok, max_operand=20, num_train=1, num_eval=500, seed=0)


def test_demonstration_slips_only_touch_carries_and_training_rows():
    from cluster.data.prompts import arithmetic_solution

    assert arithmetic_solution(37, 48) == "85" and arithmetic_solution(37, 48, slip=True) == "75"
    assert arithmetic_solution(31, 48, slip=True) == "79"  # no units carry: nothing to drop
    assert arithmetic_solution(95, 5, slip=True) == "90"
    tr, ev = arithmetic_rows(tok, max_operand=99, num_train=2000, num_eval=100, seed=0, demo_slip_rate=0.6)
    carry = [r for r in tr if int(r.prompt[1]) + int(r.prompt[4]) >= 10]
    slipped = [r for r in carry if r.meta["solution"] != r.answer]
    assert 0.5 < len(slipped) / len(carry) < 0.7
    assert all(r.meta["solution"] == r.answer for r in tr if r not in carry)
    assert all(r.meta["solution"] == r.answer for r in ev)  # held-out rows and all rewards use the truth


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason="needs ../shared/data/gsm8k")
def test_gsm8k_rows_from_shared_data():
    rows, report = gsm8k_rows(str(GSM8K_TEST), tok, split="eval", max_prompt_tokens=2000, limit=20)
    assert len(rows) == 20 and report.kept == 20
    first = json.loads(GSM8K_TEST.read_text().splitlines()[0])
    assert rows[0].answer == first["answer"].split("####")[1].strip().replace(",", "")
    assert rows[0].verifier == "math" and "<<" not in rows[0].meta["solution"]


def test_gsm8k_bad_rows_are_counted_and_skipped(tmp_path, caplog):
    f = tmp_path / "bad.jsonl"
    lines = [
        {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
        {"question": "", "answer": "#### 1"},
        {"question": "no answer field"},
        {"question": "Q?", "answer": "no marker"},
        {"question": "x" * 500, "answer": "#### 3"},
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    data += b'{"question": "bad \xff\xfe bytes", "answer": "#### 5"}\n'  # not UTF-8
    data += b'{"question": "broken json", \n'
    data += b'["a", "list"]\n'
    f.write_bytes(data)
    rows, report = gsm8k_rows(str(f), tok, split="train", max_prompt_tokens=100, limit=None)
    assert [r.answer for r in rows] == ["4"]
    assert sum(report.skipped.values()) == 7
    assert report.skipped["not valid UTF-8"] == 1
    assert "bad.jsonl row 1" in caplog.text
    g = tmp_path / "none.jsonl"
    g.write_text(json.dumps({"question": "", "answer": "#### 1"}) + "\n")
    with pytest.raises(DataError, match="no usable row"):
        gsm8k_rows(str(g), tok, split="train", max_prompt_tokens=100, limit=None)


def test_prompt_stream_resume_is_exact_across_epochs():
    rows, _ = arithmetic_rows(tok, max_operand=5, num_train=30, num_eval=6, seed=0)
    full = PromptStream(rows, seed=7)
    ref = [[r.uid for r in full.take(8)] for _ in range(10)]  # 80 prompts = several epochs of 30
    for cut in (3, 4, 7):  # 4*8 = 32 crosses the epoch boundary at 30; 30 itself is tested below
        s = PromptStream(rows, seed=7)
        for _ in range(cut):
            s.take(8)
        resumed = PromptStream(rows, seed=7, position=s.position)
        assert [[r.uid for r in resumed.take(8)] for _ in range(10 - cut)] == ref[cut:]
    s = PromptStream(rows, seed=7)
    s.take(30)  # exactly one epoch
    assert [r.uid for r in PromptStream(rows, seed=7, position=30).take(8)] == [r.uid for r in s.take(8)]
    epoch0 = [r.uid for r in PromptStream(rows, seed=7).take(30)]
    assert sorted(epoch0) == sorted(r.uid for r in rows)  # each row once per epoch


def _comp(p, r, lp, uid="u", i=0):
    return Completion(uid, i, p, r, lp, "", "stop", 3)


def test_train_batch_alignment():
    comps = [_comp([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3]), _comp([5], [], [], i=1)]
    b = build_train_batch(comps, torch.tensor([1.0, float("nan")]), torch.tensor([0.5, 0.0]), pad_token_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 0, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    # target t is input_ids[t+1]: response tokens 7, 8, 9 are targets 1, 2, 3
    assert b.response_mask.tolist() == [[False, True, True, True], [False] * 4]
    assert torch.allclose(b.old_log_probs[0], torch.tensor([0.0, -0.1, -0.2, -0.3]))
    assert b.weight_versions.tolist() == [3, 3] and math.isnan(float(b.rewards[1]))
    with pytest.raises(ValueError, match="2 log-probs for 3 tokens"):
        build_train_batch([_comp([1], [2, 3, 4], [0.0, 0.0])], torch.zeros(1), torch.zeros(1), 0)


def test_an_episode_trains_on_its_sampled_tokens_only():
    """Turn 1 sampled (7, 8), the environment's reply (20, 21) as context, turn 2 sampled (9): the targets of
    the reply's tokens are not response tokens, so the loss, GSPO's |y_i| (3, not 5) and the token metrics
    count the sampled ones only."""
    episode = _comp([5, 6], [7, 8, 20, 21, 9], [-0.1, -0.2, 0.0, 0.0, -0.3])
    episode.response_mask = [1, 1, 0, 0, 1]
    b = build_train_batch([episode], torch.ones(1), torch.ones(1), pad_token_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 20, 21, 9]]
    assert b.response_mask.tolist() == [[False, True, True, False, False, True]]
    assert torch.allclose(b.old_log_probs[0], torch.tensor([0.0, -0.1, -0.2, 0.0, 0.0, -0.3]))
    assert loss_normalisers(b.response_mask) == (1, 3) and episode.sampled_tokens == 3
    episode.response_mask = [1, 1, 0, 0]
    with pytest.raises(ValueError, match="a response mask of 4 for 5 tokens"):
        build_train_batch([episode], torch.ones(1), torch.ones(1), pad_token_id=0)


def test_sft_batch_masks_only_response():
    b = build_sft_batch([[1, 2]], [[3, 4]], pad_token_id=0)
    assert b.loss_mask.tolist() == [[False, True, True]]


def test_split_for_ranks_partitions_with_global_normalisers():
    n = 16
    comps = [_comp([1], [2] * (i % 4), [0.0] * (i % 4), uid=f"p{i // 4}", i=i % 4) for i in range(n)]
    b = build_train_batch(comps, torch.zeros(n), torch.arange(n, dtype=torch.float32), 0)
    plans = split_for_ranks(b, num_minibatches=2, world_size=2, seed=0)
    seen = sorted(int(a) for p in plans for mb in p.minibatches for a in mb.advantages)
    assert seen == list(range(n))  # every sequence exactly once
    # the plans carry their rows: advantage i is row i, so each shard's advantages are its row indices
    assert all([int(a) for a in p.minibatches[m].advantages] == p.row_indices[m] for p in plans for m in range(2))
    assert sorted(i for p in plans for rows in p.row_indices for i in rows) == list(range(n))
    for m in range(2):
        tokens = sum(int(p.minibatches[m].response_mask.sum()) for p in plans)
        nonempty = sum(int(p.minibatches[m].response_mask.any(-1).sum()) for p in plans)
        assert nonempty < 8  # some responses are empty (i % 4 == 0): they do not count as sequences
        assert all(p.num_tokens[m] == tokens and p.num_sequences[m] == nonempty for p in plans)
    with pytest.raises(ValueError):
        split_for_ranks(b, num_minibatches=3, world_size=2, seed=0)


def test_checkpoint_atomicity(tmp_path):
    assert checkpoint.latest_checkpoint(tmp_path) is None
    t = checkpoint.temp_dir_for(tmp_path, 5)
    (t / "w.bin").write_bytes(b"x")
    checkpoint.finalize(tmp_path, t, 5, {"step": 5}, keep=2)
    # a crash while writing step 10: the temp folder exists, no marker -> never the latest
    t10 = checkpoint.temp_dir_for(tmp_path, 10)
    (t10 / "w.bin").write_bytes(b"half")
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_00000005"
    # a folder with the right name but no marker (e.g. copied by hand, half done) is not picked either
    (checkpoint.checkpoint_root(tmp_path) / "step_00000020").mkdir()
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_00000005"
    for s in (10, 15, 25):
        checkpoint.finalize(tmp_path, checkpoint.temp_dir_for(tmp_path, s), s, {"step": s}, keep=2)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_00000015", "step_00000025"]
    assert checkpoint.read_state(checkpoint.latest_checkpoint(tmp_path)) == {"step": 25}
