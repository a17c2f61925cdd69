"""Arithmetic asked in words, as ``data.task: files`` rows: the chat-model task of ``configs/smollm2_arith.yaml``.

Each row is ``{"question": "What is 37 plus 8?", "answer": "45", "op": "plus"}``: a two-digit number plus or minus a
one-digit one, and one-digit products: what a 135 M chat model gets partly right. The config's
``data.prompt_template`` asks for the result in ``\\boxed{}`` and the ``math`` verifier scores it. Rows are drawn
with a seed, train and test disjoint by problem.

``python -m cluster.data.arith_words OUT_DIR [--num-train N] [--num-test N] [--seed S]`` writes ``train.jsonl`` and
``test.jsonl`` there (``make real-model`` writes ``models/arith_words``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

OPS = ("plus", "minus", "times")
NUM_PROBLEMS = 2 * 90 * 9 + 8 * 8


def problem(rng: random.Random) -> tuple[str, int, int]:
    """One problem ``(op, a, b)``: ``plus``/``minus`` a two-digit and a one-digit number (``minus`` never
    negative), ``times`` two one-digit numbers (2-9)."""
    op = rng.choice(OPS)
    if op == "times":
        return op, rng.randint(2, 9), rng.randint(2, 9)
    return op, rng.randint(10, 99), rng.randint(1, 9)


def row(op: str, a: int, b: int) -> dict[str, str]:
    """The JSON row of a problem: question text, reference answer (decimal string), op name."""
    value = a + b if op == "plus" else a - b if op == "minus" else a * b
    return {"question": f"What is {a} {op} {b}?", "answer": str(value), "op": op}


def split_rows(num_train: int, num_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``num_train`` and ``num_test`` distinct problems (no problem in both), drawn with ``seed``.

    Raises:
        ValueError: a count below 1, or more problems than there are.
    """
    if num_train < 1 or num_test < 1 or num_train + num_test > NUM_PROBLEMS:
        raise ValueError(f"num_train={num_train}, num_test={num_test}: each >= 1 and together at most "
                         f"{NUM_PROBLEMS} (the distinct problems)")
    rng = random.Random(seed)
    seen: set[tuple[str, int, int]] = set()
    picked: list[tuple[str, int, int]] = []
    while len(picked) < num_train + num_test:
        p = problem(rng)
        if p not in seen:
            seen.add(p)
            picked.append(p)
    rows = [row(*p) for p in picked]
    return rows[num_test:], rows[:num_test]


def write(out_dir: str | Path, num_train: int = 1400, num_test: int = 200, seed: int = 0) -> Path:
    """Write ``train.jsonl`` and ``test.jsonl`` into ``out_dir`` (created). Returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = split_rows(num_train, num_test, seed)
    for name, rows in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring). Returns 0."""
    parser = argparse.ArgumentParser(prog="python -m cluster.data.arith_words", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--num-train", type=int, default=1400)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write(args.out_dir, args.num_train, args.num_test, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
