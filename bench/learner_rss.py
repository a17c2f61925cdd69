"""Run a command (a training run) and report the peak resident memory of its learner ranks and its wall time.

Usage::

    python bench/learner_rss.py --out rss.json -- python -m cluster.train configs/tiny_moe.yaml learner.algorithm=ppo

Every ``--interval`` seconds it reads ``VmHWM`` (the kernel's own peak resident set size of a process, so a peak
between two samples is not missed; only growth in the last interval before a rank exits can be) of every
process descending from the command whose command line starts with ``ray::LearnerRank`` (the title Ray
gives a ``LearnerRank`` actor's process; a rank's own forked children are left out). Prints, and writes to
``--out``, one JSON object: ``wall_s``, ``rc``, ``learner_peak_rss_mib`` per pid and their ``max`` and ``sum``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TITLE = b"ray::LearnerRank"


def _status(pid: str) -> dict[str, str]:
    """``/proc/<pid>/status`` as a dict ({} when the process is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _is_rank(pid: str) -> bool:
    """Whether process ``pid``'s command line starts with ``ray::LearnerRank`` (False when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(TITLE)
    except OSError:
        return False


def learner_peaks(root: int) -> dict[int, int]:
    """``{pid: VmHWM in KiB}`` of the descendants of ``root`` whose command line starts with
    ``ray::LearnerRank`` (the run's own Ray head is started by its driver, so its workers descend from it;
    other jobs' learners on a shared machine do not), leaving out a rank's forked children (they inherit its
    title and its peak at the fork)."""
    status = {p.name: _status(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    out: dict[int, int] = {}
    for pid, st in status.items():
        if not _is_rank(pid) or _is_rank(st.get("PPid", "0")):  # a rank's own forked child is not a rank
            continue
        parent, seen = st.get("PPid", "0"), 0
        while parent not in ("0", "1", str(root)) and seen < 64:
            parent, seen = status.get(parent, {}).get("PPid", "0"), seen + 1
        if parent == str(root) and "VmHWM" in st:
            out[int(pid)] = int(st["VmHWM"].split()[0])
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the command after ``--``, sample, print the JSON report; returns the command's exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        parser.error("give the command after --")
    peaks: dict[int, int] = {}
    start = time.monotonic()
    proc = subprocess.Popen(cmd)
    while proc.poll() is None:
        for pid, kib in learner_peaks(proc.pid).items():
            peaks[pid] = max(peaks.get(pid, 0), kib)
        time.sleep(args.interval)
    mib = {str(pid): round(kib / 1024, 1) for pid, kib in sorted(peaks.items())}
    report = {"command": cmd, "rc": proc.returncode, "wall_s": round(time.monotonic() - start, 1),
              "learner_peak_rss_mib": mib, "max_mib": max(mib.values(), default=0.0),
              "sum_mib": round(sum(mib.values()), 1)}
    text = json.dumps(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
