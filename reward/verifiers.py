"""Verifiers: plain functions ``(response: str, row: dict) -> float | dict`` and a registry by name.

A verifier returns a float score, or a dict with a ``score`` (float) and any extra fields (an optional
``correct`` bool among them). ``row`` is a ``PromptRow`` as a dict (``uid``, ``prompt``, ``answer``,
``verifier``, ``meta``, ...); a ``PromptRow`` itself is accepted too.

Verifiers trust nothing in ``response``, but they are not themselves protected: the worker always calls them
through ``reward.runner`` (a killed process group with a wall-clock timeout), never directly.

Built-ins:
    ``exact``   normalised string equality (procedural tasks).
    ``math``    final-answer extraction + math-verify equivalence (GSM8K and similar).
    ``code``    the response's Python code against the row's tests; the code runs inside ``reward.sandbox``,
                the verdict is reached outside it.
    ``format``  1.0 when the response matches a regex (config ``reward.format_regex``), else 0.0.
User verifiers are named ``"module.path:function"``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from typing import Any, Callable

Verifier = Callable[[str, dict], "float | dict"]

_WS = re.compile(r"\s+")
_ANSWER_IS = re.compile(r"the\s+(?:final\s+)?answer\s+is\s*:?\s*(.+)", re.IGNORECASE)
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


def after_hashes(text: str) -> str:
    """The text after the last ``####`` marker (up to the end of that line), or ``text`` when there is none."""
    if "####" not in text:
        return text
    tail = text.rsplit("####", 1)[1]
    return tail.strip().split("\n", 1)[0]


def exact_verifier(response: str, row: dict) -> float:
    """1.0 when the final answer equals the reference after normalisation, else 0.0.

    The final answer is the text after the last ``####`` line if there is one, else the whole response; both
    sides are stripped and have whitespace runs collapsed (the reference also loses a ``####`` prefix).
    """
    row = as_row_dict(row)
    got = normalise(after_hashes(response))
    want = normalise(after_hashes(str(row["answer"])))
    return 1.0 if got == want and want != "" else 0.0


def extract_final_answer(response: str) -> str | None:
    """The final-answer text of a worked solution, or None when no answer can be found.

    Order: the text after the last ``####``; else the whole response when it contains ``\\boxed`` (math-verify
    picks the box); else what follows the last "the answer is"; else the last non-empty line.
    """
    if "####" in response:
        return after_hashes(response)
    if "\\boxed" in response or "\\fbox" in response:
        return response
    hits = _ANSWER_IS.findall(response)
    if hits:
        return hits[-1].strip()
    lines = [ln for ln in response.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


def math_verifier(response: str, row: dict) -> float:
    """1.0 when the response's final answer is mathematically equal to the reference (math-verify), else 0.0.

    The reference is ``row["answer"]``; for raw GSM8K answers (worked solutions) the text after ``####`` is
    used. Numbers, fractions and LaTeX forms compare by value: ``18``, ``18.0``, ``$18``, ``\\frac{36}{2}``
    are all right for 18. math-verify's own signal-based timeouts are off: the runner enforces the limit.
    """
    from math_verify import parse, verify

    row = as_row_dict(row)
    gold_text = after_hashes(str(row["answer"])).replace(",", "")
    pred_text = extract_final_answer(response)
    if pred_text is None or not gold_text.strip():
        return 0.0
    gold = parse(gold_text, parsing_timeout=None)
    pred = parse(pred_text, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def format_verifier(response: str, row: dict, *, pattern: str = r"(?m)^\s*####\s*\S+") -> float:
    """1.0 when ``pattern`` (or ``row["meta"]["format_regex"]``) is found in the response, else 0.0."""
    row = as_row_dict(row)
    pat = (row.get("meta") or {}).get("format_regex", pattern)
    return 1.0 if re.search(pat, response) else 0.0


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
        "plain", "stderr": a short tail of the solution's output, ...}``.

    Raises:
        ValueError: the row has no ``meta.tests`` list, or a test is neither a string nor an input/output dict.
        reward.sandbox.SandboxUnavailable: bubblewrap is required but missing.
    """
    from reward.config import SandboxConfig
    from reward.judge import run_python_tests

    row = as_row_dict(row)
    tests = (row.get("meta") or {}).get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code row {row.get('uid')!r}: meta.tests must be a non-empty list, got {tests!r}")
    cfg = sandbox if sandbox is not None else SandboxConfig()
    passed, total, info = run_python_tests(extract_code(response), tests, cfg)
    score = float(passed == total) if all_or_nothing else passed / total
    return {"score": score, "correct": passed == total, "passed": passed, "total": total, **info}


BUILTINS: dict[str, Verifier] = {
    "exact": exact_verifier,
    "math": math_verifier,
    "format": format_verifier,
    "code": code_verifier,
}


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
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"verifier {name!r}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"verifier {name!r}: {module_name!r} has no callable {attr!r}")
    return fn
