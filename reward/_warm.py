"""Imported into the verifier fork server: runs math-verify once so that every forked child inherits warm
caches (lazy grammar set-up, compiled regexes, sympy caches) instead of paying for them per call."""

import logging

from reward.verifiers import math_verifier

for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)  # the runner, not math-verify, enforces timeouts

# plain-number references (GSM8K) and a LaTeX one, answered right and wrong: a LaTeX reference is parsed with
# LatexExtractionConfig, whose regexes are compiled on first use, and a wrong symbolic answer takes sympy's
# slower comparison path; measured in a forked child without these two: 50-70 ms for a right LaTeX answer
# and 200-400 ms for a wrong one, paid again by every child
for _resp, _ans in (("#### 18", "18"), ("The answer is $\\frac{36}{2}$", "18"), ("\\boxed{18.0}", "#### 18"),
                    ("\\boxed{2\\pi}", "2\\pi"), ("\\boxed{3\\pi}", "2\\pi")):
    math_verifier(_resp, {"answer": _ans, "meta": {}})

# probe bubblewrap once here, so that code-verifier calls inherit the cached answer
from reward.config import SandboxConfig  # noqa: E402
from reward.sandbox import bwrap_available, sandbox_python  # noqa: E402

bwrap_available(sandbox_python(SandboxConfig()))
