"""The procedural code task: tiny Python functions from one-line specs, judged by unit tests in the sandbox.

A prompt is a comment stating what ``f`` computes; the response is the function's code, e.g.

    prompt   ``"# f(x) = 3x - 2\\n"``
    response ``"def f(x):\\n    return 3*x-2"``

Four families of specs, each with integer parameters: ``linear`` (``f(x) = a x + b``), ``mod``
(``f(x) = (x + a) mod m``), ``threshold`` (``f(x) = c if x > t else x``, written as an ``if`` block) and
``sum`` (``f(n) = sum of a*i+b for i in 0..n-1``, written as a loop), so responses range from about 25 to
75 characters. Each row carries four ``assert`` tests (``meta["tests"]``) that the ``code`` verifier
(``reward.verifiers.code_verifier``) runs against the response inside the sandbox; the tests probe each
family's classic bug (the boundary ``x == t``, ``n = 0``, operands above the modulus).

Warm-start demonstrations (``meta["solution"]``) are correct except for a share ``demo_slip_rate`` of the
training rows (chosen with the seed), which carry that family's classic bug: a flipped sign (``+2`` for
``-2``), missing parentheses (``x+a%m``), an off-by-one comparison (``>=`` for ``>``) or loop bound
(``range(n+1)``). Imitation learns the bugs; the unit tests' reward (share of tests passed) lets RL unlearn
them. Every character is printable ASCII or ``"\\n"``: the embedded model's character tokenizer
(``cluster.models.tiny_model``) can read and emit all of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from cluster.data.prompts import DataError
from rollout.contracts import PromptRow

FAMILIES = ("linear", "mod", "threshold", "sum")


@dataclass(frozen=True)
class CodeSpec:
    """One task: a family and its integer parameters (``p``: ``(a, b)``, ``(a, m)``, ``(t, c)`` or
    ``(a, b)``, as named in ``spec_text``)."""

    family: str
    p: tuple[int, int]

    @property
    def uid(self) -> str:
        return f"{self.family}/{self.p[0]}/{self.p[1]}"


def all_specs() -> list[CodeSpec]:
    """Every task of the four families, in a fixed order (406 tasks)."""
    specs = [CodeSpec("linear", (a, b)) for a in range(2, 10) for b in range(-9, 10) if b != 0]
    specs += [CodeSpec("mod", (a, m)) for a in range(1, 10) for m in range(2, 10)]
    specs += [CodeSpec("threshold", (t, c)) for t in range(10) for c in range(10)]
    specs += [CodeSpec("sum", (a, b)) for a in range(1, 10) for b in range(10)]
    return specs


def _signed(b: int, spaced: bool) -> str:
    """``b`` as a trailing term: ``" + 3"`` / ``" - 3"`` (spec) or ``"+3"`` / ``"-3"`` (code)."""
    sign = "+" if b >= 0 else "-"
    return f" {sign} {abs(b)}" if spaced else f"{sign}{abs(b)}"


def spec_text(s: CodeSpec) -> str:
    """The one-line spec the prompt states, e.g. ``"f(x) = 3x - 2"``."""
    x, y = s.p
    if s.family == "linear":
        return f"f(x) = {x}x{_signed(y, True)}"
    if s.family == "mod":
        return f"f(x) = (x + {x}) mod {y}"
    if s.family == "threshold":
        return f"f(x) = {y} if x > {x} else x"
    if s.family == "sum":
        return f"f(n) = sum of {x}*i+{y} for i in 0..n-1"
    raise ValueError(f"unknown code task family {s.family!r} (one of {FAMILIES})")


def solution_code(s: CodeSpec, slip: bool = False) -> str:
    """The reference code of ``s``; with ``slip``, the family's classic bug (see the module docstring)."""
    x, y = s.p
    if s.family == "linear":
        return f"def f(x):\n    return {x}*x{_signed(-y if slip and y < 0 else y, False)}"
    if s.family == "mod":
        return f"def f(x):\n    return x+{x}%{y}" if slip else f"def f(x):\n    return (x+{x})%{y}"
    if s.family == "threshold":
        return f"def f(x):\n    if x {'>=' if slip else '>'} {x}:\n        return {y}\n    return x"
    if s.family == "sum":
        bound = "n+1" if slip else "n"
        return f"def f(n):\n    s = 0\n    for i in range({bound}):\n        s += {x}*i+{y}\n    return s"
    raise ValueError(f"unknown code task family {s.family!r} (one of {FAMILIES})")


def reference_value(s: CodeSpec, arg: int) -> int:
    """``f(arg)`` of the spec, computed here (never by running code)."""
    x, y = s.p
    if s.family == "linear":
        return x * arg + y
    if s.family == "mod":
        return (arg + x) % y
    if s.family == "threshold":
        return y if arg > x else arg
    if s.family == "sum":
        return sum(x * i + y for i in range(arg))
    raise ValueError(f"unknown code task family {s.family!r} (one of {FAMILIES})")


def probe_args(s: CodeSpec) -> list[int]:
    """Four arguments per task, chosen so that the family's slip fails at least one: the boundary ``t`` of
    ``threshold``, ``n = 0`` of ``sum``, arguments that make ``x + a`` reach the modulus for ``mod``, a
    negative argument for ``linear``."""
    x, y = s.p
    if s.family == "linear":
        return [0, 1, 4, -3]
    if s.family == "mod":
        return [0, 3, y - x % y + 1, 25]
    if s.family == "threshold":
        return [x - 1, x, x + 1, 20]
    return [0, 1, 4, 7]


def unit_tests(s: CodeSpec) -> list[str]:
    """The row's tests: ``["assert f(4) == 10", ...]`` from ``probe_args`` and ``reference_value``."""
    return [f"assert f({a}) == {reference_value(s, a)}" for a in probe_args(s)]


def code_rows(
    tokenize: Callable[[str], list[int]],
    *,
    num_train: int,
    num_eval: int,
    seed: int,
    demo_slip_rate: float = 0.0,
    max_prompt_tokens: int | None = None,
) -> tuple[list[PromptRow], list[PromptRow]]:
    """The code task's training and held-out rows: ``all_specs()`` shuffled with ``seed``, the first
    ``num_eval`` held out, the next ``num_train`` for training (disjoint by construction; fewer when the
    families run out). Rows use the ``code`` verifier with ``meta["tests"]``; training rows also carry the
    warm start's demonstration in ``meta["solution"]`` (a share ``demo_slip_rate`` with the family's bug,
    chosen with ``seed``); ``answer`` is the correct code.

    Raises:
        DataError: ``num_eval`` leaves no training task (the message names ``data.num_eval``), or a prompt is
            longer than ``max_prompt_tokens`` (``data.max_prompt_tokens``; None = unchecked).
    """
    specs = all_specs()
    random.Random(seed).shuffle(specs)
    if num_eval >= len(specs):
        raise DataError(f"data.num_eval={num_eval} leaves no training prompt: the code task has {len(specs)} tasks")
    slip_rng = random.Random(seed + 1)

    def row(s: CodeSpec, split: str) -> PromptRow:
        prompt = f"# {spec_text(s)}\n"
        ids = tokenize(prompt)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise DataError(f"code task {s.uid}: prompt of {len(ids)} tokens exceeds data.max_prompt_tokens="
                            f"{max_prompt_tokens}")
        slip = split == "train" and slip_rng.random() < demo_slip_rate
        return PromptRow(
            uid=f"{split}/{s.uid}",
            prompt=prompt,
            prompt_token_ids=ids,
            answer=solution_code(s),
            verifier="code",
            meta={"tests": unit_tests(s), "solution": solution_code(s, slip=slip), "family": s.family},
        )

    eval_rows = [row(s, "eval") for s in specs[:num_eval]]
    train_rows = [row(s, "train") for s in specs[num_eval : num_eval + num_train]]
    return train_rows, eval_rows
