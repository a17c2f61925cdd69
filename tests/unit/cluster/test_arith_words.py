"""The arithmetic-in-words rows of configs/smollm2_arith.yaml (cluster/data/arith_words.py)."""

import json
import re

import pytest

from cluster.data.arith_words import NUM_PROBLEMS, split_rows, write


def test_rows_are_right_disjoint_and_seeded(tmp_path):
    train, test = split_rows(300, 50, seed=3)
    assert len(train) == 300 and len(test) == 50
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for r in train + test:
        a, op, b = re.fullmatch(r"What is (\d+) (plus|minus|times) (\d+)\?", r["question"]).groups()
        assert int(r["answer"]) == {"plus": int(a) + int(b), "minus": int(a) - int(b), "times": int(a) * int(b)}[op]
        assert int(r["answer"]) >= 0 and r["op"] == op
    assert (train, test) == split_rows(300, 50, seed=3) and (train, test) != split_rows(300, 50, seed=4)
    out = write(tmp_path / "rows", 20, 5, seed=1)
    assert [json.loads(x) for x in (out / "test.jsonl").read_text().splitlines()] == split_rows(20, 5, 1)[1]


def test_more_rows_than_problems_are_refused():
    with pytest.raises(ValueError, match=f"at most {NUM_PROBLEMS}"):
        split_rows(NUM_PROBLEMS, 1, seed=0)
    with pytest.raises(ValueError, match="num_test=0"):
        split_rows(10, 0, seed=0)
