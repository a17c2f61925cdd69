"""On-policy, one-step overlap and partial-rollout async on a long-tail workload, side by side.

    python bench/partial_rollout.py [--config CONFIG] [--seeds 0,1,2] [--steps N] [--target ACC] [--out DIR] [key=value ...]

Runs ``python -m cluster.train CONFIG`` (default configs/tiny_long_tail.yaml) once per mode and seed, in this
order per seed: ``on_policy`` (max_staleness=0), ``overlap`` (max_staleness=1: step k+1's rollout beside step
k's update), ``partial`` (partial_rollouts=true, max_staleness=1: rounds of at most half the response limit,
unfinished samples continue after the sync) and ``partial_overlap`` (the same with max_staleness=2 and
partial_rollout_overlap=true: rounds also run beside the learner's step). Then prints, per mode (means over seeds) and as a ratio to
on-policy:
- ``rl_wall_s``: the RL steps' wall time (sum of timing/step_s; services, warm start and evals left out),
- ``tokens_per_s``: generated tokens over that wall time,
- ``engine_busy``: the share of that wall time the engines spent generating (timing/rollout_s / timing/step_s),
- ``slot_util``: the share of the engines' decode slots that produced a token (rollout/slot_utilization: 1.0
  means no sample waited for a longer one),
- ``time_to_target_s``: RL wall time until the held-out greedy accuracy first reached ``--target``,
- ``final_acc`` and ``start_acc``: held-out accuracy at the last and first evaluation.
Every run is a real run (Ray, vLLM, DeepSpeed on the CPU); figures on a shared machine are loaded: read the
ratios, taken in one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "on_policy": ["trainer.max_staleness=0"],
    "overlap": ["trainer.max_staleness=1"],
    "partial": ["trainer.max_staleness=1", "trainer.partial_rollouts=true"],
    "partial_overlap": ["trainer.max_staleness=2", "trainer.partial_rollouts=true", "trainer.partial_rollout_overlap=true"],
}


def run_one(config: str, out: Path, name: str, overrides: list[str]) -> list[dict]:
    """One training run; returns its metrics.jsonl rows."""
    cmd = [sys.executable, "-m", "cluster.train", config, f"trainer.output_dir={out}", f"trainer.run_name={name}",
           "trainer.plots=false", "wandb.mode=disabled", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def figures(rows: list[dict], target: float) -> dict[str, float]:
    """The comparison's figures of one run (see the module docstring)."""
    steps = [r for r in rows if r.get("step", 0) >= 1 and "timing/step_s" in r]
    wall = sum(r["timing/step_s"] for r in steps)
    tokens = sum(r.get("throughput/rollout_tokens_per_s", 0.0) * r.get("timing/rollout_s", 0.0) for r in steps)
    evals = [r for r in rows if "eval/accuracy" in r]
    elapsed, to_target = 0.0, float("nan")
    by_step = {r["step"]: r for r in steps}
    for r in evals:
        elapsed = sum(by_step[s]["timing/step_s"] for s in by_step if s <= r["step"])
        if r["eval/accuracy"] >= target:
            to_target = elapsed
            break
    return {"rl_wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
            "engine_busy": sum(r.get("timing/rollout_s", 0.0) for r in steps) / wall if wall else 0.0,
            "slot_util": statistics.mean(r.get("rollout/slot_utilization", float("nan")) for r in steps),
            "time_to_target_s": to_target, "final_acc": evals[-1]["eval/accuracy"], "start_acc": evals[0]["eval/accuracy"],
            "restarted": sum(r.get("partial/restarted_samples", 0.0) for r in steps)}


def report(results: dict[str, list[dict[str, float]]]) -> None:
    """Per mode: means over seeds, and the ratio to on-policy (when on-policy ran)."""
    keys = list(next(iter(results.values()))[0])
    base = {k: statistics.mean(f[k] for f in results["on_policy"]) for k in keys} if "on_policy" in results else None
    print(f"{'mode':10s} " + " ".join(f"{k:>17s}" for k in keys))
    for mode, runs in results.items():
        mean = {k: statistics.mean(f[k] for f in runs) for k in keys}
        print(f"{mode:10s} " + " ".join(f"{mean[k]:17.3f}" for k in keys))
        if base is not None:
            print(f"{'  /on_pol':10s} " + " ".join(
                f"{(mean[k] / base[k] if base[k] else float('nan')):17.3f}" for k in keys))
    for mode, runs in results.items():
        print(mode, "per seed final_acc:", [round(f["final_acc"], 3) for f in runs])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tiny_long_tail.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="partial-bench-"))
    extra = list(args.overrides) + ([f"trainer.total_steps={args.steps}"] if args.steps else [])
    results: dict[str, list[dict[str, float]]] = {m: [] for m in args.modes.split(",")}
    for seed in (int(s) for s in args.seeds.split(",")):
        for mode in results:
            rows = run_one(args.config, out, f"{mode}_s{seed}", [*MODES[mode], f"trainer.seed={seed}",
                                                               f"rollout.seed={seed}", *extra])
            results[mode].append(figures(rows, args.target))
            print(mode, seed, json.dumps(results[mode][-1]), flush=True)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
