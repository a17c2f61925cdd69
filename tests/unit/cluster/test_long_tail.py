"""The long-tail arithmetic variant: the chosen share of problems asks for the sum repeated, marked in the prompt."""

from __future__ import annotations

import pytest

from cluster.config import load_config
from cluster.data.long_tail import long_tail_rows
from cluster.data.prompts import arithmetic_rows
from cluster.data.tasks import load_rows
from cluster.models.tiny_model import build_char_tokenizer
from tests.helpers import REPO_ROOT


def tok(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def test_a_share_of_rows_asks_for_the_sum_repeated():
    train, _ = arithmetic_rows(tok, max_operand=99, num_train=2000, num_eval=10, seed=1)
    out = long_tail_rows(train, tok, fraction=0.25, repeat=8, seed=5)
    long = [r for r in out if r.prompt.endswith("#")]
    assert 0.2 < len(long) / len(out) < 0.3
    r = long[0]
    a, b = (int(x) for x in r.prompt[:-1].split("+"))
    assert r.answer == str(a + b) * 8 and r.meta["solution"] == str(a + b) * 8 and r.uid.endswith("#")
    assert r.prompt_token_ids == tok(r.prompt)
    short = [r for r in out if r.prompt.endswith("=")]
    assert all(int(r.answer) == sum(int(x) for x in r.prompt[:-1].split("+")) for r in short)
    assert len({r.uid for r in out}) == len(out)
    assert long_tail_rows(train, tok, fraction=0.25, repeat=8, seed=5) == out  # seeded
    assert long_tail_rows(train, tok, fraction=0.0, repeat=8, seed=5) == train


def test_bad_long_tail_arguments_name_the_field():
    train, _ = arithmetic_rows(tok, max_operand=9, num_train=5, num_eval=2, seed=1)
    with pytest.raises(ValueError, match="long_tail_repeat=1"):
        long_tail_rows(train, tok, fraction=0.5, repeat=1, seed=0)
    with pytest.raises(ValueError, match="long_tail_fraction=1.0"):
        long_tail_rows(train, tok, fraction=1.0, repeat=8, seed=0)


def test_the_arithmetic_task_applies_it_to_both_splits():
    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe.yaml", ["data.long_tail_fraction=0.5", "data.num_train=400",
                                                               "data.num_eval=200"])
    train, held_out = load_rows(cfg, build_char_tokenizer())
    for rows in (train, held_out):
        share = sum(r.prompt.endswith("#") for r in rows) / len(rows)
        assert 0.4 < share < 0.6
    assert not {r.uid for r in train} & {r.uid for r in held_out}
