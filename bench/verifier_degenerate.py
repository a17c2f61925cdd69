"""Verifiers on degenerate model output: how long each takes against the runner's timeout.

    python bench/verifier_degenerate.py [--mb M] [--timeout S] [--checkout DIR]

Runs the ``math``, ``format``, ``exact`` and ``code`` verifiers on responses of about M MiB (default 1) of
repetition, blank lines, nested and unclosed braces and boxes, unclosed code fences, through the protected
runner exactly as the reward worker does (``ProtectedRunner`` with timeout S, default the config's 5 s;
one call per child process), and prints each call's status, seconds and share of the timeout. Exits
non-zero when a call times out. ``--checkout`` imports ``reward`` from another checkout (to compare code
versions; a verifier that hangs there shows as ``timeout``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def inputs(mb: float) -> dict[str, str]:
    """Degenerate responses of about ``mb`` MiB each, by name."""
    n = int(mb * (1 << 20))
    return {
        "repeat-answer": ("The answer is 18. " * (n // 18 + 1))[:n],
        "repeat-digits": ("18" * (n // 2 + 1))[:n],
        "blank-lines": "\n" * n,
        "blank-lines-then-hashes": "\n" * n + "#### 18",
        "spaces-and-newlines": " \n" * (n // 2),
        "nested-braces": "{" * (n // 2) + "}" * (n // 2),
        "open-braces": "{" * n,
        "open-boxes": "\\boxed{" * (n // 7),
        "nested-boxes": "\\boxed{" * (n // 16) + "18" + "}" * (n // 16),
        "many-boxes": "".join(f"\\boxed{{{i}}}" for i in range(n // 12)),
        "many-anchors": "the answer is " * (n // 14),
        "hashes-run": "#" * n,
        "dollars": "$" * n,
        "open-fences": "```python\n" * (n // 10),
        "code-lines": "```python\n" + "x = 1\n" * (n // 6) + "def square(v):\n    return v * v\n```",
    }


ROW = {"uid": "degenerate", "answer": "18", "meta": {"tests": ["assert square(3) == 9"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=1.0)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--checkout", default=str(REPO), help="repository root to import reward from")
    args = ap.parse_args()
    checkout = Path(args.checkout).resolve()
    sys.path[0] = str(checkout)  # not bench/, whose reward.py would shadow the package
    os.chdir(checkout)  # the runner's fork server (python -m reward._forkserver) imports from its cwd
    from reward.config import SandboxConfig
    from reward.runner import ProtectedRunner
    from reward.verifiers import get_verifier

    verifiers = {name: get_verifier(name) for name in ("math", "format", "exact")}
    import functools

    from reward.verifiers import code_verifier

    verifiers["code"] = functools.partial(code_verifier, sandbox=SandboxConfig())
    runner = ProtectedRunner(args.timeout, memory_mb=2048, calls_per_child=1)
    worst, timeouts = 0.0, 0
    try:
        print(f"{'input':26s} {'verifier':8s} {'status':8s} {'seconds':>8s} {'of timeout':>10s}")
        for name, text in inputs(args.mb).items():
            outs = runner.run([(fn, text, ROW) for fn in verifiers.values()])
            for vname, out in zip(verifiers, outs):
                share = out.elapsed_s / args.timeout
                worst = max(worst, share)
                timeouts += out.status == "timeout"
                print(f"{name:26s} {vname:8s} {out.status:8s} {out.elapsed_s:8.3f} {share:10.1%}")
    finally:
        runner.close()
    print(f"worst: {worst:.1%} of the {args.timeout:g} s timeout; {timeouts} timeouts")
    sys.exit(1 if timeouts else 0)


if __name__ == "__main__":
    main()
