"""Equal-budget comparison: ``python -m cluster.compare CONFIG --algorithms gspo,grpo[,grpo_rr,grpo_r3,gspo_mc,dapo,
cispo,sapo,gmpo,dr_grpo,...] [--arm "NAME: key=value ..."] [--seeds K] [--name NAME] [dotted.key=value ...]``
(also ``make compare CONFIG=... ARGS=...``).

Trains the same config once per algorithm and seed, one run after the other in this process (a ``Trainer``
each, Ray shut down between runs), and writes ``<output-dir>/<name>/report.md`` (a table with mean and spread
over seeds), ``curves.png`` (the runs overlaid) and ``results.json``; each run's own folder (metrics.jsonl,
checkpoints, plots) is ``<output-dir>/<name>/runs/<algorithm>_seed<k>``.

What is held equal within a seed: the model and its supervised warm start (run once, by the seed's first run,
saved as a checkpoint that the other algorithms resume from), the prompt stream and sampling seeds
(``trainer.seed`` and ``rollout.seed`` are the config's plus ``k``), rollouts per step, the reward and the
response length limit. With ``--shared-warm-start`` every seed resumes from one warm start (seed 0's) and keeps
the config's ``trainer.seed`` (the prompt order, which a checkpoint's stream position fixes); only the sampling
seed ``rollout.seed`` moves with ``k``: the spread is then RL's own, not the warm start's. What differs is only
the objective:

- ``gspo``: ``learner.algorithm=gspo`` with the paper's clip range (3e-4 / 4e-4 unless the config is a GSPO
  config with its own) and the sequence-mean loss;
- ``grpo``: token-level ratios, clip 0.2 / 0.27 (the GSPO paper's GRPO baseline), our default token-mean loss;
- ``grpo_rr``: ``grpo`` with ``learner.routing_replay=learner`` (R2: the learner's own pre-update experts; MoE
  models; skipped with a note when the learner or the model does not support it);
- ``grpo_r3``: ``grpo`` with ``learner.routing_replay=rollout`` and ``rollout.return_routed_experts=true`` (R3:
  the experts the rollout engine ran; skipped like ``grpo_rr``);
- ``gspo_mc``: ``gspo`` with ``learner.rollout_correction=seq_geo_rs`` (geometric-mean rejection of sequences
  whose train-vs-engine ratio leaves ``[learner.rollout_correction_low, _high]``, from the config);
- ``dapo``: ``grpo`` with clip 0.2 / 0.28, ``loss_agg=token_mean`` and dynamic sampling
  (``trainer.dynamic_sampling=true``);
- any other loss of the registry (``gspo_token``, ``cispo``, ``sapo``, ``gmpo``, ``dr_grpo``, or a user's
  ``module.path:function``): ``learner.algorithm=<name>`` with that loss's own defaults (clip range,
  aggregation, ``loss_options``, advantage normalisation: ``learner/loss_settings.py``);
- ``--arm "NAME: key=value key=value"``: an arm that is the config plus those overrides and nothing else
  (e.g. ``--arm "lora8: learner.lora.rank=8"`` or ``--arm "ppo: learner.algorithm=ppo"``), so an option that
  is not a loss can be compared on the same footing.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from cluster.compare.report import DEFAULT_SPIKE_FACTOR, RunResult, _row_values, plot_runs, write_report
from cluster.config import Config, ConfigError, absolute_paths, load_config

log = logging.getLogger("cluster.compare")

ALGORITHMS = ("gspo", "grpo", "grpo_rr", "grpo_r3", "gspo_mc", "dapo")
REPLAY_ARMS = ("grpo_rr", "grpo_r3")  # skipped with a note when the learner refuses Routing Replay

_DESCRIPTIONS = {
    "gspo": "GSPO: sequence ratio, clip {clip}, {agg}",
    "grpo": "GRPO: token ratios, clip {clip}, {agg}",
    "grpo_rr": "GRPO + Routing Replay (R2, learner's experts): token ratios, clip {clip}, {agg}",
    "grpo_r3": "GRPO + rollout Routing Replay (R3, engine's experts): token ratios, clip {clip}, {agg}",
    "gspo_mc": "GSPO + geometric-mean mismatch rejection: sequence ratio, clip {clip}, {agg}",
    "dapo": "DAPO: token ratios, clip {clip}, {agg}, dynamic sampling",
}


# ------------------------------------------------------------------------------------------------ configs


def routing_replay_supported() -> tuple[bool, str]:
    """Whether the learner's config has ``routing_replay`` (the option may not exist in every version)."""
    from learner.config import LearnerConfig

    if "routing_replay" in LearnerConfig.model_fields:
        return True, ""
    return False, "learner.routing_replay is not an option of this learner (Routing Replay not implemented)"


def registry_arm(name: str) -> bool:
    """Whether ``name`` is an arm run as ``learner.algorithm=<name>`` with the loss's own defaults: a built-in
    loss without its own arm above, or a user's ``module.path:function``."""
    from learner.loss_settings import BUILTIN_LOSSES, is_user_loss

    return name not in ALGORITHMS and (name in BUILTIN_LOSSES or is_user_loss(name))


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``"NAME: key=value key=value"`` -> ``(NAME, [key=value, ...])``.

    Raises:
        ValueError: no name, a name with characters other than letters, digits, ``_``, ``-`` and ``.``, or an
            override without ``=``; the message quotes the argument.
    """
    name, sep, rest = text.partition(":")
    name, overrides = name.strip(), rest.split()
    if not sep or not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"--arm {text!r}: write 'NAME: key=value [key=value ...]' (NAME: letters, digits, _ - .)")
    bad = [o for o in overrides if "=" not in o]
    if not overrides or bad:
        raise ValueError(f"--arm {text!r}: give dotted key=value overrides after the name (not {bad or 'none'})")
    return name, overrides


def algorithm_overrides(algorithm: str, base: Config, arms: dict[str, list[str]] | None = None) -> list[str]:
    """The dotted overrides that turn ``base`` into ``algorithm``'s run (see the module docstring); an arm of
    ``arms`` is its own overrides only.

    Raises:
        ValueError: an unknown algorithm name.
    """
    if arms and algorithm in arms:
        return list(arms[algorithm])
    if registry_arm(algorithm):
        return [f"learner.algorithm={algorithm}", "learner.clip_low=null", "learner.clip_high=null",
                "learner.loss_agg=null", "learner.loss_options={}", "learner.normalize_adv_std=null",
                "trainer.dynamic_sampling=false"] + (
                    ["learner.rollout_correction=off"] if routing_replay_supported()[0] else [])
    rr = (["learner.routing_replay=off", "rollout.return_routed_experts=false", "learner.rollout_correction=off"]
          if routing_replay_supported()[0] else [])
    if algorithm in ("gspo", "gspo_mc"):
        out = ["learner.algorithm=gspo", "learner.loss_agg=null", "trainer.dynamic_sampling=false"]
        if base.learner.algorithm not in ("gspo", "gspo_token"):
            out += ["learner.clip_low=null", "learner.clip_high=null"]  # the paper's defaults
        return out + rr + (["learner.rollout_correction=seq_geo_rs"] if algorithm == "gspo_mc" else [])
    grpo = ["learner.algorithm=grpo", "learner.clip_low=0.2", "learner.clip_high=0.27", "learner.loss_agg=null",
            "trainer.dynamic_sampling=false"]
    if algorithm == "grpo":
        return grpo + rr
    if algorithm == "grpo_rr":
        return grpo + rr + ["learner.routing_replay=learner"]
    if algorithm == "grpo_r3":
        return grpo + rr + ["learner.routing_replay=rollout", "rollout.return_routed_experts=true"]
    if algorithm == "dapo":
        return ["learner.algorithm=grpo", "learner.clip_low=0.2", "learner.clip_high=0.28",
                "learner.loss_agg=token_mean", "trainer.dynamic_sampling=true"] + rr
    raise ValueError(f"algorithm {algorithm!r} is not one of {ALGORITHMS}")


def run_overrides(algorithm: str, seed_index: int, base: Config, runs_dir: Path,
                  shared_warm_start: bool = False, arms: dict[str, list[str]] | None = None) -> list[str]:
    """Output folder, run name, seeds (config's + ``seed_index``; ``trainer.seed`` stays the config's with a
    shared warm start) and the algorithm's settings."""
    return [
        f"trainer.output_dir={runs_dir}",
        f"trainer.run_name={algorithm}_seed{seed_index}",
        f"trainer.seed={base.trainer.seed + (0 if shared_warm_start else seed_index)}",
        f"rollout.seed={base.rollout.seed + seed_index}",
        "trainer.resume=false",
    ] + algorithm_overrides(algorithm, base, arms)


def _settings(cfg: Config) -> str:
    from learner.objectives import resolve_objective

    lc = cfg.learner
    obj = resolve_objective(lc.algorithm, lc.clip_low, lc.clip_high, lc.loss_agg, lc.loss_options)
    return obj.describe() + ("" if lc.advantage_std() else ", advantages not std-normalised") + (
        f", routing replay {lc.routing_replay}" if getattr(lc, "routing_replay", "off") != "off" else "") + (
        f", {lc.rollout_correction} [{lc.rollout_correction_low:g}, {lc.rollout_correction_high:g}]"
        if getattr(lc, "rollout_correction", "off") != "off" else "") + (
        ", dynamic sampling" if cfg.trainer.dynamic_sampling else "")


# ----------------------------------------------------------------------------------------------- one run


def _copy_checkpoint(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)


def run_one(cfg: Config, algorithm: str, seed_index: int, warm_dir: Path) -> RunResult:
    """Start a ``Trainer`` for ``cfg``, train it, shut everything down (Ray included).

    The warm start: when ``warm_dir`` holds a checkpoint (an earlier algorithm of this seed wrote it) it is
    copied into the run's checkpoints and resumed from; otherwise this run does the warm start, saves it and
    copies it to ``warm_dir`` for the next algorithms.
    """
    import ray

    from cluster.driver import checkpoint
    from cluster.driver.trainer import Trainer

    shared = checkpoint.latest_checkpoint(warm_dir) if warm_dir.is_dir() else None
    if shared is not None and cfg.warm_start.steps > 0:
        run_dir = cfg.run_dir.resolve()
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a fresh run: no metrics or checkpoints from an earlier invocation
        _copy_checkpoint(shared, checkpoint.checkpoint_root(run_dir) / shared.name)
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"resume": True})})
    elif cfg.run_dir.resolve().exists():
        shutil.rmtree(cfg.run_dir.resolve())
    result = RunResult(algorithm, seed_index, str(cfg.run_dir.resolve()), "ok", settings=_settings(cfg))
    trainer = Trainer(cfg)
    try:
        try:
            trainer.start()
        except Exception as e:  # noqa: BLE001 - a start-up refusal of Routing Replay is a skip, not a failure
            if algorithm in REPLAY_ARMS and "routing_replay" in str(e):
                result.status, result.note = "skipped", f"the learner refused Routing Replay: {_first_line(e)}"
                return result
            raise
        if cfg.warm_start.steps > 0 and not trainer.state.warm_start_done:
            result.warm_start = trainer.warm_start()
            saved = trainer.save()
            _copy_checkpoint(saved, checkpoint.checkpoint_root(warm_dir) / saved.name)
        t = time.perf_counter()
        result.summary = trainer.run()
        result.wall_s = time.perf_counter() - t
        result.history = list(trainer.logger.history)
    except Exception as e:  # noqa: BLE001 - one failed run must not lose the others
        log.exception("run %s seed %d failed", algorithm, seed_index)
        result.status, result.note = "failed", f"{type(e).__name__}: {_first_line(e)}"
        if getattr(trainer, "logger", None) is not None:
            result.history = list(trainer.logger.history)
    finally:
        trainer.shutdown()
        ray.shutdown()
    return result


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[-1][:300] if text else type(e).__name__


# -------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """The ``gspo-compare`` command (``python -m cluster.compare``); relative paths are from the working
    directory. Returns the exit code."""

    parser = argparse.ArgumentParser(prog="gspo-compare", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML config (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides applied to every run")
    parser.add_argument("--algorithms", default="gspo,grpo",
                        help=f"comma-separated, from {', '.join(ALGORITHMS)} or any registered loss "
                        "(cispo, sapo, gmpo, dr_grpo, gspo_token, module.path:function); '' for --arm only")
    parser.add_argument("--arm", action="append", default=[], metavar='"NAME: key=value ..."',
                        help="an arm that is the config plus these overrides (repeatable), e.g. "
                        '"lora8: learner.lora.rank=8"')
    parser.add_argument("--seeds", type=int, default=1, help="seeds per algorithm (trainer.seed and rollout.seed + k)")
    parser.add_argument("--shared-warm-start", action="store_true",
                        help="one warm start for every seed (seed 0's); only rollout.seed moves with the seed")
    parser.add_argument("--seed-index", type=int, default=None, metavar="K",
                        help="run only seed K (0 <= K < --seeds), one command per run; reuses a saved warm start")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: write the report from the runs earlier commands saved")
    parser.add_argument("--name", default=None, help="report folder name (default: the config's file name)")
    parser.add_argument("--output-dir", default="outputs/compare", help="parent of the report folder")
    parser.add_argument("--spike-factor", type=float, default=DEFAULT_SPIKE_FACTOR,
                        help="a step is a grad-norm spike above this x the run's median grad norm")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    algos = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    try:
        arms = dict(parse_arm(text) for text in args.arm)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    unknown = [a for a in algos if a not in ALGORITHMS and not registry_arm(a)]
    names = algos + list(arms)
    if not names or unknown or len(set(names)) != len(names) or len(arms) != len(args.arm):
        print(f"error: --algorithms={args.algorithms!r} --arm {args.arm!r}: give distinct names from "
              f"{', '.join(ALGORITHMS)}, a registered loss or an arm", file=sys.stderr)
        return 2
    algos = names
    if args.seeds < 1:
        print(f"error: --seeds={args.seeds} must be >= 1", file=sys.stderr)
        return 2
    if args.seed_index is not None and not (0 <= args.seed_index < args.seeds and not args.report_only):
        print(f"error: --seed-index={args.seed_index} must be in [0, --seeds={args.seeds}) and not with "
              "--report-only", file=sys.stderr)
        return 2
    if not (args.spike_factor > 0 and math.isfinite(args.spike_factor)):
        print(f"error: --spike-factor={args.spike_factor} must be a finite number > 0", file=sys.stderr)
        return 2
    name = args.name or Path(args.config).stem
    out_dir = Path(args.output_dir) / name
    runs_dir = (out_dir / "runs").resolve()
    try:
        base = absolute_paths(load_config(args.config, args.overrides))
        # Every run's config is checked before the first one starts.
        configs = {(a, k): absolute_paths(load_config(args.config, args.overrides + run_overrides(
                       a, k, base, runs_dir, args.shared_warm_start, arms)))
                   for k in range(args.seeds) for a in algos if not (a in REPLAY_ARMS and not routing_replay_supported()[0])}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)

    seeds = range(args.seeds) if args.seed_index is None else [args.seed_index]
    one_run_mode = args.seed_index is not None or args.report_only
    results: dict[tuple[str, int], RunResult] = {}
    if one_run_mode:
        try:
            results = saved_results(runs_dir, algos, args.seeds, args.config, args.overrides)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for k in [] if args.report_only else seeds:
        warm_dir = out_dir.resolve() / "warm_start" / ("shared" if args.shared_warm_start else f"seed{k}")
        if warm_dir.exists() and (k == 0 or not args.shared_warm_start) and not one_run_mode:
            shutil.rmtree(warm_dir)  # this invocation's warm start, not an earlier one's
        for a in algos:
            if (a, k) not in configs:
                results[(a, k)] = RunResult(a, k, "", "skipped", routing_replay_supported()[1])
                log.warning("%s seed %d skipped: %s", a, k, results[(a, k)].note)
                continue
            log.info("=== %s, seed %d ===", a, k)
            r = results[(a, k)] = run_one(configs[(a, k)], a, k, warm_dir)
            log.info("%s seed %d: %s %s", a, k, r.status, r.note)
            if r.run_dir:
                save_result(r, args.config, args.overrides)
            # Write after every run: a long comparison shows its progress and keeps what is done.
            _write_outputs(out_dir, _ordered(results, algos, args.seeds), args, base, algos)
    ordered = _ordered(results, algos, args.seeds)
    _write_outputs(out_dir, ordered, args, base, algos)
    print(f"report: {out_dir / 'report.md'}")
    return 1 if any(r.status == "failed" for r in ordered) else 0


RESULT_FILE = "compare_result.json"  # a run's record (without its history), beside its metrics.jsonl


def save_result(r: RunResult, config_path: str, overrides: list[str]) -> Path:
    """Write ``r`` (less its history, which is the run's ``metrics.jsonl``) and the study's config path and
    overrides to ``<run_dir>/compare_result.json`` (write, then rename). Returns the file."""
    d = asdict(r)
    d.pop("history")
    d["study"] = {"config": str(Path(config_path).resolve()), "overrides": list(overrides)}
    path = Path(r.run_dir) / RESULT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(d, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def saved_results(runs_dir: Path, algos: list[str], seeds: int, config_path: str,
                  overrides: list[str]) -> dict[tuple[str, int], RunResult]:
    """The runs earlier commands of this study saved (``runs/<arm>_seed<k>/compare_result.json`` with the
    history read back from the run's ``metrics.jsonl``), keyed ``(arm, k)``; runs not saved are absent.

    Raises:
        ValueError: a saved run whose config path or overrides differ from this command's (naming both).
    """
    study = {"config": str(Path(config_path).resolve()), "overrides": list(overrides)}
    out: dict[tuple[str, int], RunResult] = {}
    for k in range(seeds):
        for a in algos:
            path = runs_dir / f"{a}_seed{k}" / RESULT_FILE
            if not path.is_file():
                continue
            d = json.loads(path.read_text())
            if d.pop("study", None) != study:
                raise ValueError(f"{path}: saved by a study of {d.get('study')!r}, not this command's {study!r}; "
                                 "give the same config and overrides, or another --name")
            d.pop("figures", None)
            metrics = Path(d["run_dir"]) / "metrics.jsonl"
            history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
                if metrics.is_file() else []
            out[(a, k)] = RunResult(**d, history=history)
    return out


def _ordered(results: dict[tuple[str, int], RunResult], algos: list[str], seeds: int) -> list[RunResult]:
    """Seed-major, arms in the command's order; a run neither saved nor run is listed as not run."""
    return [results.get((a, k)) or RunResult(a, k, "", "skipped", "not run (no saved result)")
            for k in range(seeds) for a in algos]


def _write_outputs(out_dir: Path, results: list[RunResult], args, base: Config, algos: list[str]) -> None:
    t, ro = base.trainer, base.rollout
    shared = {
        "model": base.model.path,
        "warm start": f"{base.warm_start.steps} steps (" + ("one checkpoint shared by every seed; trainer.seed "
                      "fixed, rollout.seed + k" if args.shared_warm_start else "one checkpoint per seed") + ")",
        "RL steps": t.total_steps,
        "prompts/step": t.prompts_per_step,
        "rollouts/prompt": t.group_size,
        "max response tokens": ro.max_response_tokens,
        "temperature": ro.temperature,
        "minibatches/step": base.learner.num_minibatches,
        "seeds": args.seeds,
    }
    write_report(out_dir, results, config_path=args.config, overrides=args.overrides, shared=shared,
                 spike_factor=args.spike_factor)
    plot_runs(results, out_dir / "curves.png")
    payload = []
    for r in results:
        d = asdict(r)
        d.pop("history")
        d["figures"] = _row_values(r, args.spike_factor)
        payload.append(d)
    (out_dir / "results.json").write_text(json.dumps({"algorithms": algos, "runs": payload}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
