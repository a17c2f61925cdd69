"""Final answers of math responses: where the answer is, which candidates it states, and their parsed forms.

Used by the ``math`` verifier (is the answer equal to the reference?) and the ``format`` verifier (does the
marked answer parse as an answer?). Parsing and equivalence are math-verify's (``parse`` with the extraction
config its documentation gives for the kind of text: ``LatexExtractionConfig`` for LaTeX, with a bare LaTeX
reference wrapped in ``$...$``, ``ExprExtractionConfig`` for plain numbers and expressions; ``verify`` with
the reference first). This module only decides which text is the answer:

- the response's answer is, in order: the line after its last ``####``; else its ``\\boxed{}``/``\\fbox{}``
  contents (every box: several different boxed answers are a hedge); else what follows its last "answer is"
  / "answer:" up to the end of that sentence; else its last sentence (then, as math-verify does, the last
  number or expression in it counts);
- in that text, parenthetical remarks with words (``(since 3+15)``) are dropped, and so, after ``####`` or an
  anchor, are explanations after a connective (``, since ...``, ``because ...``);
- candidates joined by "or" (also ``\\lor``, ``\\vee``, ``\\text{or}``, in a box too, and in a parenthetical
  remark: ``18 (or 17)``) are a hedge, and so, for a single-valued reference, are candidates joined by commas,
  "and" or semicolons after an anchor, and two or more numbers that end the answer with only separators
  between them (``17 18``, ``17, 18``, ``between 17 and 18``, ``x = 17, x = 18``; after an anchor also
  ``17 to 18``); a hedged answer is right only if every candidate is;
- LaTeX escapes read as what they stand for: ``\\$18`` is 18, ``1\\,234`` is 1234, ``\\text{dollars}`` is a word;
- commas in a reference are thousands separators only in the ``1,234,567`` pattern; otherwise they separate
  list members (``3,5,7`` is a set of three numbers, ``(0,1)`` an interval or pair).

Bounds (degenerate output): only the last ``####`` line and spans of at most ``MAX_ANSWER_CHARS`` are parsed,
at most ``MAX_CANDIDATES`` distinct candidates, and a candidate whose value is astronomically large
(``10^{10^{10}}``, where sympy would not finish) is not compared. Scanning a response is linear in its length.
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from typing import Any

MAX_ANSWER_CHARS = 400  # a final-answer span or box longer than this is not an answer
MAX_CANDIDATES = 8  # more distinct candidates than this: not one answer
MAX_MAGNITUDE = 1e6  # largest exponent / factorial argument of a candidate that is compared

_BOX_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|\\[{}]|[{}]")
_ANCHOR = re.compile(r"(?i)\banswer\s*(?:is\b|:|=)\s*:?")
_SENTENCE_END = re.compile(r"[.!?;](?=\s|$)|\n")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_PAREN = re.compile(r"\([^()]*\)")
_EXPLANATION = re.compile(
    r"(?i)(?:[,:;]\s*|\s+)(?:since|because|as|which|so|given|from|by|after|using|with|where|when|that|this|"
    r"not|i\.e\.|e\.g\.)\b.*$", re.DOTALL)
_HEDGE = re.compile(r"(?i)\s*(?:\b(?:and/or|or|either)\b|\\(?:lor|vee)(?![A-Za-z])|\\(?:text|textrm|mathrm|mbox)"
                    r"\s*\{\s*(?:or|either)\s*\})\s*")
_NUMBER = re.compile(r"(?<![\w.^/])-?\$?\d+(?:,\d{3})*(?:\.\d+)?%?(?![\w^/])")
# what may stand between two candidate numbers of a hedge: "17 18", "17, 18", "17 | 18", "x = 17, x = 18"; and,
# right after an anchor (where the answer comes first), a range "17 to 18"
_GAP = r"(?i)\s*(?:[,;|]\s*)?(?:\b(?:and|or|maybe|perhaps{})\b)?\s*(?:(?P<var>[a-z])\s*=\s*)?"
_NUMBER_GAP = {False: re.compile(_GAP.format("")), True: re.compile(_GAP.format("|to"))}
_TEXT_WRAP = re.compile(r"\\(?:text|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_LATEX_SPACE = re.compile(r"\\[,!;: ]|[\u2009\u202f]")
_LIST = re.compile(r"(?i)\s*(?:,(?=\s)|;|\band\b)\s*")
_THOUSANDS = re.compile(r"-?\$?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?")
_PLAIN_NUMBER = re.compile(r"-?\$?\d+(?:\.\d+)?\s*%?")
_LATEXY = re.compile(r"[\\^_{}]")
_DIGIT = re.compile(r"\d")

logging.getLogger("math_verify").setLevel(logging.ERROR)  # the runner, not math-verify, enforces timeouts


@lru_cache(maxsize=1)
def _configs() -> tuple[list, list, list]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    latex = [LatexExtractionConfig()]
    return latex, [ExprExtractionConfig()], [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _parse(text: str, config: list) -> list:
    from math_verify import parse

    return parse(text, config, parsing_timeout=None)


def _clean(text: str) -> str:
    """``text`` with Unicode minus and no-break spaces made plain, LaTeX-escaped currency (``\\$18``) read as
    its number, and LaTeX spaces (``\\,``, thin spaces) dropped between a digit and three digits (``1\\,234``)
    and made plain spaces elsewhere."""
    text = text.replace("\u2212", "-").replace("\u00a0", " ").replace("\\$", "")
    text = re.sub(r"(?<=\d)(?:\\[,!;: ]|[\u2009\u202f])(?=\d{3}(?!\d))", "", text)
    return _LATEX_SPACE.sub(" ", text).strip()


def parse_reference(answer: str) -> list:
    """math-verify's parse of a reference answer (``row["answer"]``; a worked GSM8K solution gives the text
    after its ``####``). A reference in a LaTeX environment is parsed as math-verify's README shows; a plain
    number (thousands separators in the ``1,234`` pattern dropped) with ``ExprExtractionConfig``; anything
    else (``2\\pi``, ``\\sqrt{2}``, ``3,5,7``, ``(0,1)``, ``x^2``) as LaTeX, wrapped in ``$...$``, falling back
    to ``ExprExtractionConfig``. Returns ``[]`` when nothing parses.
    """
    latex, expr, _ = _configs()
    text = _clean(after_hashes(answer))
    if not text:
        return []
    if any(m in text for m in ("$", "\\(", "\\[", "\\boxed")):
        return _parse(text, latex + expr)
    if _THOUSANDS.fullmatch(text):
        return _parse(text.replace(",", ""), expr)
    if _PLAIN_NUMBER.fullmatch(text):
        return _parse(text, expr)
    return _parse(f"${text}$", latex) or _parse(text, expr)


def after_hashes(text: str) -> str:
    """The text after the last ``####`` marker (up to the end of that line), or ``text`` when there is none."""
    if "####" not in text:
        return text
    tail = text.rsplit("####", 1)[1].lstrip()
    return tail.split("\n", 1)[0].strip()


def is_collection(parsed: list) -> bool:
    """Whether a parsed reference is several values (a set, tuple, interval or list), not one."""
    import sympy

    return any(isinstance(p, (sympy.Set, sympy.Tuple, list, tuple)) for p in parsed if not isinstance(p, str))


def boxed_contents(text: str) -> list[str] | None:
    """The contents of every closed ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (nested boxes included, in
    order of their end; a content longer than ``MAX_ANSWER_CHARS`` is cut to one character more), or None
    when there is none. One pass over the braces; escaped braces ``\\{ \\}`` are content."""
    start = min((i for i in (text.find("\\boxed"), text.find("\\fbox")) if i >= 0), default=-1)
    if start < 0:
        return None
    stack: list[int] = []  # content start of an open box, or -1 for a plain brace
    found = []
    for m in _BOX_TOKENS.finditer(text, start):
        tok = m.group()
        if tok[0] == "\\" and len(tok) == 2:
            continue  # \{ or \}
        if tok == "}":
            if stack:
                opened = stack.pop()
                if opened >= 0:  # cut one past the limit (no answer anyway): nested boxes stay linear
                    found.append(text[opened:min(m.start(), opened + MAX_ANSWER_CHARS + 1)])
        elif tok == "{":
            stack.append(-1)
        else:
            stack.append(m.end())
    return found or None


def answer_spans(response: str) -> tuple[str, list[str]]:
    """``(how, spans)``: where the final answer was found (``"hashes"``, ``"boxed"``, ``"anchor"``, ``"last"``
    or ``"none"``) and its text: one span, or one per box. Spans are not yet split into candidates."""
    if "####" in response:
        return "hashes", [after_hashes(response)]
    boxes = boxed_contents(response)
    if boxes is not None:
        return "boxed", boxes
    anchors = list(_ANCHOR.finditer(response))
    if anchors:
        tail = response[anchors[-1].end():anchors[-1].end() + 4 * MAX_ANSWER_CHARS]
        end = _SENTENCE_END.search(tail)
        return "anchor", [tail[:end.start()] if end else tail]
    text = response.rstrip()
    line = text[text.rfind("\n") + 1:].strip()
    if not line:
        return "none", []
    sentences = [s for s in _SENTENCE_END.split(line[-4 * MAX_ANSWER_CHARS:]) if s.strip()]
    return ("last", [sentences[-1]]) if sentences else ("none", [])


def _drop_remarks(span: str, anchored: bool) -> str:
    """``span`` without parenthetical remarks that hold words and, after an anchor (where the answer comes
    first), without a trailing explanation (``, since ...``)."""
    def keep(m: re.Match) -> str:  # a remark that offers another number ("(or 17)") is a hedge: kept
        hedge = _HEDGE.search(m.group()) and _DIGIT.search(m.group())
        return m.group() if hedge or not _WORD.search(m.group()) else ""

    span = _PAREN.sub(keep, span)
    return (_EXPLANATION.sub("", span) if anchored else span).strip()


def candidates(response: str, several: bool = False) -> tuple[str, list[str]]:
    """``(how, texts)``: the candidate answers a response states (see the module docstring). ``several``:
    the reference is a collection, so commas and "and" join members of one answer instead of candidates.
    An empty list means no answer; a text too long to be an answer is kept (it will not parse)."""
    how, spans = answer_spans(response)
    out: list[str] = []
    for span in spans:
        span = _clean(span)
        if how == "boxed":
            out += [p.strip() for p in _HEDGE.split(span)] if _HEDGE.search(span) else [span]
            continue
        anchored = how in ("hashes", "anchor")
        span = _drop_remarks(_TEXT_WRAP.sub(r" \1 ", span), anchored)
        parts = _HEDGE.split(span)
        if anchored and not several:
            parts = [q for p in parts for q in _LIST.split(p)]
        if not several:
            parts = [q for p in parts for q in trailing_numbers(p, anchored)]
        out += [p.strip() for p in parts if _DIGIT.search(p) or _LATEXY.search(p)]
    distinct = list(dict.fromkeys(out))
    return how, distinct


def trailing_numbers(text: str, anchored: bool = False) -> list[str]:
    """``[text]``, or, when ``text`` ends in two or more numbers with only separators between them (spaces,
    commas, semicolons, ``|``, "and", "maybe", the same ``x =`` again: ``"It is 17 18"``, ``"x = 17, x =
    18"``; ``anchored``: also "17 to 18"), those numbers: the candidates of a hedge. Numbers joined by an
    operator or other words (``3 + 15 = 18``, ``15, so 18``, "from 3 to 18" in a last sentence) are working,
    not a hedge: then only ``text`` is returned. Linear in ``len(text)``."""
    tail = text[-MAX_ANSWER_CHARS:]
    nums = list(_NUMBER.finditer(tail))
    if len(nums) < 2 or _DIGIT.search(tail, nums[-1].end()):
        return [text]
    run = [nums[-1]]
    for prev in reversed(nums[:-1]):
        gap = tail[prev.end():run[-1].start()]
        m = _NUMBER_GAP[anchored].fullmatch(gap) if gap and len(gap) <= 40 else None
        if m is None or (m["var"] and not re.search(rf"\b{m['var']}\s*=\s*$", tail[:prev.start()])):
            break  # "x = 3, y = 4" states two variables, not two candidates for one
        run.append(prev)
    return [m.group() for m in reversed(run)] if len(run) > 1 else [text]


def parse_candidate(text: str, several: bool = False) -> list:
    """math-verify's parse of one candidate answer: text in a LaTeX environment or ``\\boxed`` with
    ``LatexExtractionConfig(boxed_match_priority=0)`` then ``ExprExtractionConfig``; bare LaTeX wrapped in
    ``$...$``; plain text with ``ExprExtractionConfig`` (and as LaTeX too when it has digits: ``(0,1)``,
    ``3, 5, 7``; first for a collection reference). ``[]`` when it is too long or nothing parses."""
    latex, expr, anywhere = _configs()
    text = text.strip().rstrip(".").strip()
    if not text or len(text) > MAX_ANSWER_CHARS:
        return []
    if any(m in text for m in ("$", "\\(", "\\[")):
        return _parse(text, anywhere)
    if _LATEXY.search(text):
        return _parse(f"${text}$", latex)
    as_latex = _parse(f"${text}$", latex) if several or not _WORD.search(text) else []
    as_expr = _parse(text, expr)
    return (as_latex + as_expr) if several else (as_expr + as_latex)


def parse_boxed(content: str) -> list:
    """math-verify's parse of one box's content (``\\boxed{content}``, boxed match first); ``[]`` when it is
    too long or does not parse."""
    if not content.strip() or len(content) > MAX_ANSWER_CHARS:
        return []
    return _parse("\\boxed{" + content + "}", _configs()[2])


def too_large(expr: Any) -> bool:
    """Whether a parsed value holds a power or factorial too large to evaluate (exponent or argument over
    ``MAX_MAGNITUDE``, as far as a 5-digit estimate tells): sympy would not finish comparing it."""
    import sympy

    if isinstance(expr, str) or not isinstance(expr, sympy.Basic):
        return False
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow):
            size = node.exp
        elif isinstance(node, sympy.factorial):
            size = node.args[0]
        else:
            continue
        if not size.is_number:
            continue
        try:
            if abs(complex(size.evalf(5))) > MAX_MAGNITUDE:
                return True
        except (TypeError, ValueError, OverflowError):
            return True
    return False


def is_answer(text: str) -> bool:
    """Whether ``text`` (a marked answer, e.g. after ``####``) states one answer that math-verify parses to a
    value: not empty, not a hedge, not junk like ``?``."""
    how, found = candidates(f"#### {_clean(text)}", several=True)
    if len(found) != 1 or _HEDGE.search(found[0]):
        return False
    return any(not isinstance(p, str) for p in parse_candidate(found[0], several=True))
