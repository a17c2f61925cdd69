"""The driver: ``python -m cluster.train CONFIG [dotted.key=value ...] [--dry-run]``.

One RL step: prompts -> rollout engines (G completions each, behaviour log-probs, weight version) -> reward
workers -> group advantages -> learner ranks (minibatches, GSPO) -> weights to the object store -> engines
load them and reset their prefix cache.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from cluster.config import Config, ConfigError, load_config

log = logging.getLogger("cluster.train")


# ------------------------------------------------------------------------------------------------ helpers


def _setup_run_dir(cfg: Config) -> Path:
    run_dir = cfg.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cache = run_dir / "cache"
    cache.mkdir(exist_ok=True)
    # vLLM and inductor litter ~/.cache and /tmp unless pointed into the run folder.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    os.environ.setdefault("HF_DATASETS_CACHE", str(cache / "datasets"))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return run_dir


def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    if tok.eos_token_id is None:
        raise ConfigError(f"model.path={model_path!r}: the tokenizer has no eos token")
    return tok


def load_rows(cfg: Config, tokenizer) -> tuple[list, list]:
    """Training and held-out rows for ``cfg.data``."""
    from cluster import data

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    d = cfg.data
    if d.task == "arithmetic":
        return data.arithmetic_rows(
            tokenize, max_operand=d.max_operand, num_train=d.num_train, num_eval=d.num_eval, seed=d.seed,
            demo_slip_rate=d.demo_slip_rate,
        )
    train, _ = data.gsm8k_rows(d.train_path, tokenize, split="train", max_prompt_tokens=d.max_prompt_tokens, limit=d.num_train)
    test, _ = data.gsm8k_rows(d.test_path, tokenize, split="eval", max_prompt_tokens=d.max_prompt_tokens, limit=d.num_eval)
    return train, test


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


# ----------------------------------------------------------------------------------------------- the run


class Trainer:
    """Owns the actors, the prompt stream, logging and checkpoints of one run."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.t_start = time.perf_counter()
        self.run_dir = _setup_run_dir(cfg)
        self.step = 0
        self.weight_version = 0
        self.warm_start_done = False
        self.trained_uids: list[list[str]] = []
        self.health_failures = 0  # refused steps in a row
        self.rollbacks = 0
        self.rollbacks_in_a_row = 0  # rollbacks with no good step between them
        self.health_log: list[dict[str, Any]] = []

    # -- start-up -----------------------------------------------------------------------------------------
    def start(self) -> None:
        import ray  # noqa: F401  (import here so --dry-run never touches Ray)

        from cluster import checkpoint, services
        from cluster.data import PromptStream, dump_rows
        from cluster.tiny_model import ensure_model
        from cluster.tracking import MetricsLogger
        from reward.pool import RewardPool

        cfg = self.cfg
        random.seed(cfg.trainer.seed)
        m = cfg.model
        build = m.model_dump(exclude={"path", "build_seed", "num_params_b"})
        self.model_path = str(ensure_model(m.path, self.run_dir / "model", seed=m.build_seed, **build))
        self.tokenizer = _tokenizer(self.model_path)
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.train_rows, self.eval_rows = load_rows(cfg, self.tokenizer)
        dump_rows(self.eval_rows, self.run_dir / "eval_prompts.jsonl")
        log.info("data: %d training prompts, %d held-out prompts", len(self.train_rows), len(self.eval_rows))

        resume_from = checkpoint.latest_checkpoint(self.run_dir) if cfg.trainer.resume else None
        state = checkpoint.read_state(resume_from) if resume_from else None
        self.stream = PromptStream(self.train_rows, seed=cfg.trainer.seed, position=state["stream_position"] if state else 0)
        self.sft_rng = random.Random(cfg.trainer.seed + 1)
        if state:
            self.step = state["step"]
            self.weight_version = state["weight_version"]
            self.warm_start_done = state["warm_start_done"]
            self.sft_rng.setstate(_tuple_state(state["sft_rng"]))

        services.init_ray(cfg, self.run_dir)
        t0 = time.perf_counter()
        self.learners, self.learner_groups = services.start_learners(cfg, self.model_path)
        self.fleet = services.EngineFleet(cfg, self.model_path, self.run_dir / "cache")
        self.fleet.start(cfg.rollout.num_engines)
        self.reward_groups = services.RewardGroups(cfg.reward.num_cpus_per_worker)
        self.rewards = RewardPool(cfg.reward, scheduling_strategy_factory=self.reward_groups)
        services.wait_learners(self.learners)
        log.info("services up in %.1fs: %d learner ranks, %d engines, %d reward workers",
                 time.perf_counter() - t0, cfg.learner.world_size, len(self.fleet), cfg.reward.num_workers)
        if resume_from:
            import ray as _ray

            _ray.get([l.load_checkpoint.remote(str(resume_from / "learner")) for l in self.learners])
            self._sync_weights(self.weight_version)
            log.info("resumed from %s (step %d)", resume_from, self.step)
        self.logger = MetricsLogger(
            self.run_dir,
            cfg.model_dump(mode="json"),
            wandb_mode=cfg.wandb.mode,
            project=cfg.wandb.project,
            resume_from_step=self.step if resume_from else None,
        )

    # -- pieces of a step ---------------------------------------------------------------------------------
    def _sync_weights(self, version: int) -> float:
        from cluster import services

        t = time.perf_counter()
        refs = services.export_weights(self.learners, self.cfg.sync.bucket_mb)
        self.fleet.sync(refs, version)  # the fleet keeps the refs: replacement engines load them
        self.weight_version = version
        return time.perf_counter() - t

    def _score(self, rows_by_uid: dict[str, Any], completions: list) -> list:
        from cluster.contracts import RewardRequest

        reqs = [
            RewardRequest(
                response=c.response_text,
                row=rows_by_uid[c.prompt_uid],
                num_response_tokens=len(c.response_token_ids),
                truncated=c.truncated,
            )
            for c in completions
        ]
        return self.rewards.score(reqs)

    def evaluate(self) -> dict[str, float]:
        """Greedy decoding on the held-out prompts; accuracy = share judged correct by the verifier."""
        t = time.perf_counter()
        comps = self.fleet.generate(self.eval_rows, 1, greedy=True)
        results = self._score({r.uid: r for r in self.eval_rows}, comps)
        self.rewards.metrics()  # eval's counters are not the step's
        acc = _mean([1.0 if r.correct else 0.0 for r in results])
        return {
            "eval/accuracy": acc,
            "eval/num_prompts": float(len(results)),
            "eval/response_length_mean": _mean([float(len(c.response_token_ids)) for c in comps]),
            "timing/eval_s": time.perf_counter() - t,
        }

    def warm_start(self) -> dict[str, float]:
        """Supervised warm start: ``warm_start.steps`` cross-entropy steps on worked examples, then the
        optimizer is reset and the RL learning rate set, and the engines receive the new weights."""
        import ray

        from cluster import services
        from cluster.batching import build_sft_batch

        ws, lc = self.cfg.warm_start, self.cfg.learner
        eos = self.tokenizer.eos_token_id
        t = time.perf_counter()
        losses = []
        current_lr = None
        for s in range(ws.steps):
            rows = [self.sft_rng.choice(self.train_rows) for _ in range(ws.batch_size)]
            prompts = [r.prompt_token_ids for r in rows]
            responses = [self.tokenizer(r.meta["solution"], add_special_tokens=False)["input_ids"] + [eos] for r in rows]
            batch = build_sft_batch(prompts, responses, self.pad_id)
            num_tokens = int(batch.loss_mask.sum())
            per = ws.batch_size // lc.world_size
            lr = ws.lr * min(1.0, (s + 1) / ws.warmup_steps) if ws.warmup_steps else ws.lr
            if lr != current_lr:  # one round trip to the ranks only when the schedule changes the lr
                ray.get([l.set_lr.remote(lr) for l in self.learners])
                current_lr = lr
            outs = services.get_fail_fast([
                l.sft_step.remote(_select_sft(batch, r * per, (r + 1) * per), num_tokens)
                for r, l in enumerate(self.learners)
            ])
            losses.append(outs[0]["loss/sft"])
            if (s + 1) % max(1, ws.steps // 10) == 0 or s + 1 == ws.steps:
                log.info("warm start %d/%d: loss %.4f", s + 1, ws.steps, losses[-1])
        ray.get([l.reset_optimizer_state.remote() for l in self.learners])
        ray.get([l.set_lr.remote(lc.lr) for l in self.learners])
        self._sync_weights(self.weight_version + 1)
        self.warm_start_done = True
        return {"warm_start/loss_final": losses[-1] if losses else float("nan"),
                "warm_start/steps": float(ws.steps), "timing/warm_start_s": time.perf_counter() - t}

    def rl_step(self) -> dict[str, Any]:
        import torch

        from cluster import services
        from cluster.batching import build_train_batch, split_for_ranks
        from learner.advantages import group_advantages

        cfg, tc = self.cfg, self.cfg.trainer
        G, P = tc.group_size, tc.prompts_per_step
        t_step = time.perf_counter()
        self._apply_control()
        restarts = self.fleet.restarts

        # Rollout and reward. With dynamic sampling (DAPO), groups whose valid rewards are all equal carry no
        # signal: they are dropped and more prompts are sampled, at most trainer.max_sampling_rounds extra rounds.
        prompts, comps, results = [], [], []
        rollout_s = reward_s = 0.0
        dropped, rounds, want, generated_tokens = 0, 0, P, 0
        reward_metrics: dict[str, float] = {}
        while want > 0:
            batch_prompts = self.stream.take(want)
            t = time.perf_counter()
            new = self.fleet.generate(batch_prompts, G, seed=cfg.rollout.seed + 1_000_003 * self.step + 7_919 * rounds)
            rollout_s += time.perf_counter() - t
            generated_tokens += sum(len(c.response_token_ids) for c in new)
            if len(new) != len(batch_prompts) * G:
                raise RuntimeError(f"rollout returned {len(new)} completions for {len(batch_prompts)} prompts x G={G}")
            t = time.perf_counter()
            scored = self._score({r.uid: r for r in batch_prompts}, new)
            reward_s += time.perf_counter() - t
            for k, v in self.rewards.metrics().items():
                reward_metrics[k] = reward_metrics.get(k, 0.0) + v
            for i, row in enumerate(batch_prompts):
                group = scored[i * G : (i + 1) * G]
                if tc.dynamic_sampling and _all_equal([r.score for r in group]):
                    dropped += 1
                    continue
                if len(prompts) < P:
                    prompts.append(row)
                    comps.extend(new[i * G : (i + 1) * G])
                    results.extend(group)
            rounds += 1
            want = P - len(prompts) if tc.dynamic_sampling and rounds <= tc.max_sampling_rounds else 0
        unit = cfg.learner.num_minibatches * cfg.learner.world_size
        usable = len(prompts) - len(prompts) % unit
        if usable < len(prompts):
            log.warning("dynamic sampling: %d informative groups after %d rounds (bound reached); training on %d",
                        len(prompts), rounds, usable)
            prompts, comps, results = prompts[:usable], comps[: usable * G], results[: usable * G]

        rewards = torch.tensor([r.score for r in results], dtype=torch.float32)
        m: dict[str, Any] = {"step": self.step + 1}
        if prompts:
            advantages = group_advantages(rewards, G, normalize_std=cfg.learner.normalize_adv_std)
            batch = build_train_batch(comps, rewards, advantages, self.pad_id)
            plans = split_for_ranks(batch, cfg.learner.num_minibatches, cfg.learner.world_size, seed=tc.seed + self.step)
            audit_dir = None
            if self.step + 1 in tc.audit_steps:
                from cluster import audit_dump

                audit_dir = audit_dump.save_inputs(self, self.step + 1, batch, plans)
            t = time.perf_counter()
            guard = cfg.health.guard()
            outs = services.get_fail_fast([
                l.train_rollout_batch.remote(p.minibatches, p.num_sequences, p.num_tokens, guard=guard)
                for l, p in zip(self.learners, plans)
            ])
            learner_s = time.perf_counter() - t
            m.update(outs[0])
            if audit_dir is not None:
                audit_dump.save_outputs(self, audit_dir, outs[0])
            if m.get("health/skipped"):
                # weights unchanged: the engines keep the current version
                sync_s = 0.0
                self._health_failure(m)
            else:
                self.health_failures = 0
                self.rollbacks_in_a_row = 0
                sync_s = self._sync_weights(self.weight_version + 1)
        else:
            log.warning("step %d: no informative group; no update", self.step + 1)
            learner_s = sync_s = 0.0
        self.step += 1
        self.trained_uids.append([r.uid for r in prompts])
        if tc.dynamic_sampling:
            m.update({"sampling/rounds": float(rounds), "sampling/dropped_groups": float(dropped),
                      "sampling/groups_trained": float(len(prompts))})

        valid = rewards[~torch.isnan(rewards)]
        lengths = [len(c.response_token_ids) for c in comps]
        groups = rewards.view(-1, G)
        m.update({
            "reward/mean": float(valid.mean()) if valid.numel() else float("nan"),
            "reward/std": float(valid.std()) if valid.numel() > 1 else 0.0,
            "reward/accuracy": _mean([1.0 if r.correct else 0.0 for r in results]),
            "reward/invalid": float(torch.isnan(rewards).sum()),
            "reward/groups_all_equal": _mean([1.0 if _all_equal(g) else 0.0 for g in groups.tolist()]),
            "response/length_mean": _mean([float(x) for x in lengths]),
            "response/length_max": float(max(lengths) if lengths else 0),
            "response/clip_ratio": _mean([1.0 if c.truncated else 0.0 for c in comps]),
            "timing/rollout_s": rollout_s,
            "timing/reward_s": reward_s,
            "timing/learner_s": learner_s,
            "timing/weight_sync_s": sync_s,
            "throughput/rollout_tokens_per_s": generated_tokens / rollout_s if rollout_s > 0 else 0.0,
            "weight_version": self.weight_version,
            "data/epoch": float(self.stream.epoch),
            "fault/rollout_restarts": float(self.fleet.restarts - restarts),
            "rollout/num_engines": float(len(self.fleet)),
            "reward/num_workers": float(self.rewards.num_workers),
        })
        m.update(reward_metrics)
        m["timing/step_s"] = time.perf_counter() - t_step
        return m

    def _health_failure(self, m: dict[str, Any]) -> None:
        """Count a step the guard refused; roll back after ``health.rollback_after`` in a row; stop after
        ``health.max_rollbacks`` rollbacks with no good step between them."""
        import ray

        from cluster.checkpoint import latest_checkpoint

        hc = self.cfg.health
        self.health_failures += 1
        self.health_log.append({"step": self.step + 1, "checks": m.get("health/failed_checks", ""),
                                "reasons": m.get("health/reasons", "")})
        log.warning("health guard refused step %d (%s); %d in a row", self.step + 1, m.get("health/reasons", ""),
                    self.health_failures)
        m["health/consecutive_failures"] = float(self.health_failures)
        if self.health_failures < hc.rollback_after:
            return
        ck = latest_checkpoint(self.run_dir)
        if ck is None or self.rollbacks_in_a_row >= hc.max_rollbacks:
            self._stop_for_health(ck)
        ray.get([l.load_checkpoint.remote(str(ck / "learner")) for l in self.learners])
        self._sync_weights(self.weight_version + 1)
        self.rollbacks += 1
        self.rollbacks_in_a_row += 1
        self.health_failures = 0
        m["health/rollbacks"] = float(self.rollbacks)
        log.warning("health guard: rolled back to %s (rollback %d)", ck, self.rollbacks)

    def _stop_for_health(self, ck) -> None:
        checks = sorted({c for e in self.health_log[-self.cfg.health.rollback_after:] for c in e["checks"].split(",") if c})
        report = {"stopped_at_step": self.step + 1, "failed_checks": checks, "rollbacks": self.rollbacks,
                  "last_checkpoint": str(ck) if ck else None, "recent_failures": self.health_log[-10:]}
        (self.run_dir / "health_report.json").write_text(json.dumps(report, indent=2))
        raise HealthStop(
            f"health guard: the run stops at step {self.step + 1}: check(s) {', '.join(checks) or '?'} kept failing"
            + (f" after {self.rollbacks} rollback(s) to {ck}" if ck else " and there is no checkpoint to roll back to")
            + f"; report: {self.run_dir / 'health_report.json'}"
        )

    def _apply_control(self) -> None:
        """Scale between steps: ``<run_dir>/control.yaml`` may set ``rollout.num_engines`` and
        ``reward.num_workers`` (for example ``rollout.num_engines: 4`` when the cluster gained nodes). The
        file is read before every step; new engines start with the current weights, surplus ones are
        stopped after finishing their work (nothing is in flight between steps)."""
        path = self.run_dir / "control.yaml"
        if not path.is_file():
            return
        try:
            wanted = yaml.safe_load(path.read_text()) or {}
            engines = int(wanted.get("rollout.num_engines", len(self.fleet)))
            workers = int(wanted.get("reward.num_workers", self.rewards.num_workers))
        except (yaml.YAMLError, TypeError, ValueError, AttributeError) as e:
            log.warning("ignoring %s: %s", path, e)
            return
        if engines != len(self.fleet):
            if engines < 1:
                log.warning("ignoring %s: rollout.num_engines=%d must be >= 1", path, engines)
            else:
                log.info("scaling rollout engines %d -> %d", len(self.fleet), engines)
                self.fleet.resize(engines)
        if workers != self.rewards.num_workers and workers >= 1:
            log.info("scaling reward workers %d -> %d", self.rewards.num_workers, workers)
            self.rewards.resize(workers)

    # -- checkpoints --------------------------------------------------------------------------------------
    def save(self) -> Path:
        import ray

        from cluster import checkpoint

        tmp = checkpoint.temp_dir_for(self.run_dir, self.step)
        ray.get([l.save_checkpoint.remote(str(tmp / "learner")) for l in self.learners])
        state = {
            "step": self.step,
            "weight_version": self.weight_version,
            "warm_start_done": self.warm_start_done,
            "stream_position": self.stream.position,
            "sft_rng": self.sft_rng.getstate(),
            "config": self.cfg.model_dump(mode="json"),
        }
        final = checkpoint.finalize(self.run_dir, tmp, self.step, state, self.cfg.trainer.keep_checkpoints)
        log.info("checkpoint written: %s", final)
        return final

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from cluster.tracking import plot_curves, progress_line

        cfg, tc = self.cfg, self.cfg.trainer
        summary: dict[str, Any] = {}
        if not self.warm_start_done and cfg.warm_start.steps > 0 and self.step == 0:
            ws = self.warm_start()
            summary.update(ws)
        if self.step == 0:
            ev = self.evaluate()
            rec = {"step": 0, "weight_version": self.weight_version, **ev, **summary}
            self.logger.log(rec)
            summary["eval/accuracy_start"] = ev["eval/accuracy"]
            log.info("held-out accuracy before RL: %.3f (%d prompts)", ev["eval/accuracy"], len(self.eval_rows))
        last_eval = None
        with Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[line]}"),
            TimeElapsedColumn(),
            disable=not sys.stderr.isatty() and os.environ.get("GSPO_PROGRESS", "1") == "0",
        ) as progress:
            task = progress.add_task("rl", total=tc.total_steps, completed=self.step, line="")
            while self.step < tc.total_steps:
                m = self.rl_step()
                final = self.step == tc.total_steps
                if final or (tc.eval_every and self.step % tc.eval_every == 0):
                    m.update(self.evaluate())
                    last_eval = m["eval/accuracy"]
                self.logger.log(m)
                progress.update(task, completed=self.step, line=progress_line(m))
                if not sys.stderr.isatty():
                    log.info("step %d/%d | %s", self.step, tc.total_steps, progress_line(m))
                if final or (tc.save_every and self.step % tc.save_every == 0):
                    self.save()
        if last_eval is not None:
            summary["eval/accuracy_final"] = last_eval
        hist = self.logger.history
        evals = [r["eval/accuracy"] for r in hist if r.get("eval/accuracy") is not None]
        if evals:
            summary.setdefault("eval/accuracy_start", evals[0])
            summary["eval/accuracy_final"] = evals[-1]
            summary["eval/accuracy_best"] = max(evals)
        summary["timing/total_s"] = time.perf_counter() - self.t_start
        if tc.plots:
            plot_curves(hist, self.run_dir / "curves.png")
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def shutdown(self) -> None:
        import ray

        for what in ("logger",):
            obj = getattr(self, what, None)
            if obj is not None:
                obj.close()
        if getattr(self, "fleet", None) is not None:
            self.fleet.shutdown()
        if getattr(self, "rewards", None) is not None:
            self.rewards.shutdown()
            self.reward_groups.remove_all()
        for l in getattr(self, "learners", []):
            try:
                ray.get(l.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(l)
        from ray.util.placement_group import remove_placement_group

        for pg in getattr(self, "learner_groups", []):
            remove_placement_group(pg)  # so a next run in the same Ray session finds the resources free
        self.learners, self.learner_groups = [], []


class HealthStop(RuntimeError):
    """The health guard's checks kept failing after rolling back; the message names them."""


def _is_learner_error(err: Exception) -> bool:
    return "LearnerRank" in str(err)


def _all_equal(scores: list[float]) -> bool:
    """True when the group's valid (non-NaN) rewards are all equal (or fewer than two are valid)."""
    valid = [x for x in scores if not math.isnan(x)]
    return len(valid) < 2 or max(valid) == min(valid)


def _select_sft(batch, lo: int, hi: int):
    from cluster.contracts import SFTBatch

    return SFTBatch(batch.input_ids[lo:hi], batch.attention_mask[lo:hi], batch.loss_mask[lo:hi])


def _tuple_state(state: Any) -> Any:
    """random.Random state from JSON (lists back to tuples)."""
    if isinstance(state, list):
        return tuple(_tuple_state(x) for x in state)
    return state


# -------------------------------------------------------------------------------------------------- CLI


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
        from cluster.plan import plan

        try:
            resources = plan(cfg, gpu_memory_gib=cfg.cluster.gpu_memory_gib, gpus_per_node=cfg.cluster.gpus_per_node)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(yaml.safe_dump({"config": cfg.model_dump(mode="json"), "plan": resources}, sort_keys=False))
        return 0
    trainer = Trainer(cfg)
    try:
        trainer.start()
        summary = trainer.run()
    except HealthStop as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    except Exception as e:
        import ray

        if isinstance(e, ray.exceptions.RayActorError) and _is_learner_error(e):
            from cluster.checkpoint import latest_checkpoint

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
