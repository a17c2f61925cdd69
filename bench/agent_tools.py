"""Do the engines wait on tools? Multi-turn episodes with a slow tool, our loop against turn-round by turn-round.

    python bench/agent_tools.py [--rounds 3] [--prompts 16] [--group 4] [--delay 0.2] [--steps 6] [dotted.key=value ...]

Runs the real services (``configs/tiny_agent_calc.yaml``'s model after a short warm start on its demonstrations,
so that each turn writes a call and stops on its closing tag; one engine; an env worker) with
``reward.envs.slow_tool:SlowTool``: every turn waits like a tool call of about ``--delay`` seconds (0.5-1.5x per
episode), 3-4 turns an episode. In the same invocation it plays the same episodes (same seeds) three times per round:

- **ours** (``EpisodeRunner``): continuous batching: an episode whose tool answered joins the engine's running
  batch at its next call (``RolloutEngine.advance_turns``), while others wait for their tool;
- **per_call** (the loop before continuous batching): whenever the engine is idle it samples every ready
  episode as one batch that runs to its end;
- **lockstep** (the baseline): every episode's turn t, then every tool of turn t, then turn t+1 (a rollout that
  batches by turn, as a loop without per-episode scheduling does).

Then **partial** (``trainer.partial_rollouts=true``, ``max_staleness=1``; ``cluster.driver.partial_episodes``):
``--steps`` collections of ``--prompts`` groups from a stream over the same rows (same tool and delays; the
episodes differ from the rounds above as a stream's do), each followed by a real weight sync (a new version):
up to 2 P groups are under way, a collection ends when P groups have all episodes ended, the rest carries on
after the sync. Its seconds per step are the median collection from the second on (the first fills the backlog),
sync excluded, as the other arms time their rollouts only.

Prints seconds per rollout of each, the ratios (lockstep / ours and per_call / ours: above 1 means ours is faster)
and each one's engine busy share (ours: the share of the rollout's wall time the engine spent in scheduler steps;
the others: in its sampling calls, Ray's round trips included, which favours them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def lockstep_runner(base):
    """An ``EpisodeRunner`` whose ``_play`` goes turn-round by turn-round (the baseline)."""
    import ray

    from cluster.driver.agent_loop import EpisodeRunner
    from reward.episode_status import RUNNING

    class Lockstep(EpisodeRunner):
        def _play(self, episodes, temperature):
            from collections import Counter

            by_id, seeds, busy = {e.episode_id: e for e in episodes}, Counter(), 0.0
            live, engines = [e for e in episodes if e.status == RUNNING], list(self.fleet.engines)
            while live:
                t = time.perf_counter()
                shares = [live[j::len(engines)] for j in range(len(engines))]
                refs = [engines[j].sample_turns.remote([self._request(e, seeds) for e in share], temperature)
                        for j, share in enumerate(shares) if share]
                turns = [x for out in ray.get(refs) for x in out]
                busy += (time.perf_counter() - t) * len(refs)
                stepping: dict = {}
                for turn in turns:
                    self._on_turn(by_id[turn.episode_id], turn, stepping)
                results = ray.get(list(stepping))
                live = [e for e, s in zip(stepping.values(), results) if self._on_step(e, s)]
            return busy

    return Lockstep(base.cfg, base.fleet, base.pool, base.tokenizer)


def per_call_runner(base):
    """An ``EpisodeRunner`` whose ``_play`` gives every ready episode to an idle engine as one ``sample_turns``
    batch that runs to its end (the loop before continuous batching: a turn that becomes ready while its engine
    samples a batch waits for that whole batch)."""
    import ray

    from cluster.driver.agent_loop import EpisodeRunner
    from reward.episode_status import RUNNING

    class PerCall(EpisodeRunner):
        def _play(self, episodes, temperature):
            from collections import Counter

            by_id, seeds, busy = {e.episode_id: e for e in episodes}, Counter(), 0.0
            ready, engines = [e for e in episodes if e.status == RUNNING], list(self.fleet.engines)
            sampling, stepping = {}, {}
            while ready or sampling or stepping:
                idle = [j for j in range(len(engines)) if j not in {s for s, _ in sampling.values()}]
                for n, j in enumerate(idle):
                    if share := ready[n::len(idle)]:
                        reqs = [self._request(e, seeds) for e in share]
                        sampling[engines[j].sample_turns.remote(reqs, temperature)] = (j, time.perf_counter())
                if idle:
                    ready = []
                (ref,), _ = ray.wait(list(sampling) + list(stepping), num_returns=1)
                if ref in sampling:
                    busy += time.perf_counter() - sampling.pop(ref)[1]
                    for turn in ray.get(ref):
                        self._on_turn(by_id[turn.episode_id], turn, stepping)
                else:
                    e = stepping.pop(ref)
                    if self._on_step(e, ray.get(ref)):
                        ready.append(e)
            return busy

    return PerCall(base.cfg, base.fleet, base.pool, base.tokenizer)


def partial_steps(t, rows, group: int, steps: int) -> tuple[list[float], list[float], list[float]]:
    """Seconds, engine busy share and multi-version share of ``steps`` partial-rollout collections of
    ``len(rows)`` groups of ``group`` episodes, a weight sync after each (its seconds not counted)."""
    from cluster.data.prompts import PromptStream
    from cluster.driver.partial_episodes import PartialEpisodeCollector

    tc = t.cfg.trainer.model_copy(update={"partial_rollouts": True, "max_staleness": 1, "group_size": group,
                                           "prompts_per_step": len(rows)})
    col = PartialEpisodeCollector(t.cfg.model_copy(update={"trainer": tc}), PromptStream(rows, seed=0),
                                  t.episodes, lambda: t.weight_version)
    seconds, busy, spans = [], [], []
    for k in range(steps):
        t0 = time.perf_counter()
        c = col.collect(k)
        seconds.append(time.perf_counter() - t0)
        busy.append(c.reward_metrics["agent/engine_busy_share"])
        spans.append(col.stats["partial/multi_version_share"])
        print(f"step {k}: partial  {seconds[-1]:6.2f} s, turns {c.reward_metrics['agent/turns_mean']:.2f}, engine "
              f"busy {busy[-1]:.2f}, episodes over two versions {spans[-1]:.2f}, in flight "
              f"{col.stats['partial/in_flight_groups']:.0f} groups", flush=True)
        t._sync_weights(t.weight_version + 1)
    return seconds[1:], busy[1:], spans[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--delay", type=float, default=0.2, help="the tool's mean seconds per call")
    ap.add_argument("--steps", type=int, default=6, help="partial-rollout collections (0: skip that arm)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench_agent_")
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny_agent_calc.yaml", [
        f"trainer.output_dir={out}", "wandb.mode=disabled", "warm_start.steps=150",
        "env.cls=reward.envs.slow_tool:SlowTool", "env.tools=[]", "env.max_turns=4", "env.num_workers=1",
        "rollout.max_model_len=256",
        f"trainer.prompts_per_step={args.prompts}", f"trainer.group_size={args.group}", "learner.micro_batch_size=4",
        *args.overrides])
    t = Trainer(cfg, verbose=False)
    t.start()
    try:
        t.warm_start()  # the calculator task's demonstrations: each turn writes a call and stops on its closing tag
        runners = {"ours": t.episodes, "per_call": per_call_runner(t.episodes), "lockstep": lockstep_runner(t.episodes)}
        rows = [r for r in t.train_rows[: args.prompts]]
        for r in rows:
            r.meta["delay_s"] = args.delay
        times: dict[str, list[float]] = {name: [] for name in runners}
        busy: dict[str, list[float]] = {name: [] for name in runners}
        for runner in runners.values():
            runner.run(rows[:2], 1, seed=99)  # warm-up: the engine's first calls, the worker's imports
        for k in range(args.rounds):
            for name, runner in runners.items():
                t0 = time.perf_counter()
                _, _, m, _ = runner.run(rows, args.group, seed=k)
                times[name].append(time.perf_counter() - t0)
                busy[name].append(m["agent/engine_busy_share"])
                print(f"round {k}: {name:8s} {times[name][-1]:6.2f} s, turns {m['agent/turns_mean']:.2f}, "
                      f"engine busy {busy[name][-1]:.2f}", flush=True)
        if args.steps > 1:
            times["partial"], busy["partial"], _ = partial_steps(t, rows, args.group, args.steps)
    finally:
        t.shutdown()
    med = {name: statistics.median(v) for name, v in times.items() if v}
    print(f"\n{args.prompts} prompts x {args.group} episodes, tool {args.delay:g} s (0.5-1.5x), 3-4 turns")
    for name in med:
        print(f"{name:9s} {med[name]:6.2f} s per rollout, engine busy {statistics.median(busy[name]):.2f}")
    if "ours" in med:
        print(f"ratio lockstep / ours: {med['lockstep'] / med['ours']:.2f}x; per_call / ours: "
              f"{med['per_call'] / med['ours']:.2f}x")
    if "partial" in med and "lockstep" in med:
        print(f"ratio lockstep / partial (seconds per step): {med['lockstep'] / med['partial']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
