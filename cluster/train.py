"""The driver's command line: ``python -m cluster.train CONFIG [dotted.key=value ...] [--dry-run] [--verbose]``
(installed as ``gspo-train``).

Validates the config, then either prints the resolved config and placement plan (``--dry-run``) or runs the
job (``cluster.trainer.Trainer``: services up, warm start, RL steps, checkpoints). Relative paths (the config
file, ``trainer.output_dir``, a ``model.path`` folder) are taken from the working directory, so it runs from
any folder. The terminal shows the run's own progress and errors; the services' output goes to
``<run>/logs/`` (``cluster.console``) unless ``--verbose``. Exit codes: 0 done, 2 bad config or plan (or a
config the checkpoint to resume from refuses, or a user verifier that does not import), 3 a learner rank died
(resume from the last checkpoint), 4 the health guard stopped the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import yaml

from cluster import console
from cluster.checkpoint import latest_checkpoint
from cluster.config import Config, ConfigError, load_config
from cluster.plan import cpu_oversubscription, plan
from cluster.user_code import check_user_verifiers, verifier_names


def is_learner_error(err: Exception) -> bool:
    """True when a Ray actor error comes from a learner rank."""
    return "LearnerRank" in str(err)


def absolute_paths(cfg: Config, cwd: Path | None = None) -> Config:
    """Make the run's relative paths absolute against ``cwd`` (default: the working directory), in place:
    ``trainer.output_dir`` and ``model.path`` unless it is ``builtin:...`` or a hub id (``cluster.hub_model``).
    (The data files resolve in ``cluster.data``.) Returns ``cfg``."""
    cwd = (cwd or Path.cwd()).resolve()
    if not Path(cfg.trainer.output_dir).is_absolute():
        cfg.trainer.output_dir = str(cwd / cfg.trainer.output_dir)
    from cluster.hub_model import is_hub_id

    local = not cfg.model.path.startswith("builtin:") and not is_hub_id(cfg.model.path, cwd)
    if local and not Path(cfg.model.path).is_absolute():
        cfg.model.path = str(cwd / cfg.model.path)
    return cfg


def _local_cpu_warning(cfg: Config) -> str | None:
    """``plan.cpu_oversubscription`` against this machine's cores, for a run that starts its own Ray."""
    if cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS"):
        return None
    return cpu_oversubscription(cfg, len(os.sched_getaffinity(0)))


def main(argv: list[str] | None = None) -> int:
    """The ``gspo-train`` command (``python -m cluster.train``); returns the exit code."""
    parser = argparse.ArgumentParser(prog="gspo-train", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML config (configs/*.yaml); a relative path is from the working directory")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and placement plan, start nothing")
    parser.add_argument("--verbose", action="store_true",
                        help="show the services' own output (vLLM, torch, DeepSpeed) on the terminal too; by default "
                        "it goes to <run>/logs/")
    args = parser.parse_intermixed_args(argv)  # options may stand between the overrides
    console.setup_driver_logging(None, args.verbose)
    try:
        cfg = absolute_paths(load_config(args.config, args.overrides))
        # The configured user verifiers import now (the data rows' own ones once the data is read).
        check_user_verifiers(verifier_names(cfg))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        try:
            resources = plan(cfg, gpu_memory_gib=cfg.cluster.gpu_memory_gib, gpus_per_node=cfg.cluster.gpus_per_node)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(yaml.safe_dump({"config": cfg.model_dump(mode="json"), "plan": resources}, sort_keys=False))
        if warning := _local_cpu_warning(cfg):
            print(f"warning: {warning}", file=sys.stderr)
        return 0
    # The run's modules import Ray, torch and transformers: only here, so that --dry-run (and a
    # config error) answers in a second without them.
    import ray

    from cluster.trainer import HealthStop, Trainer

    logs = console.setup_driver_logging(cfg.run_dir, args.verbose)
    if not args.verbose:
        print(f"logs: {logs} (the services' output; --verbose shows it here)", file=sys.stderr)
    if warning := _local_cpu_warning(cfg):
        logging.getLogger("cluster.train").warning(warning)
    trainer = Trainer(cfg, verbose=args.verbose)
    try:
        trainer.start()
        summary = trainer.run()
    except HealthStop as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    except ConfigError as e:  # found at start-up: e.g. a resume the checkpoint refuses (cluster.checkpoint)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if isinstance(e, ray.exceptions.RayActorError) and is_learner_error(e):
            ck = latest_checkpoint(trainer.run_dir)
            where = f"the last checkpoint is {ck}" if ck else "no checkpoint was written yet"
            print(f"error: a learner rank died at step {trainer.step + 1} ({type(e).__name__}); the run stops. "
                  f"Resume with trainer.resume=true: {where}.", file=sys.stderr)
            return 3
        raise
    finally:
        trainer.shutdown()
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
