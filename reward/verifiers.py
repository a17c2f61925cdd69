"""Verifiers: plain functions ``(response: str, row: dict) -> float | dict`` and a registry by name.

A verifier returns a float score, or a dict with a ``score`` (float) and any extra fields (an optional
``correct`` bool among them). ``row`` is a ``PromptRow`` as a dict (``uid``, ``prompt``, ``answer``,
``verifier``, ``meta``, ...); a ``PromptRow`` itself is accepted too.

Verifiers trust nothing in ``response``, but they are not themselves protected: the worker calls them through
``reward.runner`` (a killed process group with a wall-clock timeout), except the built-ins that
``reward.inline_verifiers`` names (only ``exact``: a few linear passes over the string), which it calls directly.

Built-ins:
    ``exact``   normalised string equality (procedural tasks).
    ``math``    final-answer extraction + math-verify equivalence (GSM8K and similar).
    ``code``    the response's Python code against the row's tests; the code runs inside ``reward.sandbox``,
                the verdict is reached outside it.
    ``format``  1.0 when the response matches a regex (config ``reward.format_regex``) and the answer it
                marks parses as one answer (``reward.answers.is_answer``), else 0.0.
User verifiers are named ``"module.path:function"``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from typing import Any, Callable

from reward.answers import (
    MAX_CANDIDATES,
    after_hashes,
    answer_spans,
    candidates,
    is_answer,
    is_collection,
    parse_boxed,
    parse_candidate,
    parse_reference,
    too_large,
)

Verifier = Callable[[str, dict], "float | dict"]

# The config's default ``reward.format_regex`` (kept equal by tests/unit/reward/test_verifiers.py): the answer on the
# marker's line, line-bounded (``[ \t]*``, not ``\s*``, which runs across blank lines and backtracks
# quadratically on them).
DEFAULT_FORMAT_REGEX = r"(?m)^[ \t]*####[ \t]*(?P<answer>\S[^\n]*)"

_WS = re.compile(r"\s+")
_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9_-]{0,30}>")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def as_row_dict(row: Any) -> dict:
    """``row`` as a plain dict (a ``PromptRow`` dataclass is converted; a dict is returned as is).

    Raises:
        TypeError: ``row`` is neither a dict nor a dataclass instance.
    """
    if isinstance(row, dict):
        return row
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return dataclasses.asdict(row)
    raise TypeError(f"row must be a dict or a PromptRow, got {type(row).__name__}")


def normalise(text: str) -> str:
    """Strip and collapse runs of whitespace into one space."""
    return _WS.sub(" ", text).strip()


def exact_verifier(response: str, row: dict) -> float:
    """1.0 when the final answer equals the reference after normalisation, else 0.0.

    The final answer is the text after the last ``####`` line if there is one, else the whole response; both
    sides are stripped and have whitespace runs collapsed (the reference also loses a ``####`` prefix).

    Raises:
        ValueError: the row has no ``answer``.
    """
    row = as_row_dict(row)
    got = normalise(after_hashes(response))
    want = normalise(after_hashes(str(_reference(row, "exact"))))
    return 1.0 if got == want and want != "" else 0.0


def _reference(row: dict, verifier: str) -> Any:
    ref = row.get("answer")
    if ref is None or isinstance(ref, bool) or not isinstance(ref, (str, int, float)):
        raise ValueError(f"{verifier} row {row.get('uid')!r}: answer must be a string or a number, got {ref!r}"[:300])
    return ref


def extract_final_answer(response: str) -> str | None:
    """The final-answer text of a worked solution, or None when there is none: the line after the last
    ``####``; else the last ``\boxed{}`` content; else what follows the last "answer is" / "answer:" up to
    the end of its sentence; else the last sentence of the last non-empty line (``reward.answers``)."""
    _, spans = answer_spans(response)
    return spans[-1].strip() if spans else None


def math_verifier(response: str, row: dict) -> float:
    """1.0 when the response's final answer is mathematically equal to the reference (math-verify), else 0.0.

    The reference is ``row["answer"]`` (for a raw GSM8K worked solution, the text after ``####``), parsed by
    ``reward.answers.parse_reference``: ``1,234`` is a number, ``3,5,7`` a set, ``(0,1)`` an interval,
    ``2\\pi`` and ``\\sqrt{2}`` LaTeX. The response's candidate answers come from
    ``reward.answers.candidates`` (``####`` line, boxes, "answer is", last sentence; remarks and explanations
    dropped); it scores 1.0 only when there is at least one and every one verifies against the reference, so
    a hedge like "17 or 18" scores 0. Numbers, fractions and LaTeX forms compare by value (``18``, ``18.0``,
    ``$18``, ``\\frac{36}{2}``, ``18 apples`` are right for 18). math-verify's own signal-based timeouts are
    off: the runner enforces the limit; every step is bounded in the response's length (see
    ``reward.answers``).

    Raises:
        ValueError: the row has no string or number ``answer``, or the reference does not parse as math
            (the message names the row and the reference).
    """
    from math_verify import verify

    row = as_row_dict(row)
    ref = str(_reference(row, "math"))
    gold = parse_reference(ref)
    if all(isinstance(g, str) for g in gold):  # nothing but math-verify's string fallback
        raise ValueError(f"math row {row.get('uid')!r}: reference answer {ref[:100]!r} does not parse as math")
    several = is_collection(gold)
    how, found = candidates(response, several)
    if not found or len(found) > MAX_CANDIDATES:
        return 0.0
    for text in found:
        forms = parse_boxed(text) if how == "boxed" else parse_candidate(text, several)
        forms = [f for f in forms if not too_large(f)]
        if not forms or not verify(gold, forms, timeout_seconds=None):
            return 0.0
    return 1.0


def format_verifier(response: str, row: dict, *, pattern: str = DEFAULT_FORMAT_REGEX) -> float:
    """1.0 when ``pattern`` (or ``row["meta"]["format_regex"]``) is found in the response and the answer it
    marks parses as an answer (``reward.answers.is_answer``: one value that math-verify parses, not a hedge
    and not junk like ``#### ?``), else 0.0.

    The marked answer of the last match is its group ``answer`` if the pattern names one, else its first
    group if it has groups, else the match without XML-like tags (``<answer>3</answer>`` marks ``3``) and
    without what precedes a ``####`` in it. A pure format term (any text counts) is not offered: a format
    reward that pays for ``#### ?`` teaches the policy to emit markers, not answers.

    Raises:
        ValueError: the pattern is not a valid regular expression (the message names it).
    """
    row = as_row_dict(row)
    pat = (row.get("meta") or {}).get("format_regex", pattern)
    try:
        rx = _compiled(pat)
    except (re.error, TypeError) as err:
        raise ValueError(f"format regex {pat!r} is not a valid regular expression: {err}") from None
    last = None
    for last in rx.finditer(response):
        pass
    if last is None:
        return 0.0
    if "answer" in rx.groupindex:
        marked = last.group("answer")
    elif rx.groups:
        marked = last.group(1)
    else:
        marked = _TAG.sub(" ", last.group())
        if "####" in marked:
            marked = marked.rsplit("####", 1)[1]
    return 1.0 if marked is not None and is_answer(marked) else 0.0


@functools.lru_cache(maxsize=32)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def extract_code(response: str) -> str:
    """The Python code of a response: the last fenced block tagged python/py (else the last fenced block),
    or the whole response when it has no fences."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return response
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (py or [body for _, body in blocks])[-1]


def code_verifier(response: str, row: dict, *, sandbox: Any = None, all_or_nothing: bool = False) -> dict:
    """Run the response's code against ``row["meta"]["tests"]`` inside the sandbox.

    Tests are either Python snippets (``"assert f(2) == 4"``), run here against the solution's functions,
    which run in the sandbox and answer with plain data only (``reward.judge.run_python_tests``; the
    solution cannot forge a verdict: see ``reward/README.md``), or ``{"input": str, "output": str}`` pairs,
    each a separate run fed ``input`` on stdin and judged by comparing stripped stdout in this process.

    Returns:
        ``{"score": passed/total (or 1/0 with all_or_nothing), "correct": all passed, "passed": int,
        "total": int, "sandbox": status of the first run that ended badly (else "ok"), "backend": "bwrap" |
        "plain", "stderr": a short tail of the solution's output, "runs": the sandbox run ids, ...}``.

    Raises:
        ValueError: the row has no ``meta.tests`` list, or a test is neither a string nor an input/output dict.
        reward.sandbox.SandboxUnavailable: bubblewrap is required but missing.
        reward.infra.InfraFailure: ``sandbox_start``: a sandbox run could not start (the reward worker makes the
            sample invalid, ``reward.on_infra_failure``); the code's own failures are failed tests.
    """
    from reward.config import SandboxConfig
    from reward.judge import run_python_tests

    row = as_row_dict(row)
    tests = (row.get("meta") or {}).get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code row {row.get('uid')!r}: meta.tests must be a non-empty list, got {tests!r}")
    cfg = sandbox if sandbox is not None else SandboxConfig()
    passed, total, info = run_python_tests(extract_code(response), tests, cfg)
    if info.get("sandbox") == "error":  # a run that could not start: no verdict on this code, not a failed test
        from reward.infra import Cause, InfraFailure

        raise InfraFailure(Cause.SANDBOX_START, f"the sandbox could not start a run of the code ({passed} of "
                           f"{total} tests had passed; runs {info.get('runs')})")
    score = float(passed == total) if all_or_nothing else passed / total
    return {"score": score, "correct": passed == total, "passed": passed, "total": total, **info}


BUILTINS: dict[str, Verifier] = {
    "exact": exact_verifier,
    "math": math_verifier,
    "format": format_verifier,
    "code": code_verifier,
}


def import_user_module(name: str, what: str) -> tuple[Any, str]:
    """The module of a user's ``"module.path:attr"`` (imported where ``python -m`` looks: ``sys.path``) and the
    attribute's name; the caller checks the attribute (a verifier, an environment class, a tool).

    Args:
        name: ``"module.path:attr"``.
        what: how messages name it (``"verifier 'm:f'"``, ``"env.cls='m:C'"``).

    Raises:
        ValueError: ``name`` is not of that form, or its module cannot be imported; the message starts with ``what``.
    """
    module_name, _, attr = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"{what} must be 'module.path:name'")
    try:
        return importlib.import_module(module_name), attr
    except ImportError as err:
        raise ValueError(f"{what}: cannot import module {module_name!r} ({err})") from None


def get_verifier(name: str, cfg: Any = None) -> Verifier:
    """The verifier called ``name``, with its options bound from ``cfg`` (a ``RewardConfig``, optional).

    ``name`` is a built-in (``exact``, ``math``, ``code``, ``format``) or ``"module.path:function"``. The
    returned callable is picklable (a module-level function or a ``functools.partial`` of one).

    Raises:
        ValueError: unknown built-in name, or a ``module:function`` that cannot be imported or is not callable
            (the message names the verifier).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"verifier name must be a non-empty string, got {name!r}")
    if name in BUILTINS:
        fn = BUILTINS[name]
        if cfg is not None and name == "format":
            return functools.partial(format_verifier, pattern=cfg.format_regex)
        if cfg is not None and name == "code":
            return functools.partial(code_verifier, sandbox=cfg.sandbox, all_or_nothing=cfg.code_all_or_nothing)
        return fn
    if ":" not in name:
        raise ValueError(f"unknown verifier {name!r}: use one of {sorted(BUILTINS)} or 'module.path:function'")
    module, attr = import_user_module(name, f"verifier {name!r}")
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"verifier {name!r}: {module.__name__!r} has no callable {attr!r}")
    return fn
