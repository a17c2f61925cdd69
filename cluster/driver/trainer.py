"""The driver's run: services up, warm start, then RL steps (collect, score, prepare, train, sync, log).

One RL step: prompts -> rollout engines (G completions each, behaviour log-probs, weight version) -> reward
workers -> group advantages -> learner ranks (minibatches, GSPO) -> weights to the object store -> engines
load them and reset their prefix cache.

``Trainer`` wires the parts, each in its own module: ``resume`` (the driver's state in a checkpoint),
``warm_start`` (the supervised warm start and the lr schedules), ``evaluation``, ``guard`` (the health guard's
policy), ``scaling`` (``control.yaml``), ``step_metrics`` and ``progress`` (the loop's display and summary).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import torch
import yaml

from cluster import precision
from cluster.config import Config
from cluster.data import prompts as data
from cluster.data.tasks import load_rows, load_tokenizer
from cluster.driver import (agent_loop, audit_dump, behaviour, checkpoint, gateway_episodes, length_slices,
                            partial_episodes, partial_rollout, step_metrics)
from cluster.driver.distill import Distiller
from cluster.driver.batching import build_train_batch, rollout_advantages, split_for_ranks, with_branches
from cluster.driver.collect import Collected, Collector
from cluster.driver.env_pool import EnvPool
from cluster.driver.episodes import check_template
from cluster.driver.evaluation import evaluate
from cluster.driver.guard import GuardPolicy
from cluster.driver.progress import run_with_progress, summarize
from cluster.driver.resume import DriverState, find_resume_point, save_checkpoint
from cluster.driver.token_check import TokenCheck
from cluster.driver.scaling import apply_control
from cluster.driver.tracking import MetricsLogger, plot_curves
from cluster.driver.trained_prompts import TrainedPromptLog
from cluster.driver.warm_start import RLLearningRate, warm_start
from cluster.models.resolve import ensure_model
from cluster.runtime import deadlines, devices, judge, node_files, placement, services, teacher, user_code
from cluster.runtime.learner_group import LearnerGroup
from cluster.runtime.weight_sync import WeightSync
from learner.contracts import RolloutTrainResult
from reward.pool import RewardPool
from rollout.contracts import PromptRow

log = logging.getLogger("cluster.train")


def monitor_step(cfg: Config, step: int) -> bool:
    """Whether RL step ``step`` (1-based) runs the learner's mismatch monitor or ``old_logprob_source='auto'``'s
    gap check: steps 1, N+1, 2N+1, ... with ``learner.mismatch_monitor_every`` N > 0 and
    ``learner.pre_update_pass='auto'`` (the check also under ``always``). Counted by the global step, so a
    resumed run monitors the same steps. In the overlapped mode such a step's rollout is collected after the
    previous sync (on-policy), so ``actor/train_rollout_logprob_diff`` measures the engine/learner mismatch
    alone, not one update's policy change as well."""
    return cfg.learner.monitor_at(step - 1) or cfg.learner.gap_check_at(step - 1)


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


class Trainer:
    """Owns the actors, the prompt stream, logging and checkpoints of one run. ``verbose=False``: the actors'
    output goes to the run's ``logs/workers/`` instead of the terminal (``cluster.runtime.console``).

    ``start()`` loads the model, data and resume state and starts the services; ``run()`` trains;
    ``shutdown()`` stops everything. Attributes filled by ``start()`` are None before it."""

    prompt_log: TrainedPromptLog | None = None  # trained_prompts.jsonl, the uids each step trained (start)
    episodes: agent_loop.EpisodeRunner | None = None  # env set: multi-turn episodes (start)
    distiller: Distiller | None = None  # distill set: the teacher's log-probs and per-token advantages (start)

    def __init__(self, cfg: Config, verbose: bool = True):
        self.cfg = cfg
        self.verbose = verbose
        self.t_start = time.perf_counter()
        self.run_dir = setup_run_dir(cfg)
        log.info("%s", precision.summary(cfg.precision_report))  # what precision chose (cluster/precision.py)
        if warning := behaviour.unchecked_warning(cfg.learner):
            log.warning("%s", warning)
        self.state = DriverState()
        self.trained_uids: list[list[str]] = []
        self.guard = GuardPolicy(cfg, self.run_dir)
        self.last_sync: dict[str, float] = {}  # sync/* metrics of the last weight sync
        self.pending: Collected | None = None  # the next step's rollout, collected while the learner trained
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collect")  # the overlapped rollout
        self.sft_rng = random.Random(cfg.trainer.seed + 1)  # the warm start's row sampler
        # model and data (start)
        self.model_path = ""
        self.tokenizer: Any = None
        self.pad_id = 0
        self.train_rows: list[PromptRow] = []
        self.eval_rows: list[PromptRow] = []
        self.data_fingerprint: dict[str, Any] = {}
        self.user_modules: list[str] = []  # user verifier modules shipped to the workers (cluster.runtime.user_code)
        self.stream: data.PromptStream | None = None
        # services (start)
        self.learners: LearnerGroup | None = None
        self.weight_sync: WeightSync | None = None
        self.fleet: services.EngineFleet | None = None
        self.reward_groups: services.RewardGroups | None = None
        self.rewards: RewardPool | None = None
        self.collector: Collector | None = None
        self.distiller: Distiller | None = None  # distill set: the teacher's log-probs and per-token advantages
        self.episodes: agent_loop.EpisodeRunner | None = None  # env set: multi-turn episodes
        self.env_groups: services.RewardGroups | None = None  # the env workers' placement groups
        self.gateway: Any = None  # env.agent: the session gateway actor (cluster.runtime.gateway)
        self.token_check = TokenCheck()  # env set: the engines' turn records against the trained turns
        self.rl_lr: RLLearningRate | None = None
        self.placement: placement.PlacementRecord | None = None  # placement.json
        self.logger: MetricsLogger | None = None

    # the driver state's fields, read where the run reads them
    @property
    def step(self) -> int:
        """RL steps done."""
        return self.state.step

    @property
    def weight_version(self) -> int:
        """The weight version the engines hold."""
        return self.state.weight_version

    # -- start-up -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Model, tokenizer and data; resume state; the services (learner ranks, engines, reward workers)."""
        cfg = self.cfg
        random.seed(cfg.trainer.seed)
        deadlines.set_stacks(cfg.deadlines.stacks)
        deadlines.set_step(None)
        m = cfg.model
        self.model_path = str(ensure_model(m.path, self.run_dir / "model", seed=m.build_seed, **m.build_kwargs()))
        self.tokenizer = tok = load_tokenizer(self.model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if cfg.env.enabled and (not cfg.env.agent_program or cfg.env.gateway.fork_policy == "refuse"):
            check_template(self.tokenizer)  # episodes continue on their sampled ids (agent programs fork)
        self.train_rows, self.eval_rows = load_rows(cfg, self.tokenizer)
        # Before any actor starts: every module:function verifier imports here, or the run stops naming it.
        self.user_modules = user_code.check_user_verifiers(
            user_code.verifier_names(cfg, self.train_rows + self.eval_rows))
        self.user_modules += [m for m in user_code.check_user_loss(cfg) if m not in self.user_modules]
        self.user_modules += [m for m in user_code.check_user_env(cfg) if m not in self.user_modules]
        data.dump_rows(self.eval_rows, self.run_dir / "eval_prompts.jsonl")
        log.info("data: %d training prompts, %d held-out prompts", len(self.train_rows), len(self.eval_rows))
        self.data_fingerprint = checkpoint.data_fingerprint(self.train_rows)
        point = find_resume_point(cfg, self.run_dir, self.data_fingerprint)  # refuses before any actor starts
        if point is not None:
            self.state, self.pending = point.state, point.pending
            self.state.restore_rng(self.sft_rng)
            self.token_check = TokenCheck.from_state(point.token_records)  # turns sampled before the checkpoint
        self.stream = data.PromptStream(self.train_rows, seed=cfg.trainer.seed, position=self.state.stream_position)
        self._start_services()
        self.collector = Collector(cfg, self.stream, self.fleet, self.rewards, self.episodes)
        if cfg.trainer.partial_rollouts and self.episodes is not None:  # episodes continue across syncs
            self.collector = partial_episodes.PartialEpisodeCollector(cfg, self.stream, self.episodes,
                                                                      lambda: self.weight_version)
        elif cfg.trainer.partial_rollouts:  # rounds of bounded length; samples continue across syncs
            self.collector = partial_rollout.PartialCollector(cfg, self.stream, self.fleet, self.rewards,
                                                              lambda: self.weight_version)
        if cfg.trainer.partial_rollouts and point is not None and point.partial is not None:
            self.collector.buffer = point.partial  # in flight at the checkpoint: none lost, versions kept
        if point is not None:
            self.learners.load_checkpoint(str(point.path / "learner"))
            self._sync_weights(self.weight_version)
            log.info("resumed from %s (step %d)", point.path, self.step)
        self.logger = MetricsLogger(self.run_dir, cfg.model_dump(mode="json"), wandb_mode=cfg.wandb.mode,
                                    project=cfg.wandb.project, resume_from_step=self.step if point else None)
        self.prompt_log = TrainedPromptLog(self.run_dir, resume_from_step=self.step if point else None)

    def _start_services(self) -> None:
        cfg = self.cfg
        services.init_ray(cfg, self.run_dir, self.user_modules, verbose=self.verbose)
        # before any actor: *.node_resources the nodes offer, the same files on every node (cluster.runtime.node_files)
        verifiers = user_code.verifier_names(cfg, self.train_rows + self.eval_rows)
        node_files.check_cluster(cfg, self.model_path, list(verifiers))
        t0 = time.perf_counter()
        self.learners = LearnerGroup(cfg, self.model_path)
        if devices.learner_first(cfg):  # a shared GPU: the learner's memory is taken before vLLM sizes its cache
            self.learners.wait_ready()
        self.rl_lr = RLLearningRate(self.learners, cfg)
        self.weight_sync = WeightSync(self.learners, cfg.sync)
        if cfg.distill.enabled:  # distillation's teacher, loading beside the rest (cluster/runtime/teacher.py)
            fleet = teacher.start_teacher(cfg, self.tokenizer, self.run_dir, wait=False)
            self.distiller = Distiller(cfg.distill, fleet)
        self.fleet = services.EngineFleet(cfg, self.model_path, self.run_dir / "cache", self.weight_sync)
        self.fleet.start(cfg.rollout.num_engines)
        self.reward_groups = services.RewardGroups(cfg.reward.num_cpus_per_worker, cfg.reward.node_resources,
                                                   cfg.cluster.placement_timeout_s)
        self.rewards = RewardPool(cfg.reward, scheduling_strategy_factory=self.reward_groups,
                                  **deadlines.reward_pool_options(cfg.deadlines))
        if cfg.reward.judge.enabled:  # an LLM judge beside the verifiers (cluster/runtime/judge.py)
            self.rewards = judge.start_judged(cfg, self.rewards, self.run_dir)
        if cfg.env.enabled:  # multi-turn episodes: env workers beside the reward workers
            self.env_groups = services.RewardGroups(cfg.env.num_cpus_per_worker, cfg.env.node_resources,
                                                    cfg.cluster.placement_timeout_s)
            pool = EnvPool(cfg, self.env_groups)
            if cfg.env.agent_program:  # agent programs behind the session gateway
                self.episodes, self.gateway = gateway_episodes.start_gateway_runner(cfg, self.fleet, pool,
                                                                                   self.tokenizer)
            else:
                self.episodes = agent_loop.EpisodeRunner(cfg, self.fleet, pool, self.tokenizer)
        self.learners.wait_ready()
        if self.distiller is not None:
            self.distiller.teacher.wait_ready()
        self.placement = placement.PlacementRecord(self.run_dir)  # placement.json, rewritten at every sync
        self.placement.update(self.learners, self.fleet, self.reward_groups, self.env_groups,
                              placement.served_fleets(self.rewards, self.distiller))  # judge, teacher engines
        log.info("services up in %.1fs: %d learner ranks, %d engines, %d reward workers",
                 time.perf_counter() - t0, cfg.learner.world_size, len(self.fleet), cfg.reward.num_workers)

    # -- pieces of a step ---------------------------------------------------------------------------------
    def _sync_weights(self, version: int) -> float:
        """Stream the learner's weights into every engine as ``version``; keeps the sync's bytes and seconds
        for the step's metrics (``sync/*``). Returns the wall time."""
        t = time.perf_counter()
        report = self.fleet.sync(version)
        self.state.weight_version = version
        seconds = time.perf_counter() - t
        self.placement.update(self.learners, self.fleet, self.reward_groups, self.env_groups,  # after any engine
                              placement.served_fleets(self.rewards, self.distiller))  # replacement, served ones too
        # sync/cross_node: engines on another node than learner rank 0 (their bytes crossed between nodes)
        self.last_sync = {**report.metrics(seconds), "sync/cross_node": float(self.placement.cross_node)}
        return seconds

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics (``cluster.driver.evaluation.evaluate``)."""
        if self.cfg.sync.in_flight != "off":  # partial episodes' open turns end first: the eval shares the engines
            self.collector.drain_turns()
        verifiers = getattr(self.rewards, "verifiers", self.rewards)  # held-out accuracy: the verifiers' (no judge)
        return evaluate(self.cfg, self.fleet, verifiers, self.eval_rows, self.episodes)

    def warm_start(self) -> dict[str, float]:
        """Supervised warm start (``cluster.driver.warm_start``), then the engines receive the new weights."""
        out = warm_start(self.learners, self.cfg, self.train_rows, self.tokenizer, self.pad_id, self.sft_rng)
        self._sync_weights(self.weight_version + 1)
        self.state.warm_start_done = True
        return out

    def train(self, c: Collected, rewards: torch.Tensor) -> tuple[RolloutTrainResult, float]:
        """Prepare (group advantages, padded batch, split per rank and minibatch) and train on ``c``.
        Returns (the learner's result, learner seconds)."""
        cfg, tc = self.cfg, self.cfg.trainer
        # per sequence, or per turn for gspo_token episodes with per-turn rewards (batching.rollout_advantages)
        adv = rollout_advantages(c.completions, rewards, tc.group_size, algorithm=cfg.learner.algorithm,
                                 normalize_std=cfg.learner.advantage_std())
        if self.distiller is not None:  # per token: reward_weight x A_i - kl_coef x k (cluster/driver/distill.py)
            adv = self.distiller.advantages(c, adv)
        episodes = [(r.detail.get("episode_id", ""), r.detail.get("branch", 0)) for r in c.results]
        # env.gateway.fork_policy=all: every episode's other branches beside it, with its reward and advantage
        completions, adv, episodes = with_branches(c.completions, adv, episodes, getattr(c, "branches", {}),
                                                   cfg.learner.num_minibatches * cfg.learner.world_size, self.pad_id)
        batch = build_train_batch(completions, adv.returns, adv.advantages, self.pad_id)
        plans = split_for_ranks(batch, cfg.learner.num_minibatches, cfg.learner.world_size, seed=tc.seed + self.step)
        audit_dir = None
        if self.step + 1 in tc.audit_steps:
            audit_dir = audit_dump.save_inputs(cfg, self.run_dir, self.learners, self.step + 1, batch, plans,
                                               model_path=self.model_path, train_rows=self.train_rows,
                                               weight_version=self.weight_version, completions=completions)
        self.rl_lr.apply(self.step)
        t = time.perf_counter()
        source = behaviour.source_for_step(cfg.learner, self.state, self.step + 1)  # auto: its switch, checkpointed
        result = self.learners.train(plans, cfg.health.guard(), monitor=monitor_step(cfg, self.step + 1),
                                     behaviour=source)
        learner_s = time.perf_counter() - t
        if switched := behaviour.record_step(cfg.learner, self.state, self.step + 1, source, result.metrics):
            log.warning("%s", switched)
        if self.episodes is not None:  # the engines' records against what the ranks trained (must be 0)
            self.token_check.drain(self.fleet.engines)
            c.reward_metrics.update(self.token_check.compare(
                self.learners.trained_turns(), episodes, checked=not result.skipped))
        if audit_dir is not None:
            audit_dump.save_outputs(self.learners, audit_dir, result.record())
        return result, learner_s

    def after_train(self, result: RolloutTrainResult, m: dict[str, Any]) -> float:
        """Sync the new weights, or count a refused step (the engines keep their weights; a rollback throws
        away a rollout collected ahead); the guard's counts go into the step's metrics ``m``. Returns the sync
        seconds.

        Raises:
            HealthStop: the guard's policy stops the run (``cluster.driver.guard``).
        """
        if not result.skipped:
            self.guard.good_step()
            return self._sync_weights(self.weight_version + 1)
        ck = self.guard.refused(self.step + 1, result, m)
        if ck is not None:
            self.learners.load_checkpoint(str(ck / "learner"))
            self.rl_lr.forget()  # the checkpoint brought its own lr back
            self._sync_weights(self.weight_version + 1)
            self.guard.rolled_back(ck, m)
            if self.pending is not None:
                self.stream.position = self.pending.start_position  # collected with weights rolled back over
                self.pending = None
            buffer = getattr(self.collector, "buffer", None)  # partial rollouts: samples of the same weights
            if buffer is not None:
                log.info("rollback: %d in-flight samples of partial rollouts sampled again", buffer.restart_all())
        return 0.0

    def _collect(self, step: int) -> Collected:
        """The rollout of RL step ``step + 1`` (``Collector.collect``), with the teacher's log-probs when
        distilling (``Distiller.annotate``)."""
        c = self.collector.collect(step)
        if self.distiller is not None:
            self.distiller.annotate(c)
        return c

    def rl_step(self) -> dict[str, Any]:
        """One RL step: scale if asked (``control.yaml``), collect and score (or take the rollout collected
        during the previous step), train (meanwhile collecting the next step's rollout when
        ``trainer.max_staleness=1``, or running partial rollouts' rounds with ``trainer.partial_rollout_overlap``),
        sync, and the step's metrics (see README for their names)."""
        t_step = time.perf_counter()
        deadlines.set_step(self.step + 1)  # named by a PhaseTimeout
        apply_control(self.run_dir, self.fleet, self.rewards, self.episodes.pool if self.episodes else None)
        restarts = self.fleet.restarts
        c, self.pending = self.pending or self._collect(self.step), None
        if self.distiller is not None and c.teacher_logprobs is None:  # collected before a teacher was asked
            self.distiller.annotate(c)
        rewards = torch.tensor([r.score for r in c.results], dtype=torch.float32)
        ahead, stop, tc = None, None, self.cfg.trainer
        beside = self.step + 1 < tc.total_steps and not monitor_step(self.cfg, self.step + 2)
        if tc.max_staleness and not tc.partial_rollouts and beside:
            ahead = self._pool.submit(self._collect, self.step + 1)  # engines sample with the current weights
        elif tc.partial_rollout_overlap and beside:
            stop = threading.Event()  # set when the learner is done: the round under way completes, then the sync
            ahead = self._pool.submit(self.collector.rounds_beside, stop)
        result: RolloutTrainResult | None = None
        learner_s, sync_s, t_wait, in_flight_sync = 0.0, 0.0, None, False
        try:
            m: dict[str, Any] = {"step": self.step + 1, **step_metrics.staleness(
                c, self.weight_version, self.cfg.trainer.max_staleness, self.step + 1)}
            ages = step_metrics.token_ages(c, self.weight_version)
            if c.prompts:
                result, learner_s = self.train(c, rewards)
            else:
                log.warning("step %d: no informative group; no update", self.step + 1)
        finally:
            if ahead is not None:  # never leave the rollout thread running into a shutdown
                if stop is not None:
                    in_flight_sync = self.cfg.sync.in_flight != "off" and result is not None and not result.skipped
                    try:
                        if in_flight_sync:  # sync.in_flight: the engines load while the rounds go on
                            sync_s = self.after_train(result, m)
                    finally:
                        stop.set()
                t_wait = time.perf_counter()
                wait_futures([ahead])
        # the learner's step done, how long the driver still waited for the rollout collected ahead (0 on-policy)
        wait_s = time.perf_counter() - t_wait if t_wait is not None else 0.0
        # no request is in flight at the sync below unless sync.in_flight (rounds beside the learner return None:
        # they fill the buffer)
        self.pending = ahead.result() if ahead is not None else None
        if result is not None:
            m.update(result.metrics)
            if not in_flight_sync:
                sync_s = self.after_train(result, m)
            if warning := step_metrics.correction_warning(result.metrics, self.cfg.learner):
                log.warning("step %d: %s", self.step + 1, warning)
            if sync_s:
                m.update(self.last_sync)
        self.state.step += 1
        self.trained_uids.append([r.uid for r in c.prompts])
        if self.prompt_log is not None:
            self.prompt_log.log(self.step, self.trained_uids[-1], c.start_position, c.end_position,
                                skipped=result is None or result.skipped)
        m.update(step_metrics.rollout_metrics(self.cfg, c, rewards))
        m.update(ages)  # the batch's tokens per weight version (rollout/tokens_age_<a>)
        m.update(self.run_metrics(learner_s, sync_s, restarts))
        by_length = result.by_response_length if result is not None else {}
        m.update(step_metrics.length_metrics(self.cfg, c, rewards, by_length))
        m.update(partial_rollout.step_metrics(self.collector, c))
        m["timing/wait_rollout_s"] = wait_s
        m.update(self.fleet.take_settled())  # sync.load_beside_learner: the engines' loads waited for in this step
        m["timing/step_s"] = time.perf_counter() - t_step
        return m

    def run_metrics(self, learner_s: float, sync_s: float, restarts: int) -> dict[str, Any]:
        """The learner and sync timings, weight version, epoch and fleet sizes of a step."""
        return {"timing/learner_s": learner_s, "timing/weight_sync_s": sync_s,
                "weight_version": self.weight_version, "data/epoch": float(self.stream.epoch),
                "fault/rollout_restarts": float(self.fleet.restarts - restarts),
                "rollout/num_engines": float(len(self.fleet)), "reward/num_workers": float(self.rewards.num_workers)}

    # -- checkpoints --------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write a checkpoint of the learner and the driver's state (``cluster.driver.resume``)."""
        self.state.stream_position = self.stream.position
        self.state.sft_rng = self.sft_rng.getstate()
        if self.episodes is not None:  # the turns sampled so far travel with the checkpoint (the token check)
            self.token_check.drain(self.fleet.engines)
        return save_checkpoint(self.run_dir, self.cfg, self.learners, self.state, self.pending, self.data_fingerprint,
                               partial=getattr(self.collector, "buffer", None), token_records=self.token_check.state())

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Warm start (unless resumed past it), the step-0 evaluation, the RL steps with evaluations and
        checkpoints, then curves and ``summary.json``. Returns the summary."""
        cfg, tc = self.cfg, self.cfg.trainer
        summary: dict[str, Any] = {}
        if not self.state.warm_start_done and cfg.warm_start.steps > 0 and self.step == 0:
            summary.update(self.warm_start())
        if cfg.learner.lora.rank:  # learner.lora: RL trains an adapter over the weights so far (B = 0: no sync)
            self.learners.call("enable_lora")
        if self.step == 0:
            ev = self.evaluate()
            self.logger.log({"step": 0, "weight_version": self.weight_version, **ev, **summary})
            summary["eval/accuracy_start"] = ev["eval/accuracy"]
            log.info("held-out accuracy before RL: %.3f (%d prompts)%s", ev["eval/accuracy"], len(self.eval_rows),
                     "".join(f", {k[5:]} {v:.3f}" for k, v in ev.items() if k.startswith(("eval/pass@", "eval/mean@"))))
        run_with_progress(self.step, tc.total_steps, self.logged_step)
        devices.record(self.learners, self.fleet, self.run_dir / devices.DEVICES_FILE, precision=cfg.precision_report)
        hist = self.logger.history
        summarize(hist, summary)
        summary["timing/total_s"] = time.perf_counter() - self.t_start
        if tc.plots:
            plot_curves(hist, self.run_dir / "curves.png")
            length_slices.plot_length_slices(hist, self.run_dir / "length_slices.png")
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def logged_step(self) -> dict[str, Any]:
        """One RL step with its evaluation (every ``trainer.eval_every`` steps and at the end), its metrics
        logged and its checkpoint (every ``trainer.save_every`` steps and at the end). Returns the metrics."""
        tc = self.cfg.trainer
        m = self.rl_step()
        final = self.step == tc.total_steps
        if final or (tc.eval_every and self.step % tc.eval_every == 0):
            m.update(self.evaluate())
        self.logger.log(m)
        if final or (tc.save_every and self.step % tc.save_every == 0):
            self.save()
        return m

    def shutdown(self) -> None:
        """Close the logger and stop every service (engines, reward workers, learner ranks and their groups)."""
        if self.logger is not None:
            self.logger.close()
        if self.fleet is not None:
            self.fleet.shutdown()
        if self.rewards is not None:
            self.rewards.shutdown()
            self.reward_groups.remove_all()
        if self.distiller is not None:
            self.distiller.teacher.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.episodes is not None:
            self.episodes.pool.shutdown()
            self.env_groups.remove_all()
        if self.gateway is not None:
            self.episodes.stop_gateway()  # the actor goes with the job; this stops requests (and the harness)
        if self.learners is not None:
            self.learners.shutdown()
