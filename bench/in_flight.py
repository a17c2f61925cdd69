"""Do the engines stop for a sync? Partial episodes with a slow tool, the drain against in-flight loads.

    python bench/in_flight.py [--steps 6] [--prompts 8] [--group 4] [--delay 0.2] [dotted.key=value ...]

Runs the real services (``configs/tiny_agent_calc.yaml``'s model after a short warm start on its demonstrations,
one engine, one env worker) with ``reward.envs.slow_tool:SlowTool`` (about ``--delay`` s a turn, 3-4 turns), and
``trainer.partial_rollouts`` with ``partial_rollout_overlap`` (``max_staleness=2``): the engine plays episodes
beside the learner. In the same invocation, one arm after the other on the same engine and stream, ``--steps``
full RL steps (collect, train, sync) each of:

- **drain** (``sync.in_flight=off``): at the sync the open turns finish under the old weights, the engine waits;
- **keep** / **recompute**: the engine loads between two scheduler steps with turns open (``rollout.in_flight``).

Prints per arm the median step seconds (from the second step of the arm on), the engine's busy share over the
whole step (seconds in scheduler steps / step wall time), tokens thrown away (``partial/dropped_tokens``) and the
share of trained episodes whose tokens came from two versions, then the ratios drain / keep and drain /
recompute (above 1: in-flight is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = {"drain": "off", "keep": "keep", "recompute": "recompute"}


def run_arm(t, mode: str, steps: int) -> dict[str, float]:
    """``steps`` RL steps with ``sync.in_flight=mode`` on trainer ``t``'s engine, stream and learner: their
    median seconds and busy share (from the second on), and the tokens dropped over all of them."""
    import ray

    from cluster.driver.partial_episodes import PartialEpisodeCollector

    old = t.collector
    old.drain_turns()  # the previous arm's open turns end under its own rule
    t.cfg = t.cfg.model_copy(update={"sync": t.cfg.sync.model_copy(update={"in_flight": mode})})
    ray.get([e.set_in_flight.remote(mode) for e in t.fleet.engines])
    col = PartialEpisodeCollector(t.cfg, t.stream, t.episodes, lambda: t.weight_version)
    t.collector, t.pending = col, None
    seconds, busy, dropped, spans = [], [], 0.0, []
    for _ in range(steps):
        b0, t0 = col.loop.busy, time.perf_counter()
        m = t.rl_step()
        seconds.append(time.perf_counter() - t0)
        busy.append((col.loop.busy - b0) / (seconds[-1] * len(t.fleet.engines)))
        dropped += m.get("partial/dropped_tokens", 0.0)
        spans.append(m.get("partial/multi_version_share", 0.0))
        print(f"{mode:9s} step {t.step}: {seconds[-1]:6.2f} s, engine busy {busy[-1]:.2f}, dropped "
              f"{m.get('partial/dropped_tokens', 0.0):.0f}, two-version episodes {spans[-1]:.2f}, sync "
              f"{m.get('timing/weight_sync_s', 0.0):.3f} s", flush=True)
    return {"step_s": statistics.median(seconds[1:] or seconds), "busy": statistics.median(busy[1:] or busy),
            "dropped": dropped, "spans": statistics.mean(spans)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--delay", type=float, default=0.2, help="the tool's mean seconds per call")
    ap.add_argument("--arms", default="drain,keep,recompute")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench_in_flight_")
    arms = args.arms.split(",")
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny_agent_calc.yaml", [
        f"trainer.output_dir={out}", "wandb.mode=disabled", "warm_start.steps=150", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.plots=false", "env.cls=reward.envs.slow_tool:SlowTool", "env.tools=[]",
        "env.max_turns=4", "env.num_workers=1", "rollout.max_model_len=256", "trainer.partial_rollouts=true",
        "trainer.partial_rollout_overlap=true", "trainer.max_staleness=2", "trainer.total_steps=1000",
        f"trainer.prompts_per_step={args.prompts}", f"trainer.group_size={args.group}", "learner.micro_batch_size=4",
        f"sync.in_flight={MODES[arms[0]]}", *args.overrides])
    t = Trainer(cfg, verbose=False)
    t.start()
    results = {}
    try:
        t.warm_start()  # each turn writes a call and stops on its closing tag
        for r in t.train_rows:
            r.meta["delay_s"] = args.delay
        for arm in arms:
            results[arm] = run_arm(t, MODES[arm], args.steps)
    finally:
        t.shutdown()
    print(f"\n{args.prompts} prompts x {args.group} episodes, tool {args.delay:g} s, {args.steps} steps per arm "
          "(medians from the second step)")
    for arm, r in results.items():
        print(f"{arm:9s} {r['step_s']:6.2f} s per step, engine busy {r['busy']:.2f}, tokens dropped "
              f"{r['dropped']:.0f}, two-version episodes {r['spans']:.2f}")
    for arm in ("keep", "recompute"):
        if arm in results and "drain" in results:
            print(f"ratio drain / {arm} (step seconds): {results['drain']['step_s'] / results[arm]['step_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
