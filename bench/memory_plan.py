"""The resource plan's host memory against each process's measured peak RSS, in one invocation.

    python bench/memory_plan.py [CONFIG] [--steps N] [--interval S] [dotted.key=value ...]

Builds the plan of the config (what ``--dry-run`` prints: ``memory.host_ram_gib.per_process``), then runs it
for ``--steps`` steps (``python -m cluster.train``, in its own process session) and samples every process of
that session every ``--interval`` seconds: its peak resident set (``VmHWM`` of ``/proc/PID/status``, which
never decreases) and its resident shared memory at that moment (``RssShmem``: Ray's object store pages
mapped in, which every process touching them counts). Processes are told apart by the titles Ray gives its
actors (``ray::LearnerRank``, ``ray::RolloutEngine``, ``ray::RewardWorker``); the driver is the process this
script started. Prints one JSON line per role: planned GiB, measured peak GiB (the largest of the role's
processes) and measured / planned. Figures: docs/real_model.md ("Memory").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROLES = {"ray::LearnerRank": "learner_rank", "ray::RolloutEngine": "engine", "ray::RewardWorker": "reward_worker"}


def _status(pid: int) -> dict[str, int]:
    """``VmHWM``, ``VmRSS`` and ``RssShmem`` of a process in KiB ({} if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssShmem"):
            out[key] = int(value.split()[0])
    return out


def _role(pid: int, driver: int) -> str | None:
    if pid == driver:
        return "driver"
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return next((role for prefix, role in ROLES.items() if title.startswith(prefix)), None)


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def sample(proc: subprocess.Popen, interval: float) -> dict[int, dict]:
    """Poll the run's processes until it exits: per pid its role, peak ``VmHWM`` and ``RssShmem`` at the peak."""
    seen: dict[int, dict] = {}
    while proc.poll() is None:
        for pid in _session_pids(proc.pid):
            role = _role(pid, proc.pid)
            st = _status(pid)
            if role is None or not st:
                continue
            rec = seen.setdefault(pid, {"role": role, "hwm_kib": 0, "shmem_kib": 0})
            rec["role"] = role  # an actor's title appears once its class is set
            if st["VmHWM"] > rec["hwm_kib"]:
                rec["hwm_kib"], rec["shmem_kib"] = st["VmHWM"], st.get("RssShmem", 0)
        time.sleep(interval)
    return seen


def planned(config: str, overrides: list[str]) -> dict[str, float]:
    """The plan's per-process host GiB for the config (``memory.host_ram_gib.per_process``)."""
    from cluster.config import load_config
    from cluster.planning.plan import plan

    cfg = load_config(config, overrides)
    return plan(cfg)["memory"]["host_ram_gib"]["per_process"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default="configs/tiny_moe.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.5)
    args = ap.parse_intermixed_args()
    plan_gib = planned(args.config, args.overrides)
    out = tempfile.mkdtemp(prefix="memory-plan-")
    cmd = [sys.executable, "-m", "cluster.train", args.config, *args.overrides,
           f"trainer.total_steps={args.steps}", "trainer.eval_every=0", "trainer.save_every=0",
           f"trainer.output_dir={out}", "wandb.mode=disabled"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(out, "stderr.log"), "w"))
    seen = sample(proc, args.interval)
    if proc.returncode:
        print(json.dumps({"error": f"run exited {proc.returncode}", "log": os.path.join(out, "stderr.log")}))
        return 1
    for role in ("learner_rank", "engine", "reward_worker", "driver"):
        recs = [r for r in seen.values() if r["role"] == role]
        if not recs:
            continue
        top = max(recs, key=lambda r: r["hwm_kib"])
        peak = top["hwm_kib"] / 2**20
        row = {"role": role, "processes": len(recs), "planned_gib": plan_gib.get(role),
               "measured_peak_gib": round(peak, 2), "shared_at_peak_gib": round(top["shmem_kib"] / 2**20, 2),
               "all_peaks_gib": sorted(round(r["hwm_kib"] / 2**20, 2) for r in recs)}
        if plan_gib.get(role):
            row["measured_over_planned"] = round(peak / plan_gib[role], 2)
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
