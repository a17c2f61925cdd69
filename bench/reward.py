"""Reward scoring throughput: one process per verifier call (the pre-batching mode) against batched chunks.

    python bench/reward.py [--exact N] [--math N] [--parallel P] [--calls-per-child C] [--repeats R]

Scores N requests of the ``exact`` verifier (procedural answers, half right) and N of ``math`` (GSM8K test
answers in right and wrong forms; data at ``$GSPO_SHARED_DIR/data/gsm8k/test.jsonl``, default
``<repo>/../shared``) through a real ``RewardWorker``, in the same invocation, once with
``reward.calls_per_child=1`` (a fresh verifier process per call) and once with ``calls_per_child=C``. Prints
completions/s of both modes (best of R runs after a warm-up), their ratio, and checks that both modes give
the same scores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def exact_requests(n: int):
    from reward.contracts import RewardRequest
    from rollout.contracts import PromptRow

    reqs = []
    for i in range(n):
        row = PromptRow(uid=f"e{i}", prompt="p", prompt_token_ids=[], answer=str(1000 + i), verifier="exact")
        reqs.append(RewardRequest(f"work...\n#### {1000 + i if i % 2 == 0 else i}", row))
    return reqs


def math_requests(n: int):
    from reward.contracts import RewardRequest
    from rollout.contracts import PromptRow

    path = Path(os.environ.get("GSPO_SHARED_DIR", REPO.parent / "shared")) / "data" / "gsm8k" / "test.jsonl"
    if not path.exists():
        raise SystemExit(f"needs GSM8K at {path} (set GSPO_SHARED_DIR)")
    forms = ["#### {v}", "So the total is \\boxed{{{v}}}.", "The answer is {v}.", "#### {w}",
             "The answer is ${w}", "#### \\frac{{{d}}}{{2}}", "#### {v}.0", "I don't know."]
    reqs = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if len(reqs) >= n:
                break
            raw = json.loads(line)
            ref = raw["answer"].rsplit("####", 1)[1].strip()
            v = int(ref.replace(",", ""))
            row = PromptRow(uid=f"g{i}", prompt=raw["question"], prompt_token_ids=[], answer=ref, verifier="math")
            for form in forms:
                reqs.append(RewardRequest(form.format(v=v, w=v + 1, d=2 * v), row))
    return reqs[:n]


def rate(cfg, reqs, repeats: int) -> tuple[float, list[float]]:
    """Best completions/s over ``repeats`` runs (after one warm-up run) and the scores."""
    from reward.worker import RewardWorker

    w = RewardWorker(cfg)
    try:
        scores = [r.score for r in w.score(reqs[: max(1, len(reqs) // 8)])]  # warm-up
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            res = w.score(reqs)
            best = max(best, len(reqs) / (time.perf_counter() - t))
        scores = [r.score for r in res]
        bad = [r for r in res if r.status != "ok"]
        if bad:
            raise SystemExit(f"{len(bad)} calls not ok, first: {bad[0]}")
    finally:
        w.close()
    return best, scores


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exact", type=int, default=512)
    ap.add_argument("--math", type=int, default=128)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--calls-per-child", type=int, default=None, help="default: the config default")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from reward.config import RewardConfig

    batched = RewardConfig(timeout_s=10.0, parallel_calls=args.parallel)
    if args.calls_per_child is not None:
        batched = batched.model_copy(update={"calls_per_child": args.calls_per_child})
    per_call = batched.model_copy(update={"calls_per_child": 1})
    print(f"parallel_calls={args.parallel}  batched calls_per_child={batched.calls_per_child}  "
          f"best of {args.repeats}  cpus={os.cpu_count()}  load={os.getloadavg()[0]:.1f}")
    for name, reqs in (("exact", exact_requests(args.exact)), ("math", math_requests(args.math))):
        old, old_scores = rate(per_call, reqs, args.repeats)
        new, new_scores = rate(batched, reqs, args.repeats)
        if old_scores != new_scores:
            raise SystemExit(f"{name}: the two modes disagree on scores")
        print(f"{name:6s} n={len(reqs):4d}  per-call {old:8.1f}/s ({1e3 / old:6.2f} ms each)  "
              f"batched {new:8.1f}/s ({1e3 / new:6.2f} ms each)  ratio {new / old:6.1f}x  "
              f"(mean score {sum(new_scores) / len(new_scores):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
