"""reasoning-gym tasks (``data.task: reasoning_gym``): rows from the reasoning-gym library, scored by its own
``score_answer``.

The rows come from reasoning-gym's composite dataset (``reasoning_gym.create_dataset("composite", ...)``) over the
datasets named in ``data.reasoning_gym.datasets``, each row drawn from one of them by weight; its entry (question,
answer, metadata) goes into the row's meta. The verifier, ``reward.reasoning_gym_verifier``, reads the answer
from the response (``data.reasoning_gym.answer_format``) and calls the entry's own dataset's ``score_answer`` in
the reward workers, in a verifier child process under ``reward.timeout_s`` like every other verifier.

Training rows are the composite's first ``data.reasoning_gym.size`` entries at ``seed``; held-out rows are drawn
from a second composite at ``seed + EVAL_SEED_OFFSET``, and a held-out question that is also a training question
(or repeats an earlier held-out one) is dropped, so the two splits share no question. Prompts longer than
``data.max_prompt_tokens`` are counted and skipped (with a warning, as for ``files``).

Each training row also carries a demonstration for the warm start (``meta["solution"]``): the reference answer
in the answer format (``<answer>42</answer>``, ``The answer is 42.``, or ``42`` for ``raw``).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from cluster.data.prompts import DataError, LoadReport
from rollout.contracts import PromptRow

log = logging.getLogger(__name__)

VERIFIER = "reward.reasoning_gym_verifier:reasoning_gym_verifier"  # the rows' verifier (module:function)
EVAL_SEED_OFFSET = 1_000_000_007  # held-out seed = training seed + this (kept in the config's description)
ANSWER_INSTRUCTION = "Give only the final answer, between <answer> and </answer>."  # answer_format tag
FINAL_INSTRUCTION = 'Finish with "The answer is" followed by the final answer.'  # answer_format final
EVAL_DRAW_FACTOR = 4  # held-out entries drawn per wanted row (questions shared with training are dropped)
RESERVED_KEYS = ("seed", "size")  # set by data.reasoning_gym, not per dataset


def known_datasets() -> list[str]:
    """The dataset names reasoning-gym registers (its ``factory.DATASETS``), sorted, ``composite`` left out (it
    is what combines them)."""
    from reasoning_gym.factory import DATASETS

    return sorted(n for n in DATASETS if n != "composite")


def check_datasets(datasets: dict[str, float], config: dict[str, dict[str, Any]]) -> None:
    """Check ``data.reasoning_gym.datasets`` and ``.config`` without generating a row: every name is a
    reasoning-gym dataset, every weight finite and > 0, every config names a listed dataset and builds that
    dataset's config class (its own ``validate`` run). Imports reasoning-gym only when something is named.

    Raises:
        ValueError: the first problem, naming the key and the value (an unknown name with the known ones).
    """
    if not datasets and not config:
        return
    from reasoning_gym.factory import DATASETS

    known = known_datasets()
    for name, weight in datasets.items():
        if name not in known:
            raise ValueError(f"data.reasoning_gym.datasets: unknown dataset {name!r}; known datasets: "
                             f"{', '.join(known)}")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"data.reasoning_gym.datasets.{name}={weight} must be a finite weight > 0")
    for name, kwargs in config.items():
        if name not in datasets:
            raise ValueError(f"data.reasoning_gym.config.{name}: {name!r} is not in data.reasoning_gym.datasets "
                             f"({', '.join(datasets) or 'none'})")
        reserved = [k for k in RESERVED_KEYS if k in kwargs]
        if reserved:
            raise ValueError(f"data.reasoning_gym.config.{name}={kwargs!r}: {reserved} are set by "
                             "data.reasoning_gym.size and .seed, not per dataset")
        config_cls = DATASETS[name][1]
        try:
            built = config_cls(**kwargs)
            if callable(getattr(built, "validate", None)):
                built.validate()
        except (TypeError, ValueError, AssertionError) as err:
            raise ValueError(f"data.reasoning_gym.config.{name}={kwargs!r} is refused by reasoning-gym's "
                             f"{config_cls.__name__}: {err or type(err).__name__}") from None


def generate(datasets: dict[str, float], config: dict[str, dict[str, Any]], *, size: int, seed: int) -> list[dict]:
    """The first ``size`` entries of reasoning-gym's composite dataset over ``datasets`` (name: weight), each
    dataset built with its ``config`` keyword arguments; an entry is ``{"question": str, "answer": str,
    "metadata": {"source_dataset": name, ...}}``. Deterministic in ``seed``.

    Raises:
        ValueError: reasoning-gym refuses the datasets or their config (``check_datasets`` catches that earlier).
    """
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name=n, weight=float(w), config=dict(config.get(n, {}))) for n, w in datasets.items()]
    composite = reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)
    return [composite[i] for i in range(size)]


def prompt_text(question: str, answer_format: str, prompt_template: str | None) -> str:
    """The prompt of a question: ``prompt_template`` with ``{question}`` filled in; without one the question
    itself, followed on a new line by ``ANSWER_INSTRUCTION`` (``answer_format`` tag) or ``FINAL_INSTRUCTION``
    (final); raw adds nothing.

    Raises:
        DataError: the template names another field than ``{question}``.
    """
    if prompt_template is not None:
        try:
            return prompt_template.format(question=question)
        except (KeyError, IndexError) as e:
            raise DataError(f"data.prompt_template={prompt_template!r}: reasoning_gym fills in only {{question}} "
                            f"(got {e})") from None
    instruction = {"tag": ANSWER_INSTRUCTION, "final": FINAL_INSTRUCTION}.get(answer_format)
    return f"{question.rstrip()}\n{instruction}" if instruction else question


def demonstration(answer: str, answer_format: str) -> str:
    """The warm start's target for a row: the reference answer in the answer format (``<answer>42</answer>``,
    ``The answer is 42.`` or, for ``raw``, ``42``)."""
    if answer_format == "tag":
        return f"<answer>{answer}</answer>"
    return f"The answer is {answer}." if answer_format == "final" else answer


def reasoning_gym_rows(tokenize: Callable[[str], list[int]], rg: Any, *, num_eval: int, prompt_template: str | None,
                       max_prompt_tokens: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """Training and held-out rows of ``data.task: reasoning_gym``.

    Args:
        tokenize: prompt text -> token ids (``PromptEncoder.ids``).
        rg: the ``data.reasoning_gym`` section (``datasets``, ``config``, ``size``, ``seed``, ``answer_format``).
        num_eval: held-out rows wanted (``data.num_eval``).
        prompt_template: ``data.prompt_template`` (``{question}``), or None (``prompt_text``).
        max_prompt_tokens: longer prompts are counted and skipped.

    Returns:
        ``(train, held_out)``: at most ``rg.size`` and ``num_eval`` rows; no held-out question is a training
        question, and held-out questions are distinct. Every row's verifier is ``VERIFIER`` and its meta holds
        ``rg_dataset``, ``rg_entry``, ``rg_config`` and ``answer_format`` (training rows also ``solution``).

    Raises:
        DataError: a split has no usable row (every prompt too long, or every held-out question also a
            training one), or the template names another field.
    """
    prompt_text("", rg.answer_format, prompt_template)  # a bad template fails before any row is generated
    train_entries = generate(rg.datasets, rg.config, size=rg.size, seed=rg.seed)
    seen = {e["question"] for e in train_entries}
    draw = EVAL_DRAW_FACTOR * num_eval + 16
    eval_entries = []
    for entry in generate(rg.datasets, rg.config, size=draw, seed=rg.seed + EVAL_SEED_OFFSET):
        if entry["question"] not in seen:  # neither a training question nor an earlier held-out one
            seen.add(entry["question"])
            eval_entries.append(entry)
    if not eval_entries:
        raise DataError(f"reasoning_gym: all {draw} held-out questions drawn are training questions: the datasets "
                        f"{sorted(rg.datasets)} have too few questions for data.reasoning_gym.size={rg.size}")
    train = _rows(train_entries, "train", tokenize, rg, prompt_template, max_prompt_tokens, limit=rg.size)
    held_out = _rows(eval_entries, "eval", tokenize, rg, prompt_template, max_prompt_tokens, limit=num_eval)
    if len(held_out) < num_eval:
        log.warning("reasoning_gym: %d held-out rows of data.num_eval=%d (%d of %d drawn questions were training or "
                    "repeated ones); the datasets may have too few questions for data.reasoning_gym.size=%d",
                    len(held_out), num_eval, draw - len(eval_entries), draw, rg.size)
    return train, held_out


def _rows(entries: list[dict], split: str, tokenize: Callable[[str], list[int]], rg: Any,
          prompt_template: str | None, max_prompt_tokens: int, *, limit: int) -> list[PromptRow]:
    """``PromptRow`` of ``entries`` in order until ``limit`` are kept; over-long prompts are counted and skipped.

    Raises:
        DataError: no usable row.
    """
    report, rows = LoadReport(), []
    for idx, entry in enumerate(entries):
        if len(rows) == limit:
            break
        name = entry["metadata"]["source_dataset"]
        prompt = prompt_text(entry["question"], rg.answer_format, prompt_template)
        ids = tokenize(prompt)
        if len(ids) > max_prompt_tokens:
            report.skip(f"prompt over data.max_prompt_tokens={max_prompt_tokens}", f"{split} row {idx} ({name})")
            continue
        report.kept += 1
        meta = {"rg_dataset": name, "rg_config": dict(rg.config.get(name, {})), "answer_format": rg.answer_format,
                "rg_entry": {"question": entry["question"], "answer": entry["answer"],
                             "metadata": entry["metadata"]}}
        if split == "train":
            meta["solution"] = demonstration(entry["answer"], rg.answer_format)
        rows.append(PromptRow(uid=f"{split}/{name}/{idx}", prompt=prompt, prompt_token_ids=ids,
                              answer=str(entry["answer"]), verifier=VERIFIER, meta=meta))
    if not rows:
        raise DataError(f"reasoning_gym {split} split: no usable row of {len(entries)} generated "
                        f"(skipped: {report.skipped or 'none'}; datasets {sorted(rg.datasets)})")
    if report.skipped:
        log.warning("reasoning_gym %s split: kept %d rows, skipped %s", split, report.kept, report.skipped)
    return rows
