"""The same calculator episodes through the session gateway (an OpenAI program, ``env.agent``) and through the
in-process loop (``env.tools``), one training run each in this invocation: seconds per step and per rollout.

Both runs use the same model, warm start, rows, seeds and GSPO settings (``configs/tiny_agent_calc.yaml`` and
``configs/tiny_agent_openai.yaml``, which differ only in how the episode is played), so they sample the same
episodes; the gateway's cost is what its HTTP requests, the OpenAI clients in the env worker and the session
matching add. Steps before ``--skip`` (engine warm-up, the first overlapped step) are left out of the medians.

    .venv/bin/python bench/agent_gateway.py --steps 12
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

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"in-process (env.tools)": "configs/tiny_agent_calc.yaml",
           "gateway (env.agent, openai client)": "configs/tiny_agent_openai.yaml"}


def run(config: str, out: Path, steps: int, extra: list[str]) -> list[dict]:
    """One training run; its metrics.jsonl lines of RL steps."""
    args = [sys.executable, "-m", "cluster.train", config, f"trainer.total_steps={steps}", "trainer.eval_every=0",
            "trainer.save_every=0", "trainer.plots=false", "wandb.mode=disabled", f"trainer.output_dir={out}",
            "trainer.run_name=run", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(args, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "timing/step_s" in m and "reward/mean" in m]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs (section.key=value)")
    args = ap.parse_args()
    extra = ["warm_start.steps=100", *args.overrides]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in CONFIGS.items():
            steps = run(config, Path(tmp) / name.split()[0], args.steps, extra)[args.skip:]
            results[name] = steps
            print(f"{name}: step {statistics.median(m['timing/step_s'] for m in steps):.2f} s, rollout "
                  f"{statistics.median(m['timing/rollout_s'] for m in steps):.2f} s (medians of {len(steps)} steps), "
                  f"engine busy {statistics.median(m['agent/engine_busy_share'] for m in steps):.2f}, "
                  f"token mismatch {sum(m['agent/token_mismatch'] for m in steps):.0f}")
    (a, base), (b, gw) = results.items()
    same = [x["reward/mean"] for x in base] == [x["reward/mean"] for x in gw]
    differ = [(m["step"], m["reward/mean"], g["reward/mean"]) for m, g in zip(base, gw) if m["reward/mean"] != g["reward/mean"]]
    if differ:
        print(f"rewards differ from step {differ[0][0]} (in-process {differ[0][1]:.4f}, gateway {differ[0][2]:.4f})")
    ratio = statistics.median(m["timing/step_s"] for m in gw) / statistics.median(m["timing/step_s"] for m in base)
    print(f"gateway / in-process, seconds per step: {ratio:.2f}x; the same rewards every step: {same}")


if __name__ == "__main__":
    main()
