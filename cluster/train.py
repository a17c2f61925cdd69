"""The driver's command line: ``python -m cluster.train CONFIG [dotted.key=value ...] [--dry-run]``.

Validates the config, then either prints the resolved config and placement plan (``--dry-run``) or runs the
job (``cluster.trainer.Trainer``: services up, warm start, RL steps, checkpoints). Exit codes: 0 done, 2 bad
config or plan (or a config the checkpoint to resume from refuses), 3 a learner rank died (resume from the
last checkpoint), 4 the health guard stopped the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import yaml

from cluster.checkpoint import latest_checkpoint
from cluster.config import ConfigError, load_config
from cluster.plan import plan


def is_learner_error(err: Exception) -> bool:
    """True when a Ray actor error comes from a learner rank."""
    return "LearnerRank" in str(err)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.train", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML config (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and placement plan, start nothing")
    args = parser.parse_intermixed_args(argv)  # options may stand between the overrides
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        cfg = load_config(args.config, args.overrides)
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
        return 0
    # The run's modules import Ray, torch and transformers: only here, so that --dry-run (and a
    # config error) answers in a second without them.
    import ray

    from cluster.trainer import HealthStop, Trainer

    trainer = Trainer(cfg)
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
