"""The run-level sections of the run config: the model, the data, weight sync, the step loop, the health guard,
the cluster and wandb. ``cluster/config.py`` composes them with the services' sections into ``Config``.
"""

from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.health import GUARD_CHECKS


class Section(BaseModel):
    """Base of the run-level config sections: unknown keys are refused and values are validated on assignment
    (tests/unit/cluster/test_config.py checks that every section of the composed schema is strict)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=False)


class ModelShape(Section):
    """Architecture numbers of a model, for the --dry-run memory plan (KV cache tokens, activations, logits,
    ZeRO-3 working set). A local ``model.path`` folder's config.json gives them when this is unset."""

    num_layers: int = Field(ge=1, description="decoder layers (num_hidden_layers)")
    hidden_size: int = Field(ge=1, description="hidden size h")
    num_attention_heads: int = Field(ge=1, description="query heads")
    num_key_value_heads: int = Field(ge=1, description="key/value heads")
    head_dim: int = Field(ge=1, description="size of one attention head")
    vocab_size: int = Field(ge=1, description="vocabulary size V (logits per token)")
    intermediate_size: int = Field(0, ge=0, description="dense MLP intermediate size (0 when every layer is MoE)")
    moe_intermediate_size: int = Field(0, ge=0, description="intermediate size of one expert (0: dense model)")
    num_experts: int = Field(0, ge=0, description="routed experts per MoE layer (0: dense model)")
    num_experts_per_tok: int = Field(0, ge=0, description="experts chosen per token (top-k)")
    tie_word_embeddings: bool = Field(False, description="the output head shares the embedding matrix")


class ModelConfig(Section):
    """Which model to train. ``path`` is a Hugging Face model folder, ``builtin:tiny_moe`` to build the
    embedded tiny Qwen3-MoE (deterministically from ``build_seed``) into the run folder, or
    ``builtin:tiny_<arch>`` for a tiny random model of another architecture (``cluster.models.tiny_archs.ARCHS``:
    llama, qwen3_tied, qwen3_moe, qwen3_moe_tied, mixtral, qwen2_moe, olmoe; fixed shapes, ``build_seed``)."""

    path: str = Field(
        "builtin:tiny_moe",
        description="HF model folder, builtin:tiny_moe, or builtin:tiny_<arch> (llama, qwen3_tied, qwen3_moe, "
        "qwen3_moe_tied, mixtral, qwen2_moe, olmoe: docs/architectures.md)",
    )
    build_seed: int = Field(0, description="seed of the tiny model's random init")
    hidden_size: int = Field(128, ge=32, description="builtin:tiny_moe only: hidden size (a multiple of 32)")
    num_layers: int = Field(2, ge=1, description="builtin:tiny_moe only: decoder layers")
    num_experts: int = Field(8, ge=1, description="builtin:tiny_moe only: routed experts per MoE layer")
    num_experts_per_tok: int = Field(2, ge=1, description="builtin:tiny_moe only: experts chosen per token (top-k)")
    moe_intermediate_size: int = Field(
        128, ge=32, description="builtin:tiny_moe only: intermediate size of one expert (a multiple of 32)"
    )
    num_attention_heads: int = Field(4, ge=1, description="builtin:tiny_moe only: query heads")
    num_key_value_heads: int = Field(
        2, ge=1, description="builtin:tiny_moe only: key/value heads (must divide the query heads)"
    )
    head_dim: int = Field(
        32, ge=8, description="builtin:tiny_moe only: size of one attention head (one the vLLM CPU attention supports)"
    )
    num_params_b: float | None = Field(None, gt=0, description="total parameters (billions), for --dry-run")
    shape: ModelShape | None = Field(
        None, description="architecture for the --dry-run memory plan; None: read from the config.json of a local "
        "model.path folder (builtin:tiny_moe: the keys above); a hub id not yet fetched has none, and then KV tokens, "
        "activations and logits are not planned")

    def build_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``cluster.models.resolve.ensure_model`` for a ``builtin:`` model: every key of
        this section but the path, the seed and the dry-run-only ones (``num_params_b``, ``shape``)."""
        return self.model_dump(exclude={"path", "build_seed", "num_params_b", "shape"})


class DataConfig(Section):
    """Where prompts come from, how rows become prompts, and how they are split.

    ``task: files`` reads ``train_path``/``test_path`` (JSONL, JSON, Parquet or CSV files, a glob of them, or a
    folder written by ``datasets``' ``save_to_disk``) with ``datasets``; the field names are the ``*_key``
    settings. ``task: gsm8k`` is that loader with GSM8K's fields (``question``, ``answer`` with a ``####``
    line), its prompt template and the ``math`` verifier."""

    task: Literal["arithmetic", "gsm8k", "files", "code", "agent_calc", "agent_guess"] = Field(
        "arithmetic",
        description="arithmetic = generated 2-operand additions; files = your own rows (train_path, test_path); "
        "gsm8k = files with GSM8K's fields, prompt template and the math verifier; code = generated tiny Python "
        "functions judged by unit tests in the sandbox (cluster/data/code_task.py); agent_calc = sums of "
        "data.num_terms 2-digit numbers for a calculator tool (cluster/data/agent_calc.py; needs env); agent_guess = "
        "find a number in 1..data.guess_high from higher/lower replies (cluster/data/agent_guess.py; needs env.cls "
        "reward.envs.guess_number:GuessNumber)",
    )
    train_path: str | None = Field(
        None, description="files/gsm8k: training rows: a .jsonl/.json/.parquet/.csv file, a glob of them, or a "
        "save_to_disk folder (relative paths: from the working directory, else from the repo root)")
    test_path: str | None = Field(
        None, description="files/gsm8k: held-out rows, as train_path; None = hold out data.eval_fraction of the "
        "training rows (seeded with data.seed)")
    eval_fraction: float = Field(
        0.05, gt=0, lt=1,
        description="files/gsm8k without test_path: share of the training file's rows held out (at most "
        "data.num_eval of them), chosen with data.seed")
    prompt_key: str = Field(
        "prompt", min_length=1,
        description="files: field holding the prompt: a string, or a list of chat messages {role, content}")
    answer_key: str | None = Field(
        "answer", description="files: field holding the reference answer (text or number); None = no reference")
    verifier_key: str | None = Field(
        None, description="files: field naming each row's verifier (empty or missing: data.verifier)")
    verifier: str = Field(
        "math", min_length=1,
        description="files: verifier of rows without their own ('exact', 'math', 'code', 'format' or "
        "'module.path:function'); reward.verifier, when set, overrides every row's")
    meta_keys: list[str] = Field(
        default_factory=list, description="files: fields passed to the verifier in the row's meta (e.g. unit tests)")
    solution_key: str | None = Field(
        None, description="files: field holding a worked solution, the warm start's demonstration (needed when "
        "warm_start.steps > 0)")
    prompt_template: str | None = Field(
        None, description="files: prompt text with {field} names filled from the row (e.g. 'Question: "
        "{question}\\nAnswer:'); None = the prompt_key field as it is")
    apply_chat_template: bool | Literal["auto"] = Field(
        "auto", description="render prompts with the tokenizer's chat template (add_generation_prompt=True): true, "
        "false, or auto = when the tokenizer has one (every task)")
    system_prompt: str | None = Field(
        None, description="system message put first when the chat template is applied (rows with their own "
        "system message keep it)")
    num_train: int = Field(20000, ge=1, description="training prompts: generated (arithmetic, code) or read at most (files)")
    num_eval: int = Field(256, ge=1, description="held-out prompts for eval/accuracy (greedy)")
    max_prompt_tokens: int = Field(
        64, ge=1,
        description="files/gsm8k: longer prompts are counted and skipped; plus rollout.max_response_tokens at most "
        "rollout.max_model_len",
    )
    seed: int = Field(1234, description="arithmetic, code: seed of the generated train/held-out prompts; files: of the "
                      "eval_fraction split")
    max_operand: int = Field(99, ge=1, description="arithmetic: operands in [0, max_operand]")
    num_terms: int = Field(4, ge=2, description="agent_calc: addends of 10..99 per problem")
    guess_high: int = Field(9, ge=2, description="agent_guess: the secret number is in 1..guess_high")
    guess_bonus: float = Field(
        0.2, ge=0, description="agent_guess: a found number scores 1 + guess_bonus x the guesses saved against trying "
        "every number (GuessNumber's meta guess_bonus): fewer guesses are better")
    demo_slip_rate: float = Field(
        0.0, ge=0, le=1,
        description="arithmetic: share of warm-start demonstrations that drop the units carry; code: share that carry "
        "their family's classic bug; agent_calc: share whose calculator call leaves out the last addend; agent_guess: "
        "share of demonstrations that scan linearly (1, 2, 3, ...; the others play binary search) (imperfect "
        "cold-start data)",
    )
    long_tail_fraction: float = Field(
        0.0, ge=0, lt=1, description="arithmetic: share of problems (prompt 'a+b#') whose answer is the sum written "
        "data.long_tail_repeat times: a heavy tail of response lengths (cluster/data/long_tail.py); needs "
        "rollout.max_response_tokens >= repeat x the digits of the largest sum + 1")
    long_tail_repeat: int = Field(8, ge=2, description="arithmetic with data.long_tail_fraction > 0: times a long "
                                  "answer repeats the sum")

    @model_validator(mode="after")
    def _check_template(self) -> "DataConfig":
        if self.prompt_template is not None:
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None]
            except ValueError as e:
                raise ValueError(f"data.prompt_template={self.prompt_template!r} is not a valid template: {e}") from None
            bad = [f for f in fields if not f.isidentifier()]
            if not fields or bad:
                raise ValueError(f"data.prompt_template={self.prompt_template!r} must name row fields as {{field}} "
                                 f"(got {fields or 'no field'}; use {{{{ and }}}} for literal braces)")
        return self


class SyncConfig(Section):
    """Weight sync learner -> rollout engines: metadata by Ray actor calls, bytes through the Ray object store
    or a collective broadcast (``sync.transport``)."""

    transport: Literal["object_store", "collective"] = Field(
        "object_store", description="how the weight bytes travel: 'object_store' (each bucket ray.put once, read "
        "zero-copy on the engine's node) or 'collective' (each bucket broadcast by learner rank 0 over a process "
        "group with every engine worker: gloo on the CPU, NCCL on GPUs; kept across syncs while the engines stay "
        "the same; a broadcast that fails hands the rest of that sync to the object store)")

    bucket_mb: float = Field(
        64.0, gt=0, description="weights per object-store bucket, MiB: consecutive layers are merged up to this "
        "size (a larger layer is a bucket of its own)")
    max_buckets_in_flight: int = Field(
        2, ge=1, description="buckets put but not yet loaded by every engine, at most (bounds the object store's "
        "share of a sync; 2 lets the export of one overlap the engines' loading of the other)")
    engine_timeout_s: float = Field(
        120.0, gt=0, description="an engine that does not answer one sync call (start, a bucket, finish) within this "
        "many seconds counts as hung: it gets no more of the sync and is replaced; must stay below "
        "learner.dist_timeout_s, which the other learner ranks wait under meanwhile")
    load_beside_learner: bool = Field(
        False, description="the learner returns from a sync once every bucket is in the object store and trains on "
        "while the engines load the last buckets (all of them when the model fits one sync.bucket_mb bucket) and "
        "finish; the driver waits for that before the engines sample again, so no sample mixes versions. Takes "
        "the engines' load off the learner's path. With sync.transport=collective the learner waits as without "
        "it (a broadcast needs rank 0 until every engine has received it)")


def _threshold(key: str, what: str) -> str:
    """Description of a health-guard threshold, with the metric and the comparison from ``GUARD_CHECKS``
    (a key the learner does not check fails here, at import)."""
    metric, kind, phase = GUARD_CHECKS[key]
    when = "before the update" if phase == "pre" else "after the optimizer steps, which are then undone"
    return f"{what} (None = unchecked); a step fails when {metric} {'>' if kind == 'max' else '<'} this, checked {when}"


class HealthConfig(Section):
    """Health guard: per-step checks; a failing step's update is skipped (weights and optimizer unchanged),
    ``rollback_after`` failures in a row roll back to the last checkpoint, and ``max_rollbacks`` rollbacks
    without a good step in between stop the run with a report naming the checks that failed. Non-finite loss,
    gradient norm or log-probs always fail when the guard is on."""

    enabled: bool = Field(False, description="run the checks (costs one in-memory copy of each rank's state)")
    max_grad_norm: float | None = Field(
        None, gt=0, description=_threshold("max_grad_norm", "pre-clip global gradient norm")
    )
    max_clip_fraction: float | None = Field(
        None, ge=0, le=1, description=_threshold("max_clip_fraction", "share of clipped importance ratios")
    )
    max_logprob_diff: float | None = Field(
        None, ge=0, description=_threshold("max_logprob_diff", "mean |train - rollout| log-prob, nats")
    )
    min_entropy: float | None = Field(
        None, ge=0, description=_threshold("min_entropy", "mean token entropy, nats (entropy collapse)")
    )
    max_load_imbalance: float | None = Field(
        None, ge=1, description=_threshold("max_load_imbalance", "MoE: max over layers of max/mean expert load")
    )
    rollback_after: int = Field(3, ge=1, description="failed steps in a row before rolling back")
    max_rollbacks: int = Field(2, ge=1, description="rollbacks without a good step in between before stopping")

    def guard(self) -> dict[str, float] | None:
        """The learner's guard dict (thresholds that are set), or None when the guard is off."""
        if not self.enabled:
            return None
        return {k: getattr(self, k) for k in GUARD_CHECKS if getattr(self, k) is not None}


class ClusterConfig(Section):
    """What the cluster looks like, for the placement plan and the --dry-run memory check."""

    gpu_memory_gib: float = Field(80.0, gt=0, description="memory of one GPU, GiB (80 for H100, 141 for H200)")
    gpus_per_node: int = Field(8, ge=1, description="GPUs per node; learner ranks are packed per node")
    host_memory_gib: float | None = Field(
        None, gt=0, description="host RAM of one node, GiB: the plan refuses a node whose processes and object "
        "store need more (None: reported, not checked)")
    placement_timeout_s: float = Field(
        120.0, gt=0, description="how long an actor's placement group may wait for a node with room (at start, and "
        "for a replacement when a node was lost: the wait is logged naming the *.node_resources); then the run "
        "stops with an error, its last checkpoint intact")


class WandbConfig(Section):
    """Weights & Biases logging of the same metrics as metrics.jsonl."""

    project: str = Field("gspo-rl", description="wandb project name")
    mode: Literal["offline", "online", "disabled", "auto"] = Field(
        "auto", description="auto = online when WANDB_API_KEY is set, else offline"
    )


class TrainerConfig(Section):
    """The step loop, evaluation, checkpoints and logging."""

    total_steps: int = Field(10, ge=0, description="RL steps (one rollout batch each)")
    prompts_per_step: int = Field(32, ge=1, description="prompts per rollout batch")
    group_size: int = Field(8, ge=2, description="completions per prompt (G)")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal and sample more prompts to refill"
    )
    max_sampling_rounds: int = Field(3, ge=0, description="dynamic sampling: extra rollout rounds per step, at most")
    max_staleness: int = Field(
        0, ge=0,
        description="0: on-policy steps, one phase after another (deterministic); 1: one-step off-policy, the "
        "rollout of step k+1 runs while the learner trains on step k, so a sample is at most 1 weight version old "
        "(with learner.old_logprob_source=rollout GSPO's ratio is taken against the sampling engine's log-probs; "
        "with recompute against the learner's weights before the update, the decoupled anchor of AReaL, arXiv "
        "2505.24298, which keeps the clip fraction of the on-policy loop; mismatch/* logs the sample's staleness)")
    partial_rollouts: bool = Field(
        False, description="engines generate at most trainer.partial_segment_tokens tokens of a sample per round; an "
        "unfinished sample continues after the next weight sync under the new weights (prompt + its tokens so far, "
        "a new request), each token keeping its weight version and behaviour log-prob; max_staleness=k >= 1 then "
        "bounds the oldest token's age in versions (a sample past it is dropped, counted and sampled again). The "
        "rollout runs between syncs (beside the learner too with partial_rollout_overlap). With R3 each token replays the experts of the "
        "version that sampled it. Refused with dynamic_sampling. With env set, episodes continue turn by turn "
        "across syncs (up to 2 prompts_per_step groups under way; docs/agents.md)")
    partial_rollout_overlap: bool = Field(
        False, description="partial rollouts: the engines also run rounds while the learner trains (at the weights "
        "it started from) as long as there is something to sample, stopping at the round under way when it "
        "finishes. Those tokens are at least one version old when trained, so this spends one version of the "
        "staleness bound: needs trainer.max_staleness >= 2. No rounds beside the learner step before a monitored "
        "step (learner.mismatch_monitor_every)")
    partial_segment_tokens: int | None = Field(
        None, ge=1, description="partial rollouts: tokens of a sample per round; must divide "
        "rollout.max_response_tokens; None = its smallest divisor >= max_response_tokens / (max_staleness + 1) "
        "(/ max_staleness with partial_rollout_overlap, where a sample may get one segment per version), so every "
        "sample can finish within the staleness bound")
    eval_every: int = Field(5, ge=0, description="held-out eval every N steps (0 = only start and end)")
    eval_samples: int = Field(
        0, ge=0, description="k samples per held-out prompt at the rollout temperature at every eval, for "
        "eval/pass@j (unbiased estimator, Chen et al. 2021 Eq. 1; j = 1, 2, 4, ... and k) and eval/mean@k beside "
        "the greedy eval/accuracy (0 = off)")
    length_buckets: int = Field(
        4, ge=0, description="metrics sliced by response length: this many equal-width buckets over [0, "
        "rollout.max_response_tokens] (length/<lo>-<hi>/reward_mean, accuracy, clip_fraction, seq_ratio_mean, "
        "count per step; length_slices.png at the end); 0 = off")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="newest complete checkpoints kept; older ones are deleted")
    audit_steps: list[int] = Field(
        default_factory=list, description="RL steps whose rollouts and behaviour weights are saved for learner.audit"
    )
    output_dir: str = Field("outputs", description="parent folder of the run folders")
    run_name: str = Field("default", description="the run folder: output_dir/run_name")
    seed: int = Field(0, description="seed of the prompt order, the warm-start batches and the minibatch split")
    resume: bool = Field(False, description="continue from the newest complete checkpoint of the run folder")
    ray_address: str | None = Field(None, description="None: local Ray on 127.0.0.1; 'auto' inside a job")
    bind_host: str = Field("127.0.0.1", description="address that Ray and the learner's rendezvous bind to")
    plots: bool = Field(True, description="write curves.png into the run folder at the end")
