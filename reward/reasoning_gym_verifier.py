"""The verifier of ``data.task: reasoning_gym`` rows: reasoning-gym's own ``score_answer`` of the row's dataset.

Rows name it as ``reward.reasoning_gym_verifier:reasoning_gym_verifier`` (a ``module:function`` verifier), so the
reward worker runs it like any verifier that is not inline: in a child process of its fork server, under
``reward.timeout_s`` and ``reward.verifier_memory_mb``, killed with its process group when it runs out of time
(``reward/runner.py``). The worker imports this module into the fork server once (it preloads the module of every
``module:function`` verifier), so reasoning-gym's import is not paid per call.

The row's meta (``cluster/data/reasoning_gym_task.py``) holds the reasoning-gym entry (``rg_entry``: question,
answer, metadata), its dataset's name (``rg_dataset``) and config (``rg_config``), and ``answer_format``. The
score is what that dataset's ``score_answer(answer, entry)`` returns (reasoning-gym's composite dataset scores
an entry the same way: by its ``source_dataset``), which for some datasets gives partial credit; ``correct`` is
a score of 1.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import reasoning_gym

from reward.verifiers import as_row_dict, extract_final_answer

OPEN_TAG, CLOSE_TAG = "<answer>", "</answer>"
ANSWER_FORMATS = ("tag", "final", "raw")


def tagged_answer(response: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` of ``response``, stripped, or None when there is none.

    Two reverse searches (linear in the response's length, whatever it holds): the last closing tag, then the last
    opening tag before it. On well-formed text this is reasoning-gym's ``utils.extract_answer`` (its last match);
    where tags nest (``<answer>a<answer>b</answer>``) it takes the innermost (``b``), where that regex takes
    ``a<answer>b``.
    """
    end = response.rfind(CLOSE_TAG)
    if end < 0:
        return None
    start = response.rfind(OPEN_TAG, 0, end)
    if start < 0:
        return None
    return response[start + len(OPEN_TAG):end].strip()


def final_answer(response: str) -> str | None:
    """The final answer as the ``math`` verifier finds it (``reward.verifiers.extract_final_answer``: the ``####``
    line, else the last ``\\boxed{}``, else what follows the last "answer is" / "answer:" to the end of its
    sentence, else the last sentence), and of an equation there the right side of its last ``=`` (``41 + 60 =
    101`` answers ``101``; a dangling ``41 + 60 =`` answers nothing). None when the response has no answer."""
    span = extract_final_answer(response)
    if span is not None and "=" in span:
        span = span.rsplit("=", 1)[1].strip()
    return span


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str) -> Any:
    """reasoning-gym's dataset ``name`` built with the row's config (size 1: only its ``score_answer`` is used)."""
    return reasoning_gym.create_dataset(name, **json.loads(config_json), size=1, seed=0)


def reasoning_gym_verifier(response: str, row: Any) -> dict:
    """Score ``response`` with reasoning-gym's ``score_answer`` of the row's dataset.

    The answer is, by ``meta["answer_format"]``: ``"tag"``, ``tagged_answer(response)`` (None when the response
    has no tags: reasoning-gym scores None as 0); ``"final"``, ``final_answer(response)`` (the ``math``
    verifier's final answer, the right side of an equation); ``"raw"``, the whole response stripped.

    Args:
        response: the model's text (untrusted).
        row: a ``PromptRow`` or its dict, with ``meta`` as ``cluster.data.reasoning_gym_task`` writes it.

    Returns:
        ``{"score": float in [0, 1] (the dataset's score_answer), "correct": score == 1, "dataset": name}``.

    Raises:
        ValueError: the row's meta lacks the reasoning-gym entry or names an unknown dataset or answer format.
    """
    row = as_row_dict(row)
    meta = row.get("meta") or {}
    name, entry, fmt = meta.get("rg_dataset"), meta.get("rg_entry"), meta.get("answer_format", "tag")
    if not isinstance(name, str) or not isinstance(entry, dict) or "answer" not in entry:
        raise ValueError(f"reasoning_gym row {row.get('uid')!r}: meta needs rg_dataset (a name) and rg_entry (a "
                         f"reasoning-gym entry with its answer), got rg_dataset={name!r}")
    if fmt not in ANSWER_FORMATS:
        raise ValueError(f"reasoning_gym row {row.get('uid')!r}: answer_format={fmt!r} is not one of {ANSWER_FORMATS}")
    if fmt == "tag":
        answer = tagged_answer(response)
    else:
        answer = final_answer(response) if fmt == "final" else response.strip()
    config = json.dumps(meta.get("rg_config") or {}, sort_keys=True)
    score = float(_dataset(name, config).score_answer(answer, entry))
    return {"score": score, "correct": score == 1.0, "dataset": name}
