"""The long-tail variant of the generated arithmetic task (``data.long_tail_fraction``): a share of the problems
asks for the sum written ``data.long_tail_repeat`` times, so their answers need about that many times more tokens.

A long problem ends its prompt with ``#`` instead of ``=`` (``"07+48#"`` -> ``"5555555555555555"`` with repeat 8), so
the policy can tell the two kinds apart; the ``exact`` verifier scores both. Response lengths then have a heavy
tail: in a synchronous step the engines wait for the long answers while the short ones are done, the workload
partial rollouts (``trainer.partial_rollouts``) are for.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Callable

from rollout.contracts import PromptRow

LONG_MARK = "#"


def long_tail_rows(rows: list[PromptRow], tokenize: Callable[[str], list[int]], *, fraction: float, repeat: int,
                   seed: int) -> list[PromptRow]:
    """``rows`` (arithmetic ``"a+b="`` rows) with a share ``fraction`` of them, chosen with ``seed``, made long:
    prompt ending in ``#``, answer and warm-start demonstration repeated ``repeat`` times, uid suffixed ``#``.

    Raises:
        ValueError: ``fraction`` outside ``[0, 1)``, ``repeat < 2``, or a row whose prompt does not end in ``=``.
    """
    if not 0.0 <= fraction < 1.0 or repeat < 2:
        raise ValueError(f"data.long_tail_fraction={fraction} must be in [0, 1) and data.long_tail_repeat={repeat} >= 2")
    rng = random.Random(seed)
    out = []
    for row in rows:
        if not row.prompt.endswith("="):
            raise ValueError(f"prompt uid={row.uid!r}: {row.prompt!r} is not an arithmetic prompt ending in '='")
        if rng.random() >= fraction:
            out.append(row)
            continue
        prompt = row.prompt[:-1] + LONG_MARK
        meta = {**row.meta, "solution": row.meta.get("solution", row.answer) * repeat}
        out.append(replace(row, uid=row.uid + LONG_MARK, prompt=prompt, prompt_token_ids=tokenize(prompt),
                           answer=row.answer * repeat, meta=meta))
    return out
