"""Every built-in verifier on degenerate model output (issue 15, item 2): megabytes of repetition, blank
lines, nested and unclosed braces and boxes, unclosed code fences. Each call must come back (the pytest
timeout is only a hang guard; the time taken against the runner's limit is measured by
``bench/verifier_degenerate.py``, not asserted here) with the score a careful grader would give.
"""

from __future__ import annotations

import pytest

from reward.config import RewardConfig, SandboxConfig
from reward.verifiers import code_verifier, exact_verifier, format_verifier, get_verifier, math_verifier

MB = 1 << 20


ROW = {"uid": "degenerate", "answer": "18", "meta": {"tests": ["assert square(3) == 9"]}}


SOLUTION = "def square(v):\n    return v * v\n"


# name: (response, math, format, exact, code)
DEGENERATE = {
    "repeat-answer": ("The answer is 18. " * (MB // 18), 1.0, 0.0, 0.0, 0.0),
    "repeat-digits": ("18" * (MB // 2), 0.0, 0.0, 0.0, 0.0),
    "blank-lines": ("\n" * MB, 0.0, 0.0, 0.0, 0.0),
    "blank-lines-then-answer": ("\n" * MB + "#### 18", 1.0, 1.0, 1.0, 0.0),
    "spaces-and-newlines": (" \n" * (MB // 2), 0.0, 0.0, 0.0, 0.0),
    "nested-braces": ("{" * (MB // 2) + "}" * (MB // 2), 0.0, 0.0, 0.0, 0.0),
    "open-braces": ("{" * MB, 0.0, 0.0, 0.0, 0.0),
    "open-boxes": ("\\boxed{" * (MB // 7), 0.0, 0.0, 0.0, 0.0),
    "nested-boxes": ("\\boxed{" * (MB // 16) + "18" + "}" * (MB // 16), 0.0, 0.0, 0.0, 0.0),
    "many-boxes": ("".join(f"\\boxed{{{i}}}" for i in range(MB // 12)), 0.0, 0.0, 0.0, 0.0),
    "many-anchors": ("the answer is " * (MB // 14), 0.0, 0.0, 0.0, 0.0),
    "hashes-run": ("#" * MB, 0.0, 0.0, 0.0, 0.0),
    "open-fences": ("```python\n" * (MB // 10), 0.0, 0.0, 0.0, 0.0),
    "long-code": ("```python\n" + "x = 1\n" * (MB // 6) + SOLUTION + "```", 0.0, 0.0, 0.0, 1.0),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(DEGENERATE))
def test_every_verifier_comes_back_with_the_right_score(name):
    response, want_math, want_format, want_exact, want_code = DEGENERATE[name]
    assert math_verifier(response, ROW) == want_math
    assert format_verifier(response, ROW) == want_format
    assert get_verifier("format", RewardConfig())(response, ROW) == want_format  # the config's default pattern
    assert exact_verifier(response, ROW) == want_exact
    cfg = SandboxConfig(backend="plain", wall_s=10.0, cpu_s=5)
    assert code_verifier(response, ROW, sandbox=cfg)["score"] == want_code
