"""The calculator agent task (``data.task: agent_calc``): sums of several 2-digit numbers, solved with a tool.

A prompt is ``"23+45+67+12="`` (``data.num_terms`` addends of 10..99); the answer is the sum. A model this small
does not add four numbers with their carries in one pass, but it can copy the expression into a calculator
call and copy the result back: ``<call>calc 23+45+67+12</call>``, the environment replies
``<result>147</result>``, the model answers ``147`` (the ``tag`` tool-call format and the plain reply rendering
of ``rollout.tool_calls`` and ``rollout.chat_delta``; the tool is ``reward.envs.calculator:calc``).

The warm start's demonstrations (``meta["solution_turns"]``: the assistant's turns and the tool's replies) make
a systematic slip in a share ``data.demo_slip_rate`` of the rows: the call leaves out the last addend, so the
answer copied back is wrong. Imitation learns the slip; the exact-match reward of the final answer corrects it.

For a chat model (``configs/smollm2_agent_calc.yaml``) two options: ``data.prompt_template`` words the prompt
(``"What is {expression}? ..."``, the expression filled in; unset: ``"23+45+67+12="``), and the ``hermes``
tool-call format (``env.tool_format``) writes the demonstrations' call as
``<tool_call>{"name": "calc", "arguments": {"expression": "23+45+67+12"}}</tool_call>``.
"""

from __future__ import annotations

import json
import random

from rollout.contracts import PromptRow

TOOL = "calc"
ARGUMENT = "expression"  # the parameter of reward.envs.calculator:calc
CALL_FORMATS = ("tag", "hermes")


def calc_turns(terms: list[int], slip: bool = False, tool_format: str = "tag") -> list[list[str]]:
    """The demonstration of one problem: ``[["assistant", call], ["tool", result], ["assistant", answer]]``;
    with ``slip`` the call leaves out the last addend (and the answer is that call's result). The call is written
    in ``tool_format``: ``tag`` (``<call>calc 12+34</call>``) or ``hermes`` (``<tool_call>{"name": "calc",
    "arguments": {"expression": "12+34"}}</tool_call>``).

    Raises:
        ValueError: another ``tool_format``.
    """
    if tool_format not in CALL_FORMATS:
        raise ValueError(f"agent_calc writes its demonstrations' calls in {CALL_FORMATS}, not {tool_format!r}")
    used = terms[:-1] if slip else terms
    expression = "+".join(str(t) for t in used)
    result = str(sum(used))
    if tool_format == "hermes":
        call = f"<tool_call>{json.dumps({'name': TOOL, 'arguments': {ARGUMENT: expression}})}</tool_call>"
    else:
        call = f"<call>{TOOL} {expression}</call>"
    return [["assistant", call], ["tool", result], ["assistant", result]]


def calc_prompt(expression: str, prompt_template: str | None = None) -> str:
    """A problem's prompt: ``"23+45+67+12="``, or ``prompt_template`` with ``{expression}`` filled in.

    Raises:
        ValueError: the template names another field.
    """
    if prompt_template is None:
        return expression + "="
    try:
        return prompt_template.format(expression=expression)
    except (KeyError, IndexError) as e:
        raise ValueError(f"data.prompt_template={prompt_template!r}: agent_calc fills in only {{expression}} "
                         f"(got {e})") from None


def agent_calc_rows(tokenize, *, num_terms: int, num_train: int, num_eval: int, seed: int,
                    demo_slip_rate: float = 0.0, prompt_template: str | None = None,
                    tool_format: str = "tag") -> tuple[list[PromptRow], list[PromptRow]]:
    """``num_eval`` held-out and ``num_train`` training problems of ``num_terms`` addends of 10..99, distinct
    and disjoint (drawn with ``seed``); each training row carries its demonstration (``calc_turns`` in
    ``tool_format``, a share ``demo_slip_rate`` of them with the slip, chosen with ``seed``). The prompt is
    ``calc_prompt(expression, prompt_template)``; the uid and ``meta["expression"]`` are the expression's.

    Raises:
        ValueError: ``num_terms`` < 2, a ``prompt_template`` with another field than ``{expression}``, a
            ``tool_format`` other than ``tag`` and ``hermes``.
    """
    if num_terms < 2:
        raise ValueError(f"data.num_terms={num_terms} must be >= 2 (a sum needs two addends)")
    calc_prompt("1+2", prompt_template)  # a bad template fails before any row is drawn
    calc_turns([1, 2], tool_format=tool_format)
    rng, slip_rng = random.Random(seed), random.Random(seed + 1)
    seen: set[tuple[int, ...]] = set()
    problems: list[tuple[int, ...]] = []
    while len(problems) < num_eval + num_train:
        terms = tuple(rng.randint(10, 99) for _ in range(num_terms))
        if terms not in seen:
            seen.add(terms)
            problems.append(terms)

    def row(terms: tuple[int, ...], split: str) -> PromptRow:
        expression = "+".join(str(t) for t in terms)
        prompt = calc_prompt(expression, prompt_template)
        meta = {"expression": expression}
        if split == "train":
            meta["solution_turns"] = calc_turns(list(terms), slip=slip_rng.random() < demo_slip_rate,
                                                tool_format=tool_format)
        return PromptRow(uid=f"{split}/{expression}", prompt=prompt, prompt_token_ids=tokenize(prompt),
                         answer=str(sum(terms)), verifier="exact", meta=meta)

    return ([row(t, "train") for t in problems[num_eval:]], [row(t, "eval") for t in problems[:num_eval]])
