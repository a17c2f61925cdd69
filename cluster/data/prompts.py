"""Prompts for training and evaluation: the procedural arithmetic task, data paths, and the prompt stream
(rows from files, GSM8K included: ``cluster/data/files.py``).

Rows become ``PromptRow`` (rollout/contracts.py). Bad rows (missing fields, empty or over-long prompts,
undecodable bytes) are counted and skipped with a warning that names the row; a split with no usable row
stops with ``DataError``.
"""

from __future__ import annotations

import glob
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster.common import REPO_ROOT
from rollout.contracts import PromptRow

log = logging.getLogger(__name__)



class DataError(ValueError):
    """A dataset that cannot be used (no usable rows, unreadable file); the message names file and field."""


@dataclass
class LoadReport:
    """What loading a split kept and skipped. ``skipped`` maps a reason to its count."""

    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        """Count a skipped row; the first 10 rows are named in a warning each, the rest in the summary."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        total = sum(self.skipped.values())
        if total <= 10:
            log.warning("skipping %s: %s", where, reason)
        elif total == 11:
            log.warning("more rows skipped; the counts per reason follow when loading ends")


# --------------------------------------------------------------------------------------------- arithmetic


def arithmetic_solution(a: int, b: int, slip: bool = False) -> str:
    """The response the warm start imitates for ``a+b``: the sum in decimal, e.g. ``"85"`` for 37+48.

    With ``slip``, a demonstration with a systematic human-like error: when the units digits carry, the carry
    is dropped (``"75"`` for 37+48). Problems without a units carry are unaffected.
    """
    if slip and (a % 10) + (b % 10) >= 10:
        return str(a + b - 10)
    return str(a + b)


def arithmetic_rows(
    tokenize: Callable[[str], list[int]],
    *,
    max_operand: int,
    num_train: int,
    num_eval: int,
    seed: int,
    demo_slip_rate: float = 0.0,
) -> tuple[list[PromptRow], list[PromptRow]]:
    """All ``a+b`` problems with ``0 <= a, b <= max_operand`` (operands zero-padded to the width of
    ``max_operand``, answer unpadded: ``"07+48="`` -> ``"55"``), shuffled with ``seed``; the first ``num_eval``
    are the held-out split and the next ``num_train`` the training split (disjoint by construction).

    Each training row's ``meta["solution"]`` is the warm start's demonstration; a share ``demo_slip_rate`` of
    the rows (chosen with ``seed``) get the dropped-carry slip of ``arithmetic_solution``: imperfect cold-start
    data that imitation learns and a verifier reward can correct. Rewards always use the true answer.

    Raises:
        DataError: when ``num_eval`` leaves no training problem.
    """
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    if num_eval >= len(pairs):
        raise DataError(
            f"data.num_eval={num_eval} leaves no training prompt: only {len(pairs)} problems with "
            f"data.max_operand={max_operand}"
        )

    width = len(str(max_operand))

    slip_rng = random.Random(seed + 1)

    def row(a: int, b: int, split: str) -> PromptRow:
        prompt = f"{a:0{width}d}+{b:0{width}d}="  # fixed width ("07+48="): every prompt has the same layout
        return PromptRow(
            uid=f"{split}/{a}+{b}",
            prompt=prompt,
            prompt_token_ids=tokenize(prompt),
            answer=str(a + b),
            verifier="exact",
            meta={"solution": arithmetic_solution(a, b, slip=split == "train" and slip_rng.random() < demo_slip_rate)},
        )

    eval_rows = [row(a, b, "eval") for a, b in pairs[:num_eval]]
    train_rows = [row(a, b, "train") for a, b in pairs[num_eval : num_eval + num_train]]
    return train_rows, eval_rows


# ------------------------------------------------------------------------------------------------- files

def resolve_data_path(path: str) -> Path:
    """A data path (a file, a folder or a glob): absolute as given; a relative one from the working directory
    when it exists there (for a glob: when it matches there), else from the repository root
    (``../shared/data/...`` from a clone, the old rule)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    if p.exists() or (glob.has_magic(path) and glob.glob(path, recursive=True)):
        return p
    return REPO_ROOT / p


def read_jsonl(file: Path, report: LoadReport) -> list[tuple[int, dict[str, Any]]]:
    """``(line index, record)`` for every line of a JSONL file that decodes as UTF-8 JSON holding an object;
    other lines (bad bytes, broken JSON, blank lines, non-objects) are counted in ``report`` and skipped.
    Read line by line so that one bad row costs only itself (a whole-file loader stops at the first)."""
    out = []
    with open(file, "rb") as f:
        for i, raw in enumerate(f):
            where = f"{file.name} row {i}"
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                report.skip("not valid UTF-8", where)
                continue
            except json.JSONDecodeError as e:
                report.skip(f"not valid JSON ({e.msg})", where)
                continue
            if not isinstance(rec, dict):
                report.skip(f"a JSON {type(rec).__name__}, not an object", where)
                continue
            out.append((i, rec))
    return out


# ------------------------------------------------------------------------------------------ prompt stream


class PromptStream:
    """An endless, reproducible stream of training prompts: epoch ``e`` is the rows shuffled with
    ``Random(seed + e)``; ``take(n)`` returns the next ``n``. The whole state is ``position`` (prompts taken
    so far), so a resumed run that restores it sees exactly the prompts an uninterrupted run would, across
    epoch boundaries too.
    """

    def __init__(self, rows: list[PromptRow], seed: int, position: int = 0):
        if not rows:
            raise DataError("the training split has no usable row")
        self.rows = rows
        self.seed = seed
        self.position = position
        self._epoch_cache: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = list(range(len(self.rows)))
            random.Random(self.seed + epoch).shuffle(order)
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1]

    @property
    def epoch(self) -> int:
        return self.position // len(self.rows)

    def take(self, n: int) -> list[PromptRow]:
        """The next ``n`` prompts (advancing ``position`` by ``n``)."""
        out = []
        for _ in range(n):
            epoch, idx = divmod(self.position, len(self.rows))
            out.append(self.rows[self._order(epoch)[idx]])
            self.position += 1
        return out

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "num_rows": len(self.rows)}


def dump_rows(rows: list[PromptRow], path: Path) -> None:
    """Write rows as JSONL (for inspection of what a run trained and evaluated on)."""
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"uid": r.uid, "prompt": r.prompt, "answer": r.answer, "verifier": r.verifier}) + "\n")
