"""The driver's command line: ``python -m cluster.train CONFIG [dotted.key=value ...] [--dry-run] [--verbose]``
(installed as ``gspo-train``).

Validates the config, then either prints the resolved config and placement plan (``--dry-run``) or runs the
job (``cluster.driver.trainer.Trainer``: services up, warm start, RL steps, checkpoints). Relative paths (the config
file, ``trainer.output_dir``, a ``model.path`` folder) are taken from the working directory, so it runs from
any folder. The terminal shows the run's own progress and errors; the services' output goes to
``<run>/logs/`` (``cluster.runtime.console``) unless ``--verbose``. Exit codes: 0 done, 2 bad config or plan (or a
config the checkpoint to resume from refuses, or a user verifier that does not import, or a node that does not
see the driver's files), 3 a learner rank died (resume from the last checkpoint), 4 the health guard stopped the
run, 5 an actor found no node with room within cluster.placement_timeout_s (a node lost; resume later).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import yaml

from cluster.runtime import console
from cluster.driver.checkpoint import latest_checkpoint
from cluster.config import Config, ConfigError, absolute_paths, load_config
from cluster.planning.actor_placement import cpu_oversubscription
from cluster.planning.plan import plan
from cluster.runtime.user_code import check_user_verifiers, verifier_names


def is_learner_error(err: Exception) -> bool:
    """True when a Ray actor error comes from a learner rank."""
    return "LearnerRank" in str(err)


def learner_lost(trainer, err: Exception, timeout_s: float = 30.0) -> bool:
    """True when a learner rank is gone (its node or process lost) as ``err`` (a Ray error) stops the run: the
    rank's own ``RayActorError``, or any other error of the step (a surviving peer's collective error,
    "Connection closed by peer"; an ``ActorUnavailableError`` that names no class) while a rank does not answer
    a ping within ``timeout_s``. A learner's own bug, every rank alive, is False."""
    import ray

    if isinstance(err, ray.exceptions.RayActorError) and is_learner_error(err):
        return True
    learners = trainer.learners
    if learners is None or not learners.actors:
        return False
    try:
        ray.get([a.pid.remote() for a in learners.actors], timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a rank that does not answer is the answer
        return True
    return False


def _local_cpu_warning(cfg: Config) -> str | None:
    """``actor_placement.cpu_oversubscription`` against this machine's cores, for a run that starts its own Ray."""
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
            if cfg.trainer.ray_address:  # the live cluster must offer the *.node_resources (cluster.runtime.placement)
                from cluster.runtime.placement import check_live_cluster

                resources["live_nodes"] = check_live_cluster(cfg, cfg.trainer.ray_address)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(yaml.safe_dump({"config": cfg.model_dump(mode="json"), "precision": cfg.precision_report,
                              "plan": resources}, sort_keys=False))
        if warning := _local_cpu_warning(cfg):
            print(f"warning: {warning}", file=sys.stderr)
        return 0
    # The run's modules import Ray, torch and transformers: only here, so that --dry-run (and a
    # config error) answers in a second without them.
    import ray

    from cluster.driver.guard import HealthStop
    from cluster.driver.trainer import Trainer
    from cluster.runtime.deadlines import PhaseTimeout
    from cluster.runtime.services import PlacementTimeout

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
    except ConfigError as e:  # found at start-up: e.g. a resume the checkpoint refuses (cluster.driver.checkpoint)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if isinstance(e, PlacementTimeout):  # no node with room (a node was lost): cluster.runtime.services.wait_ready
            ck = latest_checkpoint(trainer.run_dir)
            where = f"the last checkpoint is {ck}" if ck else "no checkpoint was written yet"
            print(f"error: {e}\nThe run stops at step {trainer.step + 1}; {where}: resume with "
                  "trainer.resume=true once the cluster has room.", file=sys.stderr)
            return 5
        if isinstance(e, PhaseTimeout):  # an actor past its deadline (cluster.runtime.deadlines): named, stacks logged
            ck = latest_checkpoint(trainer.run_dir)
            where = f"the last checkpoint is {ck}" if ck else "no checkpoint was written yet"
            print(f"error: {e}\nThe run stops; {where}: resume with trainer.resume=true.", file=sys.stderr)
            return 6
        if isinstance(e, ray.exceptions.RayError) and learner_lost(trainer, e):
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
