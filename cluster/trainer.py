"""The driver's run: services up, warm start, then RL steps (collect, score, prepare, train, sync, log).

One RL step: prompts -> rollout engines (G completions each, behaviour log-probs, weight version) -> reward
workers -> group advantages -> learner ranks (minibatches, GSPO) -> weights to the object store -> engines
load them and reset their prefix cache.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from cluster import (audit_dump, checkpoint, data, eval_metrics, length_slices, node_files, placement, services,
                     user_code)
from cluster.batching import build_sft_batch, build_train_batch, split_for_ranks
from cluster.collect import Collected, Collector, all_equal, score
from cluster.common import mean
from cluster.data_files import file_rows
from cluster.config import Config, ConfigError
from cluster.learner_group import LearnerGroup
from cluster.prompting import PromptEncoder, PromptError
from cluster.tiny_model import ensure_model
from cluster.tracking import MetricsLogger, plot_curves, progress_line
from learner.advantages import group_advantages
from learner.objective_names import TOKEN_CORRECTIONS
from reward.pool import RewardPool
from rollout.contracts import PromptRow

log = logging.getLogger("cluster.train")

PENDING_FILE = "pending_rollout.pkl"  # in a checkpoint: the rollout collected ahead of the learner (max_staleness=1)


class HealthStop(RuntimeError):
    """The health guard's checks kept failing after rolling back; the message names them."""


def setup_run_dir(cfg: Config) -> Path:
    """Create ``outputs/<run_name>/`` (and its cache), point vLLM's and inductor's caches into it, and write
    the resolved config there."""
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


def load_tokenizer(model_path: str):
    """The model folder's tokenizer.

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    if tok.eos_token_id is None:
        raise ConfigError(f"model.path={model_path!r}: the tokenizer has no eos token")
    return tok


def load_rows(cfg: Config, tokenizer) -> tuple[list[PromptRow], list[PromptRow]]:
    """Training and held-out rows for ``cfg.data``; every task's prompts are encoded by one
    ``cluster.prompting.PromptEncoder`` (``data.apply_chat_template``, ``data.system_prompt``, the BOS rule).

    Raises:
        ConfigError: ``data.apply_chat_template=true`` with a tokenizer that has no chat template.
        data.DataError: a missing file or field, or a split with no usable row.
    """
    d = cfg.data
    try:
        encoder = PromptEncoder(tokenizer, d.apply_chat_template, d.system_prompt)
    except PromptError as e:
        raise ConfigError(f"{e} (model.path={cfg.model.path!r})") from None
    if d.task == "arithmetic":
        return data.arithmetic_rows(
            encoder.ids, max_operand=d.max_operand, num_train=d.num_train, num_eval=d.num_eval, seed=d.seed,
            demo_slip_rate=d.demo_slip_rate,
        )
    if d.task == "code":
        from cluster.code_task import code_rows

        return code_rows(encoder.ids, num_train=d.num_train, num_eval=d.num_eval, seed=d.seed,
                         demo_slip_rate=d.demo_slip_rate, max_prompt_tokens=d.max_prompt_tokens)
    return file_rows(d, encoder.encode)


def _tuple_state(state: Any) -> Any:
    """random.Random state from JSON (lists back to tuples)."""
    if isinstance(state, list):
        return tuple(_tuple_state(x) for x in state)
    return state


def linear_warmup(lr: float, step: int, warmup_steps: int) -> float:
    """The learning rate of 0-based ``step`` under a linear warm-up: ``lr x min(1, (step + 1) / warmup_steps)``;
    ``lr`` itself when ``warmup_steps`` is 0."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else lr


#: a mismatch correction that drops more than this share of a step's sequences or tokens is warned about: it is
#: meant to reject outliers, and above a quarter it cuts into the data itself.
CORRECTION_DROP_WARN = 0.25


def correction_warning(metrics: dict[str, Any], lc) -> str | None:
    """A warning when ``learner.rollout_correction`` dropped more than ``CORRECTION_DROP_WARN`` of a step's
    tokens (``token_*`` corrections: ``mismatch/masked_token_share``) or sequences (``seq_*``:
    ``mismatch/masked_seq_share``) in an update that was applied, else None. Measured:
    a ``seq_geo_rs`` band of [0.998, 1.002] against a bf16 engine dropped 79% of sequences, and the runs fell
    below their start (README, MoE comparison with a bf16 engine)."""
    # token corrections drop tokens (a sequence counts as masked with one dropped token); sequence ones sequences
    unit = "token" if lc.rollout_correction in TOKEN_CORRECTIONS else "seq"
    share = float(metrics.get(f"mismatch/masked_{unit}_share", 0.0))
    if share <= CORRECTION_DROP_WARN or metrics.get("health/skipped"):
        return None
    return (f"learner.rollout_correction={lc.rollout_correction!r} dropped {share:.0%} of the step's "
            f"{'sequences' if unit == 'seq' else 'tokens'} (band [{lc.rollout_correction_low:g}, "
            f"{lc.rollout_correction_high:g}]): the update learns from the rest only; widen "
            "learner.rollout_correction_low / rollout_correction_high to the mismatch/* the run logs")


class Trainer:
    """Owns the actors, the prompt stream, logging and checkpoints of one run. ``verbose=False``: the actors'
    output goes to the run's ``logs/workers/`` instead of the terminal (``cluster.console``)."""

    def __init__(self, cfg: Config, verbose: bool = True):
        self.cfg = cfg
        self.verbose = verbose
        self.user_modules: list[str] = []  # user verifier modules shipped to the workers (cluster.user_code)
        self.t_start = time.perf_counter()
        self.run_dir = setup_run_dir(cfg)
        self.step = 0
        self.weight_version = 0
        self.warm_start_done = False
        self.trained_uids: list[list[str]] = []
        self.health_failures = 0  # refused steps in a row
        self.rollbacks = 0
        self.rollbacks_in_a_row = 0  # rollbacks with no good step between them
        self.health_log: list[dict[str, Any]] = []
        self.learners: LearnerGroup | None = None
        self.last_sync: dict[str, float] = {}  # sync/* metrics of the last weight sync
        self.pending: Collected | None = None  # the next step's rollout, collected while the learner trained
        self._rl_lr: float | None = None  # the RL lr last set by the warm-up schedule (None: not yet)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collect")  # the overlapped rollout

    # -- start-up -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Model, tokenizer and data; resume state; the services (learner ranks, engines, reward workers)."""
        cfg = self.cfg
        random.seed(cfg.trainer.seed)
        m = cfg.model
        build = m.build_kwargs()
        self.model_path = str(ensure_model(m.path, self.run_dir / "model", seed=m.build_seed, **build))
        self.tokenizer = tok = load_tokenizer(self.model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.train_rows, self.eval_rows = load_rows(cfg, self.tokenizer)
        # Before any actor starts: every module:function verifier imports here, or the run stops naming it.
        self.user_modules = user_code.check_user_verifiers(
            user_code.verifier_names(cfg, self.train_rows + self.eval_rows))
        data.dump_rows(self.eval_rows, self.run_dir / "eval_prompts.jsonl")
        log.info("data: %d training prompts, %d held-out prompts", len(self.train_rows), len(self.eval_rows))

        resume_from = checkpoint.latest_checkpoint(self.run_dir) if cfg.trainer.resume else None
        state = checkpoint.read_state(resume_from) if resume_from else None
        self.data_fingerprint = checkpoint.data_fingerprint(self.train_rows)
        if state:  # before any actor starts: a config that cannot continue this run is refused here
            checkpoint.check_resume(state, cfg, self.data_fingerprint, checkpoint.read_learner_state(resume_from))
        self.stream = data.PromptStream(self.train_rows, seed=cfg.trainer.seed,
                                        position=state["stream_position"] if state else 0)
        self.sft_rng = random.Random(cfg.trainer.seed + 1)
        if state:
            self.step = state["step"]
            self.weight_version = state["weight_version"]
            self.warm_start_done = state["warm_start_done"]
            self.sft_rng.setstate(_tuple_state(state["sft_rng"]))
            pending = resume_from / PENDING_FILE
            if pending.is_file():  # the rollout collected ahead (overlapped mode): trained next, as it would have been
                self.pending = pickle.loads(pending.read_bytes())
        self._start_services()
        self.collector = Collector(cfg, self.stream, self.fleet, self.rewards)
        if resume_from:
            self.learners.load_checkpoint(str(resume_from / "learner"))
            self._sync_weights(self.weight_version)
            log.info("resumed from %s (step %d)", resume_from, self.step)
        self.logger = MetricsLogger(self.run_dir, cfg.model_dump(mode="json"), wandb_mode=cfg.wandb.mode,
                                    project=cfg.wandb.project, resume_from_step=self.step if resume_from else None)

    def _start_services(self) -> None:
        cfg = self.cfg
        services.init_ray(cfg, self.run_dir, self.user_modules, verbose=self.verbose)
        # before any actor: *.node_resources the nodes offer, the same files on every node (cluster.node_files)
        verifiers = user_code.verifier_names(cfg, self.train_rows + self.eval_rows)
        node_files.check_cluster(cfg, self.model_path, list(verifiers))
        t0 = time.perf_counter()
        self.learners = LearnerGroup(cfg, self.model_path)
        self.fleet = services.EngineFleet(cfg, self.model_path, self.run_dir / "cache")
        sc = cfg.sync
        self.fleet.weight_source = lambda engines, version: self.learners.sync_weights(
            engines, version, sc.bucket_mb, sc.max_buckets_in_flight, sc.engine_timeout_s, sc.transport)
        self.fleet.start(cfg.rollout.num_engines)
        self.reward_groups = services.RewardGroups(cfg.reward.num_cpus_per_worker, cfg.reward.node_resources,
                                                   cfg.cluster.placement_timeout_s)
        self.rewards = RewardPool(cfg.reward, scheduling_strategy_factory=self.reward_groups)
        self.learners.wait_ready()
        self.placement = placement.PlacementRecord(self.run_dir)  # placement.json, rewritten at every sync
        self.placement.update(self.learners, self.fleet, self.reward_groups)
        log.info("services up in %.1fs: %d learner ranks, %d engines, %d reward workers",
                 time.perf_counter() - t0, cfg.learner.world_size, len(self.fleet), cfg.reward.num_workers)

    # -- pieces of a step ---------------------------------------------------------------------------------
    def _sync_weights(self, version: int) -> float:
        """Stream the learner's weights into every engine as ``version``; keeps the sync's bytes and seconds
        for the step's metrics (``sync/*``). Returns the wall time."""
        t = time.perf_counter()
        report = self.fleet.sync(version)
        self.weight_version = version
        seconds = time.perf_counter() - t
        self.placement.update(self.learners, self.fleet, self.reward_groups)  # after any engine replacement
        self.last_sync = {"sync/bytes": float(report.get("bytes", 0)), "sync/seconds": seconds,
                          "sync/gb_per_s": report.get("bytes", 0) / seconds / 1e9 if seconds > 0 else 0.0,
                          "sync/buckets": float(report.get("buckets", 0)),
                          "sync/engine_load_s": float(report.get("engine_load_s", 0.0)),
                          # 1 when the bytes went by broadcast to the end (sync.transport=collective), 0 otherwise
                          "sync/collective": float(report.get("transport") == "collective"),
                          # engines on another node than learner rank 0: their bytes crossed between nodes
                          "sync/cross_node": float(self.placement.cross_node)}
        return seconds

    def evaluate(self) -> dict[str, float]:
        """Greedy decoding on the held-out prompts; accuracy = share judged correct by the verifier. With
        ``trainer.eval_samples`` = k > 0 also k samples per prompt at the rollout temperature (the same seed at
        every evaluation): ``eval/pass@j`` and ``eval/mean@k`` (``cluster.eval_metrics``)."""
        t = time.perf_counter()
        comps = self.fleet.generate(self.eval_rows, 1, greedy=True)
        results = score(self.rewards, {r.uid: r for r in self.eval_rows}, comps)
        self.rewards.metrics()  # eval's counters are not the step's
        out = {
            "eval/accuracy": mean([1.0 if r.correct else 0.0 for r in results]),
            "eval/num_prompts": float(len(results)),
            "eval/response_length_mean": mean([float(len(c.response_token_ids)) for c in comps]),
        }
        k = self.cfg.trainer.eval_samples
        if k:
            out.update(eval_metrics.evaluate_sampled(self.fleet, self.rewards, self.eval_rows, k,
                                                     seed=self.cfg.rollout.seed + eval_metrics.EVAL_SAMPLING_SEED))
        out["timing/eval_s"] = time.perf_counter() - t
        return out

    def warm_start(self) -> dict[str, float]:
        """Supervised warm start: ``warm_start.steps`` cross-entropy steps on worked examples, then the
        optimizer is reset and the RL learning rate set, and the engines receive the new weights."""
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
            lr = linear_warmup(ws.lr, s, ws.warmup_steps)
            if lr != current_lr:  # one round trip to the ranks only when the schedule changes the lr
                self.learners.call("set_lr", lr, False)  # router_lr_scale acts in RL only
                current_lr = lr
            losses.append(self.learners.sft_step(batch, int(batch.loss_mask.sum()))["loss/sft"])
            if (s + 1) % max(1, ws.steps // 10) == 0 or s + 1 == ws.steps:
                log.info("warm start %d/%d: loss %.4f", s + 1, ws.steps, losses[-1])
        self.learners.call("reset_optimizer_state")
        self.learners.call("set_lr", lc.lr)
        self._sync_weights(self.weight_version + 1)
        self.warm_start_done = True
        return {"warm_start/loss_final": losses[-1] if losses else float("nan"),
                "warm_start/steps": float(ws.steps), "timing/warm_start_s": time.perf_counter() - t}

    def train(self, c: Collected, rewards: torch.Tensor) -> tuple[dict[str, Any], float]:
        """Prepare (group advantages, padded batch, split per rank and minibatch) and train on ``c``.
        Returns (learner metrics, learner seconds)."""
        cfg, tc = self.cfg, self.cfg.trainer
        advantages = group_advantages(rewards, tc.group_size, normalize_std=cfg.learner.normalize_adv_std)
        batch = build_train_batch(c.completions, rewards, advantages, self.pad_id)
        plans = split_for_ranks(batch, cfg.learner.num_minibatches, cfg.learner.world_size, seed=tc.seed + self.step)
        audit_dir = audit_dump.save_inputs(self, self.step + 1, batch, plans) if self.step + 1 in tc.audit_steps else None
        self._apply_rl_lr()
        t = time.perf_counter()
        m = self.learners.train(plans, cfg.health.guard())
        learner_s = time.perf_counter() - t
        if audit_dir is not None:
            audit_dump.save_outputs(self, audit_dir, m)
        return m, learner_s

    def _apply_rl_lr(self) -> None:
        """Set this step's RL learning rate (``learner.lr_warmup_steps``) when it differs from the last one set
        here; the first call of a process always sets it (after a resume the optimizer's restored lr is the
        checkpointed step's, not this one's)."""
        lc = self.cfg.learner
        if not lc.lr_warmup_steps:
            return
        lr = linear_warmup(lc.lr, self.step, lc.lr_warmup_steps)
        if lr != self._rl_lr:
            self.learners.call("set_lr", lr)
            self._rl_lr = lr

    def after_train(self, m: dict[str, Any]) -> float:
        """Sync the new weights, or count a refused step (the engines keep their weights; a rollback throws
        away a rollout collected ahead). Returns the sync seconds."""
        if m.get("health/skipped"):
            rollbacks = self.rollbacks
            self._health_failure(m)
            if self.rollbacks != rollbacks and self.pending is not None:
                self.stream.position = self.pending.start_position  # collected with weights rolled back over
                self.pending = None
            return 0.0
        self.health_failures = 0
        self.rollbacks_in_a_row = 0
        return self._sync_weights(self.weight_version + 1)

    def rl_step(self) -> dict[str, Any]:
        """One RL step: scale if asked (``control.yaml``), collect and score (or take the rollout collected
        during the previous step), train (meanwhile collecting the next step's rollout when
        ``trainer.max_staleness=1``), sync, and the step's metrics (see README for their names)."""
        t_step = time.perf_counter()
        self._apply_control()
        restarts = self.fleet.restarts
        c, self.pending = self.pending or self.collector.collect(self.step), None
        ahead = None
        if self.cfg.trainer.max_staleness and self.step + 1 < self.cfg.trainer.total_steps:
            ahead = self._pool.submit(self.collector.collect, self.step + 1)  # engines sample with the current weights
        rewards = torch.tensor([r.score for r in c.results], dtype=torch.float32)
        learner_m: dict[str, Any] = {}
        learner_s, sync_s = 0.0, 0.0
        try:
            m: dict[str, Any] = {"step": self.step + 1, **self.staleness(c)}
            if c.prompts:
                learner_m, learner_s = self.train(c, rewards)
            else:
                log.warning("step %d: no informative group; no update", self.step + 1)
        finally:
            if ahead is not None:  # never leave the rollout thread running into a shutdown
                wait_futures([ahead])
        wait_s = time.perf_counter()
        self.pending = ahead.result() if ahead is not None else None  # no request is in flight at the sync below
        wait_s = time.perf_counter() - wait_s
        by_length = learner_m.pop(length_slices.LEARNER_KEY, {})
        if c.prompts:
            sync_s = self.after_train(learner_m)
            m.update(learner_m)
            if warning := correction_warning(learner_m, self.cfg.learner):
                log.warning("step %d: %s", self.step + 1, warning)
            if sync_s:
                m.update(self.last_sync)
        self.step += 1
        self.trained_uids.append([r.uid for r in c.prompts])
        m.update(self.step_metrics(c, rewards, learner_s, sync_s, restarts))
        m.update(self.length_metrics(c, rewards, by_length))
        m["timing/wait_rollout_s"] = wait_s
        m["timing/step_s"] = time.perf_counter() - t_step
        return m

    def staleness(self, c: Collected) -> dict[str, float]:
        """``rollout/staleness_mean|max``: weight versions between the sampling engine's and the learner's,
        over the step's samples (0 on-policy; at most ``trainer.max_staleness``).

        Raises:
            RuntimeError: a sample older than the bound (a scheduling bug: nothing is trained on it).
        """
        ages = [self.weight_version - x.weight_version for x in c.completions]
        worst = max(ages, default=0)
        if worst > self.cfg.trainer.max_staleness:
            raise RuntimeError(f"step {self.step + 1}: a sample is {worst} weight versions old, beyond "
                               f"trainer.max_staleness={self.cfg.trainer.max_staleness}")
        return {"rollout/staleness_mean": sum(ages) / len(ages) if ages else 0.0, "rollout/staleness_max": float(worst)}

    def step_metrics(self, c: Collected, rewards: torch.Tensor, learner_s: float, sync_s: float,
                     restarts: int) -> dict[str, Any]:
        """Reward, response, timing, throughput and fleet metrics of a step."""
        tc = self.cfg.trainer
        m: dict[str, Any] = {}
        if tc.dynamic_sampling:
            m.update({"sampling/rounds": float(c.rounds), "sampling/dropped_groups": float(c.dropped),
                      "sampling/groups_trained": float(len(c.prompts))})
        valid = rewards[~torch.isnan(rewards)]
        lengths = [len(x.response_token_ids) for x in c.completions]
        m.update({
            "reward/mean": float(valid.mean()) if valid.numel() else float("nan"),
            "reward/std": float(valid.std()) if valid.numel() > 1 else 0.0,
            "reward/accuracy": mean([1.0 if r.correct else 0.0 for r in c.results]),
            "reward/invalid": float(torch.isnan(rewards).sum()),
            "reward/groups_all_equal": mean([1.0 if all_equal(g) else 0.0 for g in rewards.view(-1, tc.group_size).tolist()]),
            "response/length_mean": mean([float(x) for x in lengths]),
            "response/length_max": float(max(lengths) if lengths else 0),
            "response/clip_ratio": mean([1.0 if x.truncated else 0.0 for x in c.completions]),
            "timing/rollout_s": c.rollout_s,
            "timing/reward_s": c.reward_s,
            "timing/learner_s": learner_s,
            "timing/weight_sync_s": sync_s,
            "throughput/rollout_tokens_per_s": c.generated_tokens / c.rollout_s if c.rollout_s > 0 else 0.0,
            "weight_version": self.weight_version,
            "data/epoch": float(self.stream.epoch),
            "fault/rollout_restarts": float(self.fleet.restarts - restarts),
            "rollout/num_engines": float(len(self.fleet)),
            "reward/num_workers": float(self.rewards.num_workers),
        })
        m.update(c.reward_metrics)
        return m

    def length_metrics(self, c: Collected, rewards: torch.Tensor, by_length: dict[int, list[float]]) -> dict[str, float]:
        """The step's metrics per response-length bucket (``cluster.length_slices``; none when
        ``trainer.length_buckets`` is 0): reward and accuracy of the rollout, clip fraction and sequence ratio
        of the learner's update (absent when no update ran)."""
        n = self.cfg.trainer.length_buckets
        if not n:
            return {}
        ranges = length_slices.bucket_ranges(self.cfg.rollout.max_response_tokens, n)
        lengths = [len(x.response_token_ids) for x in c.completions]
        out = length_slices.rollout_slices(lengths, rewards.tolist(), [r.correct for r in c.results], ranges)
        out.update(length_slices.learner_slices(by_length, ranges))
        return out

    # -- health guard ---------------------------------------------------------------------------------------
    def _health_failure(self, m: dict[str, Any]) -> None:
        """Count a step the guard refused; roll back after ``health.rollback_after`` in a row; stop after
        ``health.max_rollbacks`` rollbacks with no good step between them."""
        hc = self.cfg.health
        self.health_failures += 1
        self.health_log.append({"step": self.step + 1, "checks": m.get("health/failed_checks", ""),
                                "reasons": m.get("health/reasons", "")})
        log.warning("health guard refused step %d (%s); %d in a row", self.step + 1, m.get("health/reasons", ""),
                    self.health_failures)
        m["health/consecutive_failures"] = float(self.health_failures)
        if self.health_failures < hc.rollback_after:
            return
        ck = checkpoint.latest_checkpoint(self.run_dir)
        if ck is None or self.rollbacks_in_a_row >= hc.max_rollbacks:
            self._stop_for_health(ck)
        self.learners.load_checkpoint(str(ck / "learner"))
        self._rl_lr = None  # the checkpoint brought its own lr back
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
        """Write a checkpoint of the learner and the driver's state (atomically renamed when complete)."""
        tmp = checkpoint.temp_dir_for(self.run_dir, self.step)
        self.learners.save_checkpoint(str(tmp / "learner"))
        if self.pending is not None:  # sampled with weights no checkpoint holds: kept, not regenerated
            (tmp / PENDING_FILE).write_bytes(pickle.dumps(self.pending))
        state = {
            "step": self.step,
            "weight_version": self.weight_version,
            "warm_start_done": self.warm_start_done,
            "stream_position": self.stream.position,
            "sft_rng": self.sft_rng.getstate(),
            "config": self.cfg.model_dump(mode="json"),
            "data_fingerprint": self.data_fingerprint,
        }
        final = checkpoint.finalize(self.run_dir, tmp, self.step, state, self.cfg.trainer.keep_checkpoints)
        log.info("checkpoint written: %s", final)
        return final

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Warm start (unless resumed past it), the step-0 evaluation, the RL steps with evaluations and
        checkpoints, then curves and ``summary.json``. Returns the summary."""
        cfg, tc = self.cfg, self.cfg.trainer
        summary: dict[str, Any] = {}
        if not self.warm_start_done and cfg.warm_start.steps > 0 and self.step == 0:
            summary.update(self.warm_start())
        if self.step == 0:
            ev = self.evaluate()
            self.logger.log({"step": 0, "weight_version": self.weight_version, **ev, **summary})
            summary["eval/accuracy_start"] = ev["eval/accuracy"]
            log.info("held-out accuracy before RL: %.3f (%d prompts)%s", ev["eval/accuracy"], len(self.eval_rows),
                     "".join(f", {k[5:]} {v:.3f}" for k, v in ev.items() if k.startswith(("eval/pass@", "eval/mean@"))))
        self._loop()
        hist = self.logger.history
        evals = [r["eval/accuracy"] for r in hist if r.get("eval/accuracy") is not None]
        if evals:
            summary.setdefault("eval/accuracy_start", evals[0])
            summary["eval/accuracy_final"] = evals[-1]
            summary["eval/accuracy_best"] = max(evals)
        sampled = [r for r in hist if any(k.startswith("eval/pass@") for k in r)]
        for key in [k for k in (sampled[-1] if sampled else {}) if k.startswith(("eval/pass@", "eval/mean@"))]:
            summary.setdefault(f"{key}_start", sampled[0].get(key))
            summary[f"{key}_final"] = sampled[-1][key]
        summary["timing/total_s"] = time.perf_counter() - self.t_start
        if tc.plots:
            plot_curves(hist, self.run_dir / "curves.png")
            length_slices.plot_length_slices(hist, self.run_dir / "length_slices.png")
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _loop(self) -> None:
        tc = self.cfg.trainer
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
                self.logger.log(m)
                progress.update(task, completed=self.step, line=progress_line(m))
                if not sys.stderr.isatty():
                    log.info("step %d/%d | %s", self.step, tc.total_steps, progress_line(m))
                if final or (tc.save_every and self.step % tc.save_every == 0):
                    self.save()

    def shutdown(self) -> None:
        """Close the logger and stop every service (engines, reward workers, learner ranks and their groups)."""
        logger = getattr(self, "logger", None)
        if logger is not None:
            logger.close()
        if getattr(self, "fleet", None) is not None:
            self.fleet.shutdown()
        if getattr(self, "rewards", None) is not None:
            self.rewards.shutdown()
            self.reward_groups.remove_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.learners is not None:
            self.learners.shutdown()
