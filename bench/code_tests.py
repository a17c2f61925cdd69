"""Code verifier throughput: assert-style tests judged per second, on each sandbox backend.

    python bench/code_tests.py [--problems N] [--tests T] [--backend bwrap|plain|both] [--rounds R]
                               [--baseline DIR]

Scores N honest solutions (a few small functions each) against T assert tests each through
``reward.verifiers.code_verifier`` (one sandbox run per solution, as the worker does), sequentially, and
prints tests/s per backend: the median over R rounds, each round one pass after a warm-up solution, in a
fresh process. With ``--baseline`` (another checkout, e.g. the parent commit exported with ``git archive``)
the rounds alternate between the baseline and this checkout, so that both see the same machine load, and
the ratio of the medians is printed. Checks that every test passed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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


def worker(args) -> None:
    """One round in this process: print ``{backend: tests/s}`` as JSON."""
    sys.path[0] = str(Path(args.checkout).resolve())  # not bench/, whose reward.py would shadow the package
    rows = make_rows(args.problems, args.tests)
    out = {b: run(b, rows, 1)[0] for b in backends(args.backend)}
    print(json.dumps(out))


def backends(choice: str) -> list[str]:
    return ["bwrap", "plain"] if choice == "both" else [choice]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--tests", type=int, default=8)
    ap.add_argument("--backend", choices=["bwrap", "plain", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", default=None, help="another checkout to compare against")
    ap.add_argument("--checkout", default=str(REPO), help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    checkouts = {"this": str(REPO)}
    if args.baseline:
        checkouts = {"baseline": str(Path(args.baseline).resolve()), **checkouts}
    got: dict[str, dict[str, list[float]]] = {k: {b: [] for b in backends(args.backend)} for k in checkouts}
    for _ in range(args.rounds):
        for name, path in checkouts.items():
            cmd = [sys.executable, __file__, "--worker", "--checkout", path, "--problems", str(args.problems),
                   "--tests", str(args.tests), "--backend", args.backend]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise SystemExit(f"{name} ({path}) failed:\n{res.stderr[-2000:]}")
            for b, tps in json.loads(res.stdout.strip().splitlines()[-1]).items():
                got[name][b].append(tps)
    print(f"{args.problems} solutions x {args.tests} tests, median of {args.rounds} rounds (tests/s):")
    for b in backends(args.backend):
        line = "  ".join(f"{name} {statistics.median(v[b]):7.1f}" for name, v in got.items())
        if args.baseline:
            line += f"  ratio this/baseline {statistics.median(got['this'][b]) / statistics.median(got['baseline'][b]):.2f}"
        print(f"{b:6s} {line}")


if __name__ == "__main__":
    main()
