"""An LLM judge against the exact verifier on the arithmetic task: agreement and cost per sample, in one invocation.

    python bench/judge.py [--model models/smollm2-135m-instruct] [--n 128] [--score token_probs|regex]
                          [--no-reference] [--template TEXT] [--repeats 2]

Builds ``n`` responses to the generated arithmetic task's held-out rows (``cluster.data.prompts.arithmetic_rows``,
two-digit operands): half the right sum, half wrong (off by 1-10, or the digits swapped), in plain and
``#### N`` forms. Scores them with the ``exact`` verifier through a real reward worker (``RewardPool``, the path a
run takes) and with the LLM judge (``cluster.runtime.judge.JudgeFleet``: one vLLM ``JudgeEngine`` actor, greedy,
the whole batch in one call), and prints:

- agreement: the share of samples where the judge's verdict (token_probs: P(yes) > 0.5; regex: score >= 0.5)
  equals the verifier's, with the counts of each disagreement and of NaN (unparsed) judgements, the judge's
  mean score on right and on wrong answers and its ROC AUC (the chance a right answer outscores a wrong one);
- cost: seconds per sample of the judge's batched call and of the verifier's (best of ``repeats`` after a
  warm-up call each), and their ratio.

``--no-reference`` drops the reference answer from the judge's prompt (the judge must add the numbers itself).
Needs ``make real-model`` for the default model.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WITH_REFERENCE = ("Question: {prompt}\nReference answer: {answer}\nStudent answer: {response}\n"
                  "Is the student's final answer correct? Answer Yes or No.")
NO_REFERENCE = ("Question: what is {prompt}?\nStudent answer: {response}\n"
                "Is the student's answer correct? Answer Yes or No.")
REGEX_SUFFIX = "\nReply with 1 if it is correct and 0 if it is wrong."


def requests(n: int, seed: int = 0):
    """``n`` exact-verifier requests on arithmetic rows, even indices right, odd ones wrong."""
    from cluster.data.prompts import arithmetic_rows
    from reward.contracts import RewardRequest

    _, rows = arithmetic_rows(lambda s: [0], max_operand=99, num_train=1, num_eval=n, seed=seed)
    rng = random.Random(seed)
    out = []
    for i, row in enumerate(rows):
        right = int(row.answer)
        if i % 2 == 0:
            value = right
        else:
            swapped = int(str(right)[::-1]) if len(str(right)) > 1 else right
            if swapped != right and rng.random() < 0.3:
                value = swapped
            else:
                value = right + rng.choice([-1, 1]) * rng.randint(1, 10)
        text = f"#### {value}" if i % 4 in (0, 1) else str(value)
        out.append(RewardRequest(response=text, row=row))
    return out


def best_time(fn, repeats: int) -> tuple[float, object]:
    """(best wall seconds of ``repeats`` calls after one warm-up call, the last result)."""
    out = fn()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--score", choices=["token_probs", "regex"], default="token_probs")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--template", default=None, help="the judge's template (reward.judge.template); default: "
                    "the reference-answer question, or --no-reference's")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if not Path(args.model).is_dir():
        sys.exit(f"--model {args.model} is not a folder (run `make real-model`)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray

    from cluster.runtime.judge import JudgeFleet
    from cluster.runtime.services import actor_env
    from reward.config import JudgeConfig, RewardConfig
    from reward.pool import RewardPool

    template = args.template or (NO_REFERENCE if args.no_reference else WITH_REFERENCE)
    extra = {}
    if args.score == "regex":
        template = template.replace(" Answer Yes or No.", REGEX_SUFFIX)
        extra = {"regex": r"([01])", "max_tokens": 4}
    jc = JudgeConfig(model_path=args.model, template=template, score=args.score, max_model_len=512,
                     kv_cache_gb=0.25, timeout_s=600, **extra)
    reqs = requests(args.n)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": actor_env(1)}, log_to_driver=False)
    try:
        pool = RewardPool(RewardConfig(verifier="exact"))
        verifier_s, verdicts = best_time(lambda: pool.score(reqs), args.repeats)
        t = time.perf_counter()
        fleet = JudgeFleet(jc, args.model, Path(tempfile.mkdtemp(prefix="gspo-judge-bench-")))
        start_s = time.perf_counter() - t
        judge_s, judged = best_time(lambda: fleet.judge(reqs), args.repeats)
        fleet.shutdown()
        pool.shutdown()
    finally:
        ray.shutdown()
    report(args, reqs, verdicts, judged, verifier_s, judge_s, start_s)


def report(args, reqs, verdicts, judged, verifier_s, judge_s, start_s) -> None:
    """Print the agreement and the cost lines."""
    n = len(reqs)
    right = [v.correct for v in verdicts]
    nan = sum(not math.isfinite(j.score) for j in judged)
    says = [math.isfinite(j.score) and j.score >= 0.5 if args.score == "regex" else
            math.isfinite(j.score) and j.score > 0.5 for j in judged]
    agree = sum(a == b for a, b in zip(right, says))
    false_pos = sum(s and not r for r, s in zip(right, says))
    false_neg = sum(r and not s for r, s in zip(right, says))

    def mean(xs):
        xs = [x for x in xs if math.isfinite(x)]
        return sum(xs) / len(xs) if xs else math.nan

    which = args.template or ("no reference" if args.no_reference else "with reference")
    print(f"judge {Path(args.model).name}, score={args.score}, template {which!r}; "
          f"{n} responses ({sum(right)} right by the exact verifier)")
    print(f"agreement with the exact verifier: {agree}/{n} = {agree / n:.3f}  (judge says right but wrong: "
          f"{false_pos}; says wrong but right: {false_neg}; NaN/unparsed: {nan})")
    pos = [j.score for j, r in zip(judged, right) if r and math.isfinite(j.score)]
    neg = [j.score for j, r in zip(judged, right) if not r and math.isfinite(j.score)]
    # ROC AUC: the chance that a right answer outscores a wrong one (ties count half), threshold-free
    auc = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg) / (len(pos) * len(neg)) if pos and neg else math.nan
    print(f"judge mean score: right answers {mean(pos):.3f}, wrong answers {mean(neg):.3f}; "
          f"ROC AUC (right above wrong) {auc:.3f}")
    print(f"cost per sample: judge {1e3 * judge_s / n:.2f} ms (one batched call of {n}), exact verifier "
          f"{1e3 * verifier_s / n:.3f} ms (reward worker) -> judge/verifier = {judge_s / verifier_s:.0f}x; "
          f"judge engine start {start_s:.1f} s")
    print("examples:", [(r.response, round(j.score, 3), j.answer[:20]) for r, j in list(zip(reqs, judged))[:4]])


if __name__ == "__main__":
    main()
