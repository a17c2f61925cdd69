"""The calculator agent task (``data.task: agent_calc``): sums of several 2-digit numbers, solved with a tool.

A prompt is ``"23+45+67+12="`` (``data.num_terms`` addends of 10..99); the answer is the sum. A model this small
does not add four numbers with their carries in one pass, but it can copy the expression into a calculator
call and copy the result back: ``<call>calc 23+45+67+12</call>``, the environment replies
``<result>147</result>``, the model answers ``147`` (the ``tag`` tool-call format and the plain reply rendering
of ``rollout.tool_calls`` and ``rollout.chat_delta``; the tool is ``reward.envs.calculator:calc``).

The warm start's demonstrations (``meta["solution_turns"]``: the assistant's turns and the tool's replies) make
a systematic slip in a share ``data.demo_slip_rate`` of the rows: the call leaves out the last addend, so the
answer copied back is wrong. Imitation learns the slip; the exact-match reward of the final answer corrects it.
"""

from __future__ import annotations

import random

from rollout.contracts import PromptRow

TOOL = "calc"


def calc_turns(terms: list[int], slip: bool = False) -> list[list[str]]:
    """The demonstration of one problem: ``[["assistant", call], ["tool", result], ["assistant", answer]]``;
    with ``slip`` the call leaves out the last addend (and the answer is that call's result)."""
    used = terms[:-1] if slip else terms
    expression = "+".join(str(t) for t in used)
    result = str(sum(used))
    return [["assistant", f"<call>{TOOL} {expression}</call>"], ["tool", result], ["assistant", result]]


def agent_calc_rows(tokenize, *, num_terms: int, num_train: int, num_eval: int, seed: int,
                    demo_slip_rate: float = 0.0) -> tuple[list[PromptRow], list[PromptRow]]:
    """``num_eval`` held-out and ``num_train`` training problems of ``num_terms`` addends of 10..99, distinct
    and disjoint (drawn with ``seed``); each training row carries its demonstration (``calc_turns``, a share
    ``demo_slip_rate`` of them with the slip, chosen with ``seed``).

    Raises:
        ValueError: ``num_terms`` < 2.
    """
    if num_terms < 2:
        raise ValueError(f"data.num_terms={num_terms} must be >= 2 (a sum needs two addends)")
    rng, slip_rng = random.Random(seed), random.Random(seed + 1)
    seen: set[tuple[int, ...]] = set()
    problems: list[tuple[int, ...]] = []
    while len(problems) < num_eval + num_train:
        terms = tuple(rng.randint(10, 99) for _ in range(num_terms))
        if terms not in seen:
            seen.add(terms)
            problems.append(terms)

    def row(terms: tuple[int, ...], split: str) -> PromptRow:
        prompt = "+".join(str(t) for t in terms) + "="
        meta = {"expression": prompt[:-1]}
        if split == "train":
            meta["solution_turns"] = calc_turns(list(terms), slip=slip_rng.random() < demo_slip_rate)
        return PromptRow(uid=f"{split}/{prompt[:-1]}", prompt=prompt, prompt_token_ids=tokenize(prompt),
                         answer=str(sum(terms)), verifier="exact", meta=meta)

    return ([row(t, "train") for t in problems[num_eval:]], [row(t, "eval") for t in problems[:num_eval]])
