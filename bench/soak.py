"""Soak test: train while killing a random rollout engine or reward worker every K steps.

    python bench/soak.py [CONFIG] [--steps N] [--kill-every K] [--seed S] [dotted.key=value ...]

Reports steps completed, engine and reward-worker restarts, and whether any prompt was lost or trained twice
(every step must train on exactly the prompts the prompt stream handed out, each once per epoch). The
baseline is the same run's own fault-free steps: the report also gives the mean step time of steps with and
without a kill before them, as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default="configs/tiny_moe.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-every", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from cluster.config import load_config
    from cluster.data.prompts import PromptStream
    from cluster.driver.trainer import Trainer

    out = tempfile.mkdtemp(prefix="soak-")
    cfg = load_config(args.config, [
        "rollout.num_engines=2", "reward.num_workers=2", *args.overrides, f"trainer.output_dir={out}",
        "trainer.run_name=soak", f"trainer.total_steps={args.steps}", "warm_start.steps=0", "wandb.mode=disabled",
        "trainer.save_every=0", "trainer.plots=false"])
    rng = random.Random(args.seed)
    t = Trainer(cfg)
    t.start()
    expected = PromptStream(t.train_rows, seed=t.stream.seed, position=t.stream.position)
    kills: list[str] = []
    times = {"after_kill": [], "clean": []}
    engine_restarts = reward_restarts = 0
    lost = doubled = 0
    try:
        for step in range(1, args.steps + 1):
            killed = False
            if step > 1 and (step - 1) % args.kill_every == 0:
                if rng.random() < 0.5:
                    pids = t.fleet.pids()
                    victim = rng.randrange(len(pids))
                    os.kill(pids[victim], signal.SIGKILL)
                    kills.append(f"step {step}: engine {victim} (pid {pids[victim]})")
                else:
                    pids = t.rewards.worker_pids()
                    victim = rng.randrange(len(pids))
                    os.kill(pids[victim], signal.SIGKILL)
                    kills.append(f"step {step}: reward worker {victim} (pid {pids[victim]})")
                killed = True
            m = t.rl_step()
            engine_restarts += int(m["fault/rollout_restarts"])
            reward_restarts += int(m.get("fault/reward_restarts", 0))
            times["after_kill" if killed else "clean"].append(m["timing/step_s"])
            want = [r.uid for r in expected.take(cfg.trainer.prompts_per_step)]
            got = t.trained_uids[-1]
            lost += len(set(want) - set(got))
            doubled += len(got) - len(set(got))
            print(f"step {step}: {m['timing/step_s']:.2f}s, restarts engine {int(m['fault/rollout_restarts'])} "
                  f"reward {int(m.get('fault/reward_restarts', 0))}, reward {m['reward/mean']:.3f}", flush=True)
    finally:
        t.shutdown()
        import ray

        ray.shutdown()
    clean = statistics.mean(times["clean"]) if times["clean"] else float("nan")
    hit = statistics.mean(times["after_kill"]) if times["after_kill"] else float("nan")
    report = {
        "steps_completed": len(t.trained_uids),
        "kills": kills,
        "engine_restarts": engine_restarts,
        "reward_restarts": reward_restarts,
        "prompts_lost": lost,
        "prompts_trained_twice": doubled,
        "step_s_clean": clean,
        "step_s_after_kill": hit,
        "ratio_after_kill_vs_clean": hit / clean if clean == clean and clean > 0 else None,
    }
    print(json.dumps(report, indent=2))
    ok = report["steps_completed"] == args.steps and lost == 0 and doubled == 0
    print("soak: OK" if ok else "soak: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
