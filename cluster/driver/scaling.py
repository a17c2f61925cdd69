"""Scaling between steps: ``<run_dir>/control.yaml`` may set ``rollout.num_engines``, ``reward.num_workers`` and,
for multi-turn episodes, ``env.num_workers`` (for example ``rollout.num_engines: 4`` when the cluster gained nodes). The file is read before every step; new
engines start with the current weights, surplus ones are stopped after finishing their work (nothing is in
flight between steps). A file that does not parse, or a count below 1, is ignored with a warning."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("cluster.train")

CONTROL_FILE = "control.yaml"


def apply_control(run_dir: Path, fleet: Any, rewards: Any, envs: Any = None) -> None:
    """Resize ``fleet`` (``cluster.runtime.services.EngineFleet``), ``rewards`` (``reward.pool.RewardPool``) and
    ``envs`` (``cluster.driver.env_pool.EnvPool``, or None without episodes) to what ``run_dir/control.yaml``
    asks for, if anything."""
    path = run_dir / CONTROL_FILE
    if not path.is_file():
        return
    try:
        wanted = yaml.safe_load(path.read_text()) or {}
        engines = int(wanted.get("rollout.num_engines", len(fleet)))
        workers = int(wanted.get("reward.num_workers", rewards.num_workers))
        env_workers = int(wanted.get("env.num_workers", len(envs) if envs is not None else 0))
    except (yaml.YAMLError, TypeError, ValueError, AttributeError) as e:
        log.warning("ignoring %s: %s", path, e)
        return
    if engines != len(fleet):
        if engines < 1:
            log.warning("ignoring %s: rollout.num_engines=%d must be >= 1", path, engines)
        else:
            log.info("scaling rollout engines %d -> %d", len(fleet), engines)
            fleet.resize(engines)
    if workers != rewards.num_workers and workers >= 1:
        log.info("scaling reward workers %d -> %d", rewards.num_workers, workers)
        rewards.resize(workers)
    if envs is not None and env_workers != len(envs):
        if env_workers < 1:
            log.warning("ignoring %s: env.num_workers=%d must be >= 1", path, env_workers)
        else:
            log.info("scaling env workers %d -> %d", len(envs), env_workers)
            envs.resize(env_workers)
