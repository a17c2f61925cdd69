"""Which device each service runs on, from the config, and what a run actually used.

- ``learner_first``: whether the learner must finish building before the engines start (a shared GPU).
- ``record``: after a run, every learner rank's and engine's report of where its state lives, with what the
  ``precision`` switch chose, written to ``<run_dir>/devices.json`` (``cluster.tools.gpu_smoke`` reads it).
- ``device_problems``: that report against the config (a GPU run whose learner or engines ran on the CPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: the report's file name in the run folder
DEVICES_FILE = "devices.json"


def learner_first(cfg) -> bool:
    """Whether the learner ranks must be built before the first engine starts: when both hold GPUs.

    vLLM sizes an engine's KV cache from the memory it finds at start-up (``gpu_memory_utilization`` x the
    device, checked against the memory free then, and its profiling run measures what it allocates itself);
    a learner still allocating its partitions on the same GPU meanwhile makes that check pass on memory the
    learner then takes (an out-of-memory error later) or vLLM's profiling assert on memory that changed under
    it. Built first, the learner's memory is in use when vLLM looks, so an engine that does not fit refuses at
    start. verl's hybrid worker does the same on its shared GPUs (``ActorRolloutRefWorker.init_model`` builds the
    FSDP actor and its optimizer, then the rollout engine).
    On the CPU nothing is shared this way and both start together (faster).
    """
    return cfg.learner.num_gpus_per_rank > 0 and cfg.rollout.num_gpus_per_engine > 0


def record(learners, fleet, path: Path, precision: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ask every learner rank (``LearnerRank.devices``) and engine (``RolloutEngine.device_report``) where it
    runs, write ``{"learner": [...per rank], "engines": [...per engine], "precision": precision}`` to ``path`` as
    JSON and return it; ``precision`` is the config's ``precision_report`` (what the ``precision`` switch chose
    and set, ``cluster.precision.resolve``), left out when None. Collective over the learner ranks (a local call
    on each, no communication)."""
    import ray

    report = {"learner": learners.call("devices"),
              "engines": ray.get([e.device_report.remote() for e in fleet.engines])}
    if precision is not None:
        report["precision"] = precision
    Path(path).write_text(json.dumps(report, indent=1))
    return report


def device_problems(report: dict[str, Any], cfg) -> list[str]:
    """What in ``report`` (``record``'s) contradicts the config: every learner rank's parameters and master
    weights on ``cuda`` when ``learner.num_gpus_per_rank > 0`` (else ``cpu``), its optimizer state on the CPU
    with ``learner.offload_optimizer='cpu'`` and beside the master weights otherwise, its process group NCCL
    on GPUs; every engine's weights on ``cuda`` when ``rollout.num_gpus_per_engine > 0``. Empty: all agree.

    Raises:
        ValueError: the report has no learner rank or no engine.
    """
    if not report.get("learner") or not report.get("engines"):
        raise ValueError(f"device report without learner ranks or engines: {report!r}")
    lc, rc = cfg.learner, cfg.rollout
    want = "cuda" if lc.num_gpus_per_rank > 0 else "cpu"
    want_opt = "cpu" if lc.offload_optimizer == "cpu" else want
    problems = []
    for rank, r in enumerate(report["learner"]):
        for key, expected in (("params", want), ("master", want_opt), ("optimizer_state", want_opt)):
            if r[key] and r[key] != [expected]:
                problems.append(f"learner rank {rank}: {key} on {r[key]}, expected {expected}")
        if not r["optimizer_state"]:
            problems.append(f"learner rank {rank}: no optimizer state (no optimizer step ran)")
        backend = "nccl" if want == "cuda" else "gloo"
        if r.get("backend") != backend:
            problems.append(f"learner rank {rank}: process group {r.get('backend')!r}, expected {backend!r}")
    engine_want = "cuda" if rc.num_gpus_per_engine > 0 else "cpu"
    for i, e in enumerate(report["engines"]):
        if e["weights"] != [engine_want]:
            problems.append(f"engine {i}: weights on {e['weights']}, expected {engine_want}")
    return problems
