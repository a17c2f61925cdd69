"""The learner's ranks as one group: started in placement groups, driven together, failing fast.

Every call below goes to every rank (most learner methods are collective: a rank alone would wait for its
peers in a collective until ``learner.dist_timeout_s``), and results are collected with ``deadlines.get``, so
one dead rank stops the driver at once instead of after a peer's timeout. Every call has a deadline
(``cluster.runtime.deadlines``; ``LEARNER_PHASES`` maps a method to its phase): a rank past it stops the run with a
``PhaseTimeout`` naming it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.common import free_port
from cluster.config import Config
from cluster.planning.actor_placement import learner_ranks_per_group
from cluster.runtime import deadlines
from cluster.runtime.services import actor_env, wait_ready
from learner.contracts import RolloutTrainResult, SFTBatch, SFTStepResult, SyncReport

log = logging.getLogger(__name__)

# MKL's conditional numerical reproducibility, strict: the float32 GEMMs of a CPU rank give the same bits at any
# thread count (MKL's default picks other kernels for some shapes at 2 threads than at 1, e.g. 5-11 rows: an MoE
# expert given that few tokens), on the code path MKL picks for this CPU (AUTO). Read once, when MKL starts: it
# has to be in the rank's environment before the process starts (mkl_cbwr_set refuses a change after).
MKL_STRICT_CNR = "AUTO,STRICT"
RENDEZVOUS_ATTEMPTS = 3  # starts of the ranks when their rendezvous port is taken before rank 0 binds it
RANK0_ERROR_WAIT_S = 30.0  # how long a failed start waits for rank 0's own error before giving up on a retry
#: The deadline phase of a learner method (``deadlines.*``); any other method is bounded by ``learner_step_s``.
LEARNER_PHASES = {"pid": "start", "train_rollout_batch": "learner_step", "sft_step": "learner_step",
                  "sync_weights": "sync", "save_checkpoint": "checkpoint_save", "load_checkpoint": "checkpoint_load"}
#: The methods each ``deadlines.debug_hang`` phase makes hang (its first call on one rank).
HANG_METHODS = {"learner_step": ("train_rollout_batch", "sft_step"), "sync": ("sync_weights",),
                "checkpoint_save": ("save_checkpoint",), "checkpoint_load": ("load_checkpoint",)}


def _node_address() -> tuple[str, int]:
    """This node's IP address (as Ray knows it) and a port free on every address of the node: torch's TCPStore
    listens on all of them, so a port free only on ``ip`` can be taken on 127.0.0.1 (a local head's dashboard
    was: EADDRINUSE in a 3-node run on one machine). The probe binds and closes at once; nothing listens."""
    ip = ray.util.get_node_ip_address()
    return ip, free_port("0.0.0.0")


def learner_env(cfg: Config) -> dict[str, str]:
    """The environment of a learner rank: ``actor_env`` for its threads and device, and, for a CPU rank under
    ``trainer.deterministic``, ``MKL_CBWR`` (the driver's own value when it has one, else ``MKL_STRICT_CNR``), so
    that its digits do not follow its thread count (``learner.max_threads_per_rank``'s elastic threads)."""
    lc = cfg.learner
    env = actor_env(lc.threads_per_rank, "cuda" if lc.num_gpus_per_rank else "cpu")
    if cfg.trainer.deterministic and not lc.num_gpus_per_rank:
        env["MKL_CBWR"] = os.environ.get("MKL_CBWR", MKL_STRICT_CNR)
    return env


class LearnerGroup:
    """``learner.world_size`` DeepSpeed ranks (``learner.service.LearnerRank`` actors, rank order).

    On GPUs one STRICT_PACK placement group per node (``cluster.gpus_per_node`` GPUs each), so the ranks of a
    node share NVLink and the learner can span nodes; on the CPU one PACK group. The constructor returns while
    the ranks still build their models (they rendezvous with each other meanwhile): call ``wait_ready``
    before the first call.

    Args:
        cfg: the run config.
        model_path: the Hugging Face model folder every rank loads.
    """

    def __init__(self, cfg: Config, model_path: str):
        lc = cfg.learner
        # The driver may call from two threads (the overlapped rollout replaces a dead engine, which syncs it):
        # submissions to the ranks are serialised so that no rank sees two collective calls in another order.
        self._submit = threading.Lock()
        bundle = {"CPU": lc.num_cpus_per_rank, **lc.node_resources}
        if lc.num_gpus_per_rank:
            bundle["GPU"] = lc.num_gpus_per_rank
        per_group = learner_ranks_per_group(cfg, cfg.cluster.gpus_per_node)  # the plan places them alike
        self.groups: list[Any] = []
        for start in range(0, lc.world_size, per_group):
            bundles = [dict(bundle) for _ in range(min(per_group, lc.world_size - start))]
            pg = placement_group(bundles, strategy="STRICT_PACK" if lc.num_gpus_per_rank else "PACK")
            wait_ready(pg, "learner", bundles, cfg.cluster.placement_timeout_s)
            self.groups.append(pg)
        self._cfg, self._model_path, self._per_group = cfg, model_path, per_group
        self.rendezvous_retries = 0  # rank 0's rendezvous port taken between the probe and its bind (logged)
        self.actors: list[Any] = self._spawn()

    def _spawn(self) -> list[Any]:
        """The rank actors (they start building at once), rendezvousing at a fresh address."""
        from learner.service import LearnerRank

        cfg, lc, per_group = self._cfg, self._cfg.learner, self._per_group
        master_addr, port = self._rendezvous(cfg)
        hang = cfg.deadlines.debug_hang
        cls = ray.remote(deadlines.hang_hook(LearnerRank, HANG_METHODS.get(str(hang), ()), str(hang), cfg.deadlines))
        return [
            cls.options(
                num_cpus=lc.num_cpus_per_rank,
                num_gpus=lc.num_gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.groups[rank // per_group], placement_group_bundle_index=rank % per_group
                ),
                runtime_env={"env_vars": learner_env(cfg)},
            ).remote(
                self._model_path, lc, rank=rank, world_size=lc.world_size, master_addr=master_addr,
                master_port=port, seed=cfg.trainer.seed, temperature=cfg.rollout.temperature,
                warm_start=cfg.warm_start,
            )
            for rank in range(lc.world_size)
        ]

    def _rendezvous(self, cfg: Config) -> tuple[str, int]:
        """Rank 0's node address and its rendezvous port: 0 for a single rank (its store binds any free port
        itself, so nothing can take it first), else a port free there now (a probe task in rank 0's bundle
        when the run may span nodes; the bind host when it is local)."""
        if len(self.groups) > 1 or cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS"):
            strategy = PlacementGroupSchedulingStrategy(self.groups[0], placement_group_bundle_index=0)
            probe = ray.remote(_node_address).options(num_cpus=0, scheduling_strategy=strategy).remote()
            addr, port = deadlines.get([probe], ["the rendezvous probe on rank 0's node"], "start",
                                       cfg.deadlines.start_s, "deadlines.start_s")[0]
        else:
            addr, port = cfg.trainer.bind_host, free_port("0.0.0.0")
        return addr, 0 if cfg.learner.world_size == 1 else port

    def __len__(self) -> int:
        return len(self.actors)

    # -- calls on every rank ------------------------------------------------------------------------------
    def call(self, method: str, *args, **kwargs) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank; the results in rank order. Fails fast."""
        with self._submit:  # every rank receives the driver's calls in the same order (collectives)
            refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
        return self._get(method, refs)

    def call_sharded(self, method: str, per_rank: list[tuple], **kwargs) -> list[Any]:
        """``method(*per_rank[r], **kwargs)`` on rank ``r``; the results in rank order. Fails fast."""
        if len(per_rank) != len(self.actors):
            raise ValueError(f"{len(per_rank)} argument tuples for {len(self.actors)} learner ranks")
        with self._submit:
            refs = [getattr(a, method).remote(*args, **kwargs) for a, args in zip(self.actors, per_rank)]
        return self._get(method, refs)

    def _get(self, method: str, refs: list[Any]) -> list[Any]:
        """The ranks' results of ``method``, within its phase's deadline (``LEARNER_PHASES``); fails fast.

        Raises:
            cluster.runtime.deadlines.PhaseTimeout: a rank past the deadline (named, its stacks logged).
        """
        phase = LEARNER_PHASES.get(method, "learner_step")
        key = "deadlines.checkpoint_s" if phase.startswith("checkpoint") else f"deadlines.{phase}_s"
        named = phase if method in LEARNER_PHASES else f"learner_step ({method})"
        return deadlines.get(refs, list(self.actors), named, self._cfg.deadlines.seconds(phase), key)

    def wait_ready(self) -> None:
        """Block until every rank finished its constructor (raises the rank's error if one failed).

        Between the driver's probe and rank 0's bind, another process on the node can take a multi-rank
        learner's rendezvous port (EADDRINUSE: seen once in CI): the ranks are then started again at a fresh
        port, at most ``RENDEZVOUS_ATTEMPTS`` times in all, each retry logged and counted in
        ``rendezvous_retries``.

        Raises:
            ray.exceptions.RayActorError: a rank's constructor failed (for another reason, or every attempt).
        """
        for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
            try:
                self.call("pid")
                return
            except ray.exceptions.RayActorError as e:
                if not self._port_taken(e) or attempt == RENDEZVOUS_ATTEMPTS:
                    raise
            log.warning("learner rendezvous port taken before rank 0 bound it (EADDRINUSE); starting the %d "
                        "ranks again at a fresh port (attempt %d of %d)", len(self.actors), attempt + 1,
                        RENDEZVOUS_ATTEMPTS)
            for a in self.actors:
                ray.kill(a)
            self.rendezvous_retries += 1
            self.actors = self._spawn()

    def _port_taken(self, err: Exception) -> bool:
        """Whether a failed start is rank 0's bind on a taken port: in ``err``, or in rank 0's own error when
        another rank failed first (a peer that connected to the other process's port)."""
        if "EADDRINUSE" in str(err):
            return True
        try:
            ray.get(self.actors[0].pid.remote(), timeout=RANK0_ERROR_WAIT_S)
        except ray.exceptions.RayError as rank0:
            return "EADDRINUSE" in str(rank0)
        return False

    def train(self, plans: list[Any], guard: dict[str, float] | None,
              monitor: bool | None = None, behaviour: str | None = None) -> RolloutTrainResult:
        """One RL update: rank ``r`` trains on ``plans[r]`` (``cluster.driver.batching.RankPlan``); ``monitor``:
        whether the mismatch monitor's pass runs, ``behaviour``: the step's behaviour log-probs' source
        (``LearnerRank.train_rollout_batch``). Returns rank 0's ``RolloutTrainResult`` (identical on every
        rank)."""
        outs = self.call_sharded("train_rollout_batch", [(p.minibatches, p.num_sequences, p.num_tokens) for p in plans],
                                 guard=guard, monitor=monitor, behaviour=behaviour)
        return outs[0]

    def trained_turns(self) -> list[tuple[int, int, str]]:
        """Every rank's sampled turns of the last rollout batch, as it trained them (``LearnerRank.
        take_trained_turns``), ranks in order: ``(context_len, sampled_len, digest)`` per turn."""
        return [t for rank in self.call("take_trained_turns") for t in rank]

    def sft_step(self, batch: SFTBatch, num_tokens: int) -> SFTStepResult:
        """One supervised step on ``batch``, cut into equal contiguous shards per rank; rank 0's
        ``SFTStepResult`` (identical on every rank)."""
        per = len(batch) // len(self.actors)
        shards = [(SFTBatch(batch.input_ids[lo:lo + per], batch.attention_mask[lo:lo + per],
                            batch.loss_mask[lo:lo + per]), num_tokens)
                  for lo in range(0, per * len(self.actors), per)]
        return self.call_sharded("sft_step", shards)[0]

    def sync_weights(self, engines: list[Any], version: int | None, bucket_mb: float, max_in_flight: int,
                     engine_timeout_s: float | None = None, transport: str = "object_store",
                     defer: bool = False) -> SyncReport | None:
        """Stream the weights to ``engines`` as ``version`` (every rank takes part: ZeRO-3 gathers); rank 0's
        ``SyncReport`` (``learner.weight_sync.sync_weights``; ``defer``: the engines' last calls left pending;
        ``version`` None: the learner's own count, ``LearnerRank.current_version``)."""
        return self.call("sync_weights", engines, version, bucket_mb, max_in_flight, engine_timeout_s, transport,
                         defer)[0]

    def save_checkpoint(self, path: str) -> None:
        self.call("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self.call("load_checkpoint", path)

    def shutdown(self) -> None:
        """Leave the process groups, kill the actors and free the placement groups (so a next run in the
        same Ray session finds the resources free)."""
        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(a)
        for pg in self.groups:
            remove_placement_group(pg)
        self.actors, self.groups = [], []
