"""The typed run config: YAML file + dotted overrides, validated before any actor starts.

Each service owns its section (``rollout/config.py``, ``reward/config.py``, ``learner/config.py``); this
module composes them with the run-level sections (``cluster/config_sections.py``) and checks the combinations
that span sections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, model_validator

from cluster.config_sections import (
    ClusterConfig,
    DeadlinesConfig,
    DataConfig,
    DistillConfig,
    HealthConfig,
    ModelConfig,
    Section,
    SyncConfig,
    TrainerConfig,
    WandbConfig,
)
from cluster.models.hub_model import is_hub_id
from cluster.models.resolve import check_builtin
from cluster.precision import resolve as resolve_precision
from learner.config import LearnerConfig, WarmStartConfig
from learner.loss_settings import AUDITED_ALGORITHMS
from reward.config import EnvConfig, RewardConfig
from rollout.config import RolloutConfig


# vLLM's sampling-temperature range (vllm/sampling_params.py, ``SamplingParams``: ``__post_init__`` raises a
# temperature in (0, _MAX_TEMP) to _MAX_TEMP = 0.01; ``_verify_args`` refuses one above 2). Copied here so the
# config loads without importing vLLM; tests/unit/cluster/test_config.py reads both from the installed vLLM.
VLLM_MIN_TEMPERATURE = 0.01
VLLM_MAX_TEMPERATURE = 2.0


class Config(Section):
    """A whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    deadlines: DeadlinesConfig = Field(default_factory=DeadlinesConfig)
    precision: Literal["auto", "bf16", "fp32"] | None = Field(
        None, description="one switch for the run's precision (cluster/precision.py): 'bf16' sets rollout.dtype and "
        "learner.dtype to bfloat16 (DeepSpeed bf16 with fp32 master weights; needs learner.zero_stage >= 1), "
        "learner.autocast off and learner.old_logprob_source=recompute (a bf16 engine's log-probs widen GSPO's clip "
        "fraction, docs/results.md); 'fp32' the dtypes float32; 'auto' bf16 where the learner and the engines run on "
        "GPUs or on a CPU with avx512_bf16 or amx_bf16 (this machine's /proc/cpuinfo), fp32 elsewhere. Keys the config "
        "sets win: with bf16/fp32 one set to the other precision is refused naming both, the rest are filled only "
        "where unset; with auto set keys steer the choice. The choice is logged at start and in devices.json. "
        "null = each key as set (no switch)")
    _precision_report: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _resolve_precision(self) -> "Config":
        """``precision`` applied to the keys it sets, before the checks that read them (cluster/precision.py)."""
        self._precision_report = resolve_precision(self)
        return self

    @property
    def precision_report(self) -> dict[str, Any]:
        """What ``precision`` chose and set (``cluster.precision.resolve``'s report)."""
        return self._precision_report

    @model_validator(mode="after")
    def _check_combinations(self) -> "Config":
        for field, path in (("model.path", self.model.path), ("reward.judge.model_path", self.reward.judge.model_path),
                            ("distill.model_path", self.distill.model_path)):
            check_builtin(path, field)
        t, lr = self.trainer, self.learner
        n = t.prompts_per_step * t.group_size
        per_rank_groups = lr.num_minibatches * lr.world_size
        if t.prompts_per_step % per_rank_groups:
            raise ValueError(
                f"trainer.prompts_per_step={t.prompts_per_step} must divide into learner.num_minibatches="
                f"{lr.num_minibatches} x learner.world_size={lr.world_size} (whole groups per minibatch and rank)"
            )
        per_rank = n // per_rank_groups
        if per_rank % lr.micro_batch_size:
            raise ValueError(
                f"learner.micro_batch_size={lr.micro_batch_size} must divide the sequences per minibatch and rank "
                f"({n} / ({lr.num_minibatches} x {lr.world_size}) = {per_rank})"
            )
        ws = self.warm_start
        if ws.steps and ws.batch_size % lr.world_size:
            raise ValueError(
                f"warm_start.batch_size={ws.batch_size} must be a multiple of learner.world_size={lr.world_size}"
            )
        if self.rollout.top_p != 1.0 or self.rollout.top_k != -1:
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p}, rollout.top_k={self.rollout.top_k}: training rollouts need "
                "top_p=1 and top_k=-1, or the behaviour log-probs are not those of the policy being trained"
            )
        d = self.data
        if d.task in ("files", "gsm8k") and not d.train_path:
            raise ValueError(f"data.task={d.task!r} needs data.train_path (and data.test_path, or data.eval_fraction)")
        if d.task == "files" and ws.steps and not d.solution_key:
            raise ValueError(f"warm_start.steps={ws.steps} with data.task='files' needs data.solution_key (the field "
                             "holding the demonstrations); or set warm_start.steps=0")
        if lr.pre_update_pass == "never" and lr.pre_update_pass_needs(self.health.guard()):
            raise ValueError(
                "learner.pre_update_pass='never' is refused: "
                + ", ".join(lr.pre_update_pass_needs(self.health.guard())) + " need(s) the pre-update pass"
            )
        if t.audit_steps and lr.algorithm not in AUDITED_ALGORITHMS:
            raise ValueError(
                f"trainer.audit_steps={t.audit_steps} is refused with learner.algorithm={lr.algorithm!r}: the offline "
                f"ratio audit recomputes {', '.join(AUDITED_ALGORITHMS)} only (learner/audit_checks.py)")
        if t.audit_steps and lr.rollout_correction != "off":
            raise ValueError(
                f"trainer.audit_steps={t.audit_steps} is refused with learner.rollout_correction="
                f"{lr.rollout_correction!r}: the offline ratio audit recomputes the loss without the correction's "
                "weights and masks")
        if t.max_staleness and t.audit_steps:
            raise ValueError(
                f"trainer.audit_steps={t.audit_steps} is refused with trainer.max_staleness={t.max_staleness}: the "
                "audit recomputes a step at the weights that sampled it, which the overlapped mode has already updated"
            )
        # rank 0's engine waits between two learner collectives share one deadline; before the first bucket a
        # collective sync has two such phases (the engines' start, the transfer group's build)
        phases = 2 if self.sync.transport == "collective" else 1
        if phases * self.sync.engine_timeout_s >= lr.dist_timeout_s:
            raise ValueError(
                f"sync.engine_timeout_s={self.sync.engine_timeout_s:g}"
                + (" x 2 (sync.transport=collective: the engines' start, then the group's build)" if phases == 2 else "")
                + f" must be below learner.dist_timeout_s={lr.dist_timeout_s:g}: the other learner ranks wait in a "
                "collective while rank 0 waits for an engine"
            )
        if self.deadlines.sync_s <= phases * self.sync.engine_timeout_s:
            raise ValueError(f"deadlines.sync_s={self.deadlines.sync_s:g} must be above sync.engine_timeout_s="
                             f"{self.sync.engine_timeout_s:g}" + (" x 2" if phases == 2 else "") + ": the learner's "
                             "sync outlives its waits for a hung engine, which is replaced, not the run stopped")
        if t.length_buckets > self.rollout.max_response_tokens:
            raise ValueError(f"trainer.length_buckets={t.length_buckets} exceeds rollout.max_response_tokens="
                             f"{self.rollout.max_response_tokens} (a bucket holds at least one length)")
        self._check_lengths()
        self._check_node_resources()
        self._check_temperature()
        self._check_routing_replay()
        self._check_partial_rollouts()
        self._check_transport()
        self._check_env()
        self._check_distill()
        return self

    def _check_distill(self) -> None:
        """On-policy distillation (``distill``): a loss that trains on per-token advantages, no dynamic sampling on
        a reward that is only logged, a teacher context that holds every sample, and the student's tokenizer
        (``cluster.models.tokenizer_match``; compared here where both can be read without downloading, else at
        the run's start)."""
        d, algorithm = self.distill, self.learner.algorithm
        if not d.enabled:
            return
        if algorithm in ("gspo", "ppo"):
            why = ("trains on one advantage per sequence; use learner.algorithm=gspo_token (GSPO-token, the GSPO "
                   "paper's section 4.3: token-wise advantages with the sequence ratio)" if algorithm == "gspo" else
                   "trains on its critic's GAE advantages; use gspo_token or grpo")
            raise ValueError(f"distill.model_path={d.model_path!r} (on-policy distillation: per-token advantages) is "
                             f"refused with learner.algorithm={algorithm!r}, which {why}")
        if d.reward_weight == 0 and self.trainer.dynamic_sampling:
            raise ValueError("trainer.dynamic_sampling=true is refused with distill.reward_weight=0: the reward is "
                             "only logged, so groups of equal rewards still carry the teacher's signal")
        need = self.rollout.max_model_len + 1
        if d.max_model_len is None:
            d.max_model_len = need
        elif d.max_model_len < need:
            raise ValueError(f"distill.max_model_len={d.max_model_len} must be at least rollout.max_model_len + 1 = "
                             f"{need}: the teacher scores whole samples (prompt + response) and generates one token "
                             "after them")
        from cluster.models.tokenizer_match import check_same_tokenizer, identity_of

        student, teacher = identity_of(self.model.path), identity_of(d.model_path)
        if student is not None and teacher is not None:
            check_same_tokenizer(student, teacher, self.model.path, d.model_path)

    def _check_env(self) -> None:
        """Multi-turn episodes (``env``): a known tool-call format, and what the agent loop does not carry
        refused by name (a segment length for partial rollouts, which go turn by turn; rows already rendered by a
        chat template: the loop renders an episode's first messages with the tools itself; an LLM judge, which
        scores single answers)."""
        if self.env.enabled and self.reward.judge.enabled:
            raise ValueError(f"reward.judge.model_path={self.reward.judge.model_path!r} is refused with env set: "
                             "episodes are scored by their environments, the judge scores single answers")
        if not self.env.enabled:
            if self.data.task == "agent_calc":
                raise ValueError("data.task='agent_calc' needs env.tools (e.g. [reward.envs.calculator:calc]) and "
                                 "env.tool_format ('tag', or 'hermes' with a chat template): its problems are solved "
                                 "with a calculator tool")
            if self.data.task == "agent_guess":
                raise ValueError("data.task='agent_guess' needs env.cls (reward.envs.guess_number:GuessNumber) and "
                                 "env.tool_format='tag': its rows are games played with a guess tool")
            return
        if self.data.task == "agent_guess" and not self.env.cls and not self.env.openenv.enabled:
            raise ValueError("data.task='agent_guess' needs env.cls (reward.envs.guess_number:GuessNumber) or the "
                             "same game on an OpenEnv server (env.openenv), not env.tools: its rows configure the "
                             "game (meta low, high, guess_bonus)")
        from rollout.tool_calls import get_format

        get_format(self.env.tool_format)  # ValueError naming the known formats
        if self.trainer.partial_rollouts and self.trainer.partial_segment_tokens is not None:
            raise ValueError(f"trainer.partial_segment_tokens={self.trainer.partial_segment_tokens} is refused with "
                             "env set: an episode's partial rollout goes turn by turn (a turn is never split across "
                             "weight versions), leave it unset")
        if self.env.gateway.fork_policy == "all" and self.distill.enabled:
            raise ValueError("env.gateway.fork_policy=all is refused with distill on: the teacher's log-probs are "
                             "asked per episode, not per branch (use longest)")
        if self.env.agent_program and self.trainer.partial_rollouts:
            raise ValueError(f"trainer.partial_rollouts=true is refused with env.agent={self.env.agent!r} / env."
                             f"gateway.harness={self.env.gateway.harness!r}: agent "
                             "programs' episodes do not continue across weight syncs yet (set it false)")
        if self.data.apply_chat_template is True:
            raise ValueError("data.apply_chat_template=true is refused with env set: the agent loop renders an "
                             "episode's first messages with the chat template and the tools itself (use auto)")

    def _check_transport(self) -> None:
        """``sync.transport=collective`` broadcasts from learner rank 0 to the engine workers over one group:
        gloo when the learner is on the CPU, NCCL on a GPU. Both sides must be on the same kind of device (a
        gloo group carries CPU tensors, NCCL CUDA ones), and on GPUs every rank needs a GPU of its own: NCCL
        refuses two members of one group on one device, and whole GPUs are the only way Ray never shares one."""
        if self.sync.transport != "collective":
            return
        lr, ro = self.learner, self.rollout
        if bool(lr.num_gpus_per_rank) != bool(ro.num_gpus_per_engine):
            raise ValueError(
                f"sync.transport=collective needs the learner and the engines on the same kind of device "
                f"(learner.num_gpus_per_rank={lr.num_gpus_per_rank:g}, rollout.num_gpus_per_engine="
                f"{ro.num_gpus_per_engine:g}); use sync.transport=object_store")
        if lr.num_gpus_per_rank and (lr.num_gpus_per_rank < 1 or ro.num_gpus_per_engine < 1):
            raise ValueError(
                f"sync.transport=collective on GPUs needs whole GPUs (learner.num_gpus_per_rank="
                f"{lr.num_gpus_per_rank:g}, rollout.num_gpus_per_engine={ro.num_gpus_per_engine:g}): NCCL refuses "
                "two members of one group on one GPU; use sync.transport=object_store to share GPUs")

    def _check_node_resources(self) -> None:
        """Each role's ``node_resources`` names Ray custom resources only (not CPU, GPU, memory or ``node:...``,
        which have their own keys or are Ray's) with amounts > 0."""
        for role in ("rollout", "learner", "reward", "env"):
            for name, amount in getattr(self, role).node_resources.items():
                if not name or name in ("CPU", "GPU", "memory", "object_store_memory") or name.startswith("node:"):
                    raise ValueError(f"{role}.node_resources: {name!r} is not a custom resource name: CPUs and GPUs "
                                     "have their own keys")
                if not amount > 0:
                    raise ValueError(f"{role}.node_resources: {name}={amount!r}: amounts must be > 0")

    def _check_partial_rollouts(self) -> None:
        t = self.trainer
        if t.partial_rollout_overlap and not (t.partial_rollouts and t.max_staleness >= 2):
            raise ValueError(f"trainer.partial_rollout_overlap=true needs trainer.partial_rollouts=true and "
                             f"trainer.max_staleness >= 2 (got {t.partial_rollouts} and {t.max_staleness}): rounds "
                             "beside the learner make every token one version old, so a sample that spans a sync "
                             "needs a second version of the bound")
        self._check_in_flight()
        if not t.partial_rollouts:
            if t.max_staleness > 1:
                raise ValueError(f"trainer.max_staleness={t.max_staleness} needs trainer.partial_rollouts=true (without "
                                 "it the overlapped step keeps samples at most 1 version old: use 0 or 1)")
            return
        why = ("needs trainer.max_staleness >= 1" if t.max_staleness < 1 else
               "is refused with trainer.dynamic_sampling (groups finish across rounds; not implemented)"
               if t.dynamic_sampling else "")
        if why:
            raise ValueError(f"trainer.partial_rollouts=true {why}")
        seg, limit = t.partial_segment_tokens, self.rollout.max_response_tokens
        if seg is not None and limit % seg:
            raise ValueError(f"trainer.partial_segment_tokens={seg} must divide rollout.max_response_tokens={limit}")

    def _check_in_flight(self) -> None:
        """``sync.in_flight`` (keep / recompute): weights load while turns are open, which today only partial
        episodes do (single answers drain by rounds); the engine must step in this process (it reads vLLM's
        scheduler to stamp each token's version)."""
        mode = self.sync.in_flight
        if mode == "off":
            return
        why = ("needs trainer.partial_rollouts=true and env set (episodes whose turns stay open across syncs; "
               "single answers' partial rollouts do not use it yet)" if not (self.trainer.partial_rollouts
                                                                            and self.env.enabled) else
               "needs rollout.in_process=true (the engine reads vLLM's scheduler between steps)"
               if not self.rollout.in_process else "")
        if why:
            raise ValueError(f"sync.in_flight={mode!r} {why}")

    def _check_routing_replay(self) -> None:
        if self.learner.routing_replay == "rollout" and not self.rollout.return_routed_experts:
            raise ValueError(
                "learner.routing_replay='rollout' (R3) needs rollout.return_routed_experts=true: the engines must "
                "report the experts they ran for every sampled sequence"
            )

    def _check_lengths(self) -> None:
        """Every prompt the data admits plus a full-length response fits the engine's context, and DAPO's
        overlong shaping uses the rollout's length limit as its L_max (set from it when unset), as does Dr. GRPO's
        constant normaliser ``learner.loss_options.norm_length``."""
        ro, rw = self.rollout, self.reward
        if self.data.max_prompt_tokens + ro.max_response_tokens > ro.max_model_len:
            raise ValueError(
                f"data.max_prompt_tokens={self.data.max_prompt_tokens} + rollout.max_response_tokens="
                f"{ro.max_response_tokens} = {self.data.max_prompt_tokens + ro.max_response_tokens} exceeds "
                f"rollout.max_model_len={ro.max_model_len}: vLLM would cut long prompts' responses short "
                "(finish reason 'length') below the response limit"
            )
        if rw.max_response_tokens is not None and rw.max_response_tokens != ro.max_response_tokens:
            raise ValueError(
                f"reward.max_response_tokens={rw.max_response_tokens} differs from rollout.max_response_tokens="
                f"{ro.max_response_tokens}: overlong shaping's L_max is the rollout's limit (leave "
                "reward.max_response_tokens unset; it is set from rollout.max_response_tokens)"
            )
        if rw.overlong_buffer_len > ro.max_response_tokens:
            raise ValueError(
                f"reward.overlong_buffer_len={rw.overlong_buffer_len} must not exceed rollout.max_response_tokens="
                f"{ro.max_response_tokens} (DAPO's overlong buffer lies inside the response limit)"
            )
        if rw.max_response_tokens is None:
            rw.max_response_tokens = ro.max_response_tokens
        if self.learner.algorithm == "dr_grpo" and self.learner.loss_options.get("norm_length") is None:
            # Dr. GRPO's constant normaliser is the generation budget (arXiv 2503.20783, MAX_TOKENS)
            self.learner.loss_options = {**self.learner.loss_options, "norm_length": ro.max_response_tokens}

    def _check_temperature(self) -> None:
        """vLLM raises a sampling temperature below its minimum to that minimum (the learner would still divide
        by the configured one) and refuses one above its maximum (``vllm/sampling_params.py``)."""
        t = self.rollout.temperature
        if not VLLM_MIN_TEMPERATURE <= t <= VLLM_MAX_TEMPERATURE:
            raise ValueError(
                f"rollout.temperature={t!r} is outside [{VLLM_MIN_TEMPERATURE}, {VLLM_MAX_TEMPERATURE}]: vLLM "
                f"samples below {VLLM_MIN_TEMPERATURE} at {VLLM_MIN_TEMPERATURE} (while the learner divides the "
                f"logits by {t!r}) and refuses above {VLLM_MAX_TEMPERATURE}"
            )

    @property
    def run_dir(self) -> Path:
        """``trainer.output_dir / trainer.run_name``."""
        return Path(self.trainer.output_dir) / self.trainer.run_name


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the value."""


def _parse_value(text: str) -> Any:
    """An override's value, parsed as YAML (``3`` -> int, ``true`` -> bool, ``[1,2]`` -> list)."""
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to a nested dict (in place) and return it.

    Raises:
        ConfigError: an override without ``=``, or one that descends into a non-mapping value.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {p!r} is not a section")
        node[parts[-1]] = _parse_value(value)
    return raw


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "config"
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"  {loc}: {e['msg']}{shown}")
    return "invalid config:\n" + "\n".join(lines)


def absolute_paths(cfg: Config, cwd: Path | None = None) -> Config:
    """Make the run's relative paths absolute against ``cwd`` (default: the working directory), in place:
    ``trainer.output_dir`` and ``model.path`` unless it is ``builtin:...`` or a hub id
    (``cluster.models.hub_model``), and so the judge's and the teacher's model paths. (The data files resolve in
    ``cluster.data.prompts``.) Returns ``cfg``."""
    cwd = (cwd or Path.cwd()).resolve()
    if not Path(cfg.trainer.output_dir).is_absolute():
        cfg.trainer.output_dir = str(cwd / cfg.trainer.output_dir)
    local = not cfg.model.path.startswith("builtin:") and not is_hub_id(cfg.model.path, cwd)
    if local and not Path(cfg.model.path).is_absolute():
        cfg.model.path = str(cwd / cfg.model.path)
    judge = cfg.reward.judge.model_path  # the LLM judge's model: the same forms
    if judge and not judge.startswith("builtin:") and not is_hub_id(judge, cwd) and not Path(judge).is_absolute():
        cfg.reward.judge.model_path = str(cwd / judge)
    teacher = cfg.distill.model_path  # on-policy distillation's teacher: the same forms
    if teacher and not teacher.startswith("builtin:") and not is_hub_id(teacher, cwd) and \
            not Path(teacher).is_absolute():
        cfg.distill.model_path = str(cwd / teacher)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply overrides and validate it.

    Args:
        path: YAML file, or None for the defaults.
        overrides: ``["trainer.total_steps=3", ...]``.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or impossible combination; the message names
            the key and the value.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        loaded = yaml.safe_load(p.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping, got {type(loaded).__name__}")
        raw = loaded or {}
    apply_overrides(raw, list(overrides or []))
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
