"""Code verifier throughput: assert-style tests judged per second, on each sandbox backend.

    python bench/code_tests.py [--problems N] [--tests T] [--backend bwrap|plain|both] [--repeats R]
                               [--checkout DIR]

Scores N honest solutions (a few small functions each) against T assert tests each through
``reward.verifiers.code_verifier`` (one sandbox run per solution, as the worker does), sequentially in this
process, and prints tests/s and solutions/s per backend (best of R runs after a warm-up). Checks that every
test passed. ``--checkout`` imports ``reward`` from another checkout (default: this one), to compare code
versions on one machine in one sitting.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


SOLUTION = '''
def add(a, b):
    return a + b

def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

def rev(s):
    return s[::-1]
'''

TEST_POOL = [
    "assert add({i}, 2) == {i} + 2",
    "assert fib({j}) == {fib}",
    "assert rev('ab{i}') == '{rev}'",
    "assert sorted([add(x, {i}) for x in range(5)]) == [x + {i} for x in range(5)]",
]


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def make_rows(problems: int, tests: int) -> list[dict]:
    """``problems`` rows of ``tests`` assert snippets each (all pass for ``SOLUTION``)."""
    rows = []
    for p in range(problems):
        snippets = []
        for k in range(tests):
            i, j = p * 31 + k, (p + k) % 20
            tmpl = TEST_POOL[k % len(TEST_POOL)]
            snippets.append(tmpl.format(i=i, j=j, fib=_fib(j), rev=("ab" + str(i))[::-1]))
        rows.append({"uid": f"bench{p}", "answer": "", "meta": {"tests": snippets}})
    return rows


def run(backend: str, rows: list[dict], repeats: int) -> tuple[float, float]:
    """Best (tests/s, solutions/s) over ``repeats`` passes after one warm-up solution."""
    from reward.config import SandboxConfig
    from reward.verifiers import code_verifier

    cfg = SandboxConfig(backend=backend)
    response = f"```python\n{SOLUTION}```"
    code_verifier(response, rows[0], sandbox=cfg)  # warm-up (bwrap probe, imports)
    n_tests = sum(len(r["meta"]["tests"]) for r in rows)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        for row in rows:
            out = code_verifier(response, row, sandbox=cfg)
            if out["passed"] != out["total"]:
                raise SystemExit(f"{backend}: {row['uid']} passed {out['passed']}/{out['total']}: {out}")
        best = max(best, 1.0 / (time.perf_counter() - t))
    return n_tests * best, len(rows) * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--tests", type=int, default=8)
    ap.add_argument("--backend", choices=["bwrap", "plain", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--checkout", default=str(REPO), help="repository root to import reward from")
    args = ap.parse_args()
    sys.path[0] = str(Path(args.checkout).resolve())  # not bench/, whose reward.py would shadow the package
    rows = make_rows(args.problems, args.tests)
    for backend in (["bwrap", "plain"] if args.backend == "both" else [args.backend]):
        tps, sps = run(backend, rows, args.repeats)
        print(f"{backend:6s} {args.problems} solutions x {args.tests} tests: {tps:8.1f} tests/s  {sps:6.2f} solutions/s")


if __name__ == "__main__":
    main()
