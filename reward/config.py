"""Config section ``reward``: verifier workers, the protected runner, the code sandbox and reward shaping."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base of the reward config sections: unknown keys are refused and values are validated on assignment
    (tests/unit/cluster/test_config.py checks that every section of the composed schema is strict)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=False)


class SandboxConfig(Section):
    """Limits of one run of model-written code (``code`` verifier). See ``reward/sandbox.py``."""

    backend: Literal["bwrap", "plain"] = Field(
        "bwrap",
        description="bwrap = bubblewrap (model code is refused where it does not work); plain = NO sandbox, only "
        "limits and an in-process guard that code can switch off (logs a warning once; see reward/README.md)",
    )
    wall_s: float = Field(3.0, gt=0, description="wall-clock limit of one sandbox run, seconds")
    cpu_s: int = Field(2, ge=1, description="CPU-time limit (RLIMIT_CPU), seconds")
    memory_mb: int = Field(512, ge=64, description="address-space limit (RLIMIT_AS), MiB")
    max_procs: int = Field(16, ge=1, description="process/thread limit (RLIMIT_NPROC) of the sandbox user")
    file_size_mb: float = Field(4.0, gt=0, description="largest file the program may write (RLIMIT_FSIZE), MiB")
    scratch_mb: int = Field(
        64, ge=1, description="bwrap: size of the run's only writable space (a tmpfs, in memory), MiB; a run that "
        "fills it is stopped (status scratch_limit)",
    )
    max_output_kb: int = Field(64, ge=1, description="stdout+stderr kept; more output kills the run, KiB")
    python: str | None = Field(None, description="interpreter for model code; None = /usr/bin/python3 if present")
    tmp_root: str | None = Field(None, description="where the per-run temp dirs go; None = the system temp dir")

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data):
        if isinstance(data, dict):
            if data.get("backend") == "auto":
                raise ValueError(
                    "reward.sandbox.backend='auto' was removed (it fell back to the unsandboxed plain backend "
                    "without bubblewrap): use 'bwrap' (the default) or, knowingly, 'plain'"
                )
            if "require_bwrap" in data:
                raise ValueError(
                    f"reward.sandbox.require_bwrap={data['require_bwrap']!r} was removed: bubblewrap is always "
                    "required unless reward.sandbox.backend is 'plain'"
                )
        return data


class RewardTerm(Section):
    """One weighted term of a composite reward."""

    verifier: str = Field(..., description="'exact', 'math', 'code', 'format' or 'module.path:function'")
    weight: float = Field(1.0, description="weight of this term in the sum")


class JudgeCombine(Section):
    """How the judge's score joins the verifiers' (section ``reward.judge.combine``; reward/llm_judge.py,
    ``combine``).

    ``weighted``: ``total = verifiers + weight * judge``. ``gate``: ``total = verifiers + weight * judge`` when the
    primary verifier judged the sample correct, else ``verifiers`` alone (the judge is not asked). The verifiers'
    part is the reward without a judge (``primary_weight * primary + extra terms + overlong penalty``); set
    ``reward.primary_weight: 0`` for a reward that is the judge's alone (``correct`` stays the verifier's).
    """

    mode: Literal["weighted", "gate"] = Field(
        "weighted", description="weighted = verifiers + weight x judge for every sample; gate = the judge's term "
        "counts only where the primary verifier passed (the judge is asked only about those)",
    )
    weight: float = Field(1.0, allow_inf_nan=False, description="weight of the judge's score in the sum")


class ServedModelConfig(Section):
    """A fixed model served by vLLM engines of its own, one Ray actor each, whose weights never change: the base of
    the LLM judge's section (``reward.judge``) and the distillation teacher's (``distill``;
    cluster/runtime/model_fleet.py starts and replaces the engines of both). On when ``model_path`` is set. An
    engine that fails or does not answer one batched call within ``timeout_s`` makes that call's samples invalid
    (NaN reward, counted and logged) and is replaced."""

    SECTION: ClassVar[str] = ""  # the section's dotted name, for messages

    model_path: str | None = Field(
        None, description="the model, any model.path form (builtin:..., a local folder, a hub id); None = off",
    )
    build_seed: int = Field(0, description="seed of a builtin model's weights (as model.build_seed)")
    num_engines: int = Field(1, ge=1, description="vLLM engines of this model, one Ray actor each")
    num_cpus_per_engine: float = Field(1.0, gt=0, description="Ray CPUs reserved per engine")
    node_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources (name: amount) each engine's placement bundle asks "
        "for (as rollout.node_resources). {} = any node",
    )
    threads_per_engine: int = Field(1, ge=1, description="torch/OpenMP threads of one engine on CPU")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="engine dtype")
    max_model_len: int = Field(
        512, ge=16, description="prompt + answer token limit of an engine (at most the model's context); a longer "
        "prompt is NaN",
    )
    kv_cache_gb: float = Field(0.25, gt=0, description="KV cache per engine, GiB (CPU)")
    timeout_s: float = Field(
        300.0, gt=0, allow_inf_nan=False, description="wall-clock limit of one engine's batched call, seconds; "
        "past it the batch's samples are NaN and the engine is replaced",
    )

    @property
    def enabled(self) -> bool:
        """True when a model is configured."""
        return self.model_path is not None

    @model_validator(mode="after")
    def _check_node_resources(self) -> "ServedModelConfig":
        for name, amount in self.node_resources.items():
            if not name or name in ("CPU", "GPU", "memory", "object_store_memory") or name.startswith("node:") \
                    or not amount > 0:
                raise ValueError(f"{self.SECTION}.node_resources: {name}={amount!r}: custom resource names only (not "
                                 "CPU, GPU, memory or node:...) with amounts > 0")
        return self


class JudgeConfig(ServedModelConfig):
    """An LLM judge as a reward term (section ``reward.judge``; reward/llm_judge.py, cluster/runtime/judge.py).

    On when ``model_path`` is set. The judge model runs in vLLM engines of its own (``num_engines`` Ray actors,
    greedy, seeded); every sample of a scoring call is rendered through ``template`` (and the judge's chat
    template when it has one), the engines answer in one batched call each, and the score is parsed from the
    answer: ``score: regex`` takes the first group of ``regex``'s first match as a float times ``scale``;
    ``score: token_probs`` takes ``P(positive) / (P(positive) + P(negative))`` over the named tokens among the
    first generated position's ``top_logprobs`` top log-probs. A judge that fails, times out or answers
    unparseably gives the sample a NaN reward (invalid: advantage 0, out of its group's statistics), counted in
    the step's ``reward/judge_*`` metrics and logged. The engine keys are those of every served model
    (``ServedModelConfig``).
    """

    SECTION: ClassVar[str] = "reward.judge"

    model_path: str | None = Field(
        None, description="the judge model, any model.path form (builtin:..., a local folder, a hub id); None = no "
        "judge",
    )
    template: str = Field(
        "Question: {prompt}\nReference answer: {answer}\nStudent answer: {response}\n"
        "Is the student's final answer correct? Answer Yes or No.",
        description="the judge's user message: {prompt}, {answer}, {response}, {uid} and {meta[KEY]} (a row's meta "
        "field) are filled in; {{ and }} are literal braces",
    )
    system_prompt: str | None = Field(None, description="system message before the template (chat template only)")
    apply_chat_template: bool = Field(
        True, description="render the message through the judge tokenizer's chat template when it has one "
        "(false, or no template: the text as it is)",
    )
    score: Literal["regex", "token_probs"] = Field(
        "token_probs", description="regex = a number in the judge's answer; token_probs = the probability of the "
        "positive tokens at the first generated position",
    )
    regex: str = Field(
        r"(-?\d+(?:\.\d+)?)", description="score=regex: pattern searched in the answer; its first group (or the "
        "match) is the score",
    )
    scale: float = Field(1.0, allow_inf_nan=False, description="score=regex: the parsed number is multiplied by it")
    positive_tokens: list[str] = Field(
        default_factory=lambda: ["Yes", " Yes", "yes"],
        description="score=token_probs: tokens (each one token of the judge's tokenizer) that mean 'good'",
    )
    negative_tokens: list[str] = Field(
        default_factory=lambda: ["No", " No", "no"],
        description="score=token_probs: tokens that mean 'bad'; none of either among the top log-probs = NaN",
    )
    top_logprobs: int = Field(20, ge=1, le=20, description="score=token_probs: top log-probs read at position 1")
    max_tokens: int = Field(16, ge=1, description="answer token limit (score=token_probs generates 1 token)")
    seed: int = Field(0, description="judge engines' sampler seed (greedy: the answer does not depend on it)")
    combine: JudgeCombine = Field(default_factory=JudgeCombine)

    @model_validator(mode="after")
    def _check(self) -> "JudgeConfig":
        import re

        from reward.llm_judge import template_fields

        template_fields(self.template)  # ValueError naming the field
        try:
            re.compile(self.regex)
        except re.error as err:
            raise ValueError(f"reward.judge.regex={self.regex!r} does not compile: {err}") from None
        if self.score == "token_probs" and not (self.positive_tokens and self.negative_tokens):
            raise ValueError(f"reward.judge.score='token_probs' needs positive_tokens and negative_tokens (got "
                             f"{self.positive_tokens} and {self.negative_tokens})")
        both = set(self.positive_tokens) & set(self.negative_tokens)
        if both:
            raise ValueError(f"reward.judge: {sorted(both)} are both positive and negative tokens")
        return self


# built-in verifiers that may run inside the reward worker (reward.inline_verifiers): their work on a response is
# a few linear passes over the string (strip, split at '####', collapse whitespace, compare), so no response can
# make them hang, allocate without bound or run anything
INLINE_SAFE = frozenset({"exact"})


class RewardConfig(Section):
    """Which verifiers score completions and how the workers run them.

    The score of a completion is ``primary_weight * primary + sum(w_i * term_i) + overlong_penalty``, where
    ``primary`` is ``verifier`` (or the row's own verifier when ``verifier`` is None) and decides ``correct``.
    """

    num_workers: int = Field(1, ge=1, description="reward worker actors; free to change on resume")
    num_cpus_per_worker: float = Field(0.25, gt=0, description="Ray CPUs reserved per reward worker")
    node_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources (name: amount) that each worker's placement bundle asks for beside its "
        "CPUs, so that it lands only on nodes started with them (`ray start --resources '{\"NAME\": N}'`, "
        "gspo-cluster up --node-resources NAME=N); e.g. {reward_node: 1} dedicates nodes to this role. "
        "{} = any node",
    )


    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit of one verifier call, seconds")

    verifier: str | None = Field(None, description="primary verifier for every row; None = each row's own")
    primary_weight: float = Field(1.0, description="weight of the primary verifier's score")
    extra_terms: list[RewardTerm] = Field(default_factory=list, description="extra weighted terms (composite)")
    format_regex: str = Field(
        r"(?m)^[ \t]*####[ \t]*(?P<answer>\S[^\n]*)",
        description="'format' verifier: pattern searched for (the answer it marks: its group 'answer', else its "
        "first group, else the match)",
    )
    code_all_or_nothing: bool = Field(False, description="'code': 1/0 instead of the share of tests passed")

    timeout_score: float = Field(0.0, description="score of a call that timed out (NaN = invalid sample)")
    error_score: float = Field(0.0, description="score of a call whose verifier raised (NaN = invalid sample)")
    on_infra_failure: Literal["invalid", "zero"] = Field(
        "invalid",
        description="a sample whose reward, environment, judge, teacher or sandbox failed for a reason outside the "
        "model's output (a worker lost, a service's timeout, a server that died, the sandbox unable to start): "
        "invalid = reward NaN (advantage 0, left out of its group's statistics); zero = reward 0. Counted either "
        "way (reward/infra_failed/<cause>); docs/agents.md, 'Whose failure is it'",
    )
    parallel_calls: int = Field(1, ge=1, description="verifier child processes alive at once in one worker")
    calls_per_child: int = Field(
        64, ge=1,
        description="verifier calls one child process runs in sequence, each with its own timeout "
        "(1 = a fresh process per call, the slow pre-batching mode)",
    )
    isolated_verifiers: list[str] = Field(
        default_factory=lambda: ["code"],
        description="verifiers whose every call gets a child process of its own (never shares one)",
    )
    inline_verifiers: list[str] = Field(
        default_factory=lambda: ["exact"],
        description="built-in verifiers called in the worker itself, without a child process: only those whose "
        "work is a few linear passes over the response string (" + ", ".join(sorted(INLINE_SAFE)) + "), which "
        "cannot hang or run anything; a fork per chunk of calls costs more than such a call (the default run's "
        "reward phase: 25-30 ms per step forked, 9-13 ms inline; docs/benchmarks.md). A name also in "
        "isolated_verifiers is isolated. [] = every verifier in a child process",
    )
    verifier_memory_mb: int = Field(2048, ge=0, description="RLIMIT_AS of a verifier child, MiB (0 = none)")
    preload: list[str] = Field(
        default_factory=list, description="extra modules imported once into the verifier fork server"
    )

    overlong_buffer_len: int = Field(0, ge=0, description="DAPO overlong shaping buffer L_cache, tokens (0 = off)")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="scale of the overlong penalty (DAPO: 1)")
    max_response_tokens: int | None = Field(
        None, ge=1,
        description="L_max for overlong shaping; unset = rollout.max_response_tokens (set by the run config, "
        "which refuses any other value)",
    )
    mask_truncated: bool = Field(
        False, description="responses cut at the length limit get score NaN (left out of the loss and group stats)"
    )

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)

    @model_validator(mode="after")
    def _check(self) -> "RewardConfig":
        if self.overlong_buffer_len and self.max_response_tokens is not None:
            if self.overlong_buffer_len > self.max_response_tokens:
                raise ValueError(
                    f"reward.overlong_buffer_len={self.overlong_buffer_len} must not exceed "
                    f"reward.max_response_tokens={self.max_response_tokens}"
                )
        unsafe = [n for n in self.inline_verifiers if n not in INLINE_SAFE]
        if unsafe:
            raise ValueError(f"reward.inline_verifiers={self.inline_verifiers}: {unsafe} may not run inline (only "
                             f"{sorted(INLINE_SAFE)}: a verifier that parses, evaluates or runs the response keeps "
                             "its child process, timeout and memory limit)")
        for name in ("primary_weight",):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"reward.{name}={getattr(self, name)} must be finite")
        return self


class OpenEnvConfig(Section):
    """An OpenEnv environment (section ``env.openenv``): a server with reset and step over a WebSocket session,
    played through ``reward.openenv_env`` (one session per episode; docs/agents.md, "OpenEnv environments").

    On when ``app`` or ``url`` is set (``enabled``), and then exactly one of them is.
    """

    app: str | None = Field(
        None,
        description="'module.path:app', the environment's ASGI app (openenv's create_app): every env worker serves "
        "it itself, a uvicorn subprocess on 127.0.0.1 at a free port, stopped with the worker. None = not used",
    )
    url: str | None = Field(
        None, description="base URL (http://, https://, ws:// or wss://) of a running OpenEnv server that every env "
        "worker connects to instead. None = not used",
    )
    start_timeout_s: float = Field(
        60.0, gt=0, allow_inf_nan=False,
        description="seconds a started server (app) has to answer /health, and a server (app or url) to give its "
        "action schema; past it the run stops before any service starts",
    )
    tool_name: str = Field(
        "act", description="the name of the one tool the model calls; its arguments are the fields of the "
        "environment's action (its JSON schema from /schema), the call one step",
    )
    tool_description: str | None = Field(
        None, description="the tool's description for the model; None = the action schema's description",
    )
    prompt: Literal["observation", "row", "row_and_observation"] = Field(
        "observation",
        description="the episode's first user message: the reset observation, the row's prompt, or both (the "
        "prompt, a blank line, the observation)",
    )
    observation_key: str | None = Field(
        None, description="the observation field shown to the model as text; None = the only field's value, or "
        "the observation as JSON when it has several",
    )
    reset_meta_keys: list[str] = Field(
        default_factory=list,
        description="keys of the row's meta sent to reset beside the episode's seed (the server keeps those its "
        "reset takes); [] = the seed only",
    )
    reward: Literal["sum", "last"] = Field(
        "sum", description="the episode's reward from the steps' rewards: their sum, or the last one (0 when none)",
    )

    @property
    def enabled(self) -> bool:
        """True when episodes run on an OpenEnv server (``app`` or ``url`` is set)."""
        return self.app is not None or self.url is not None

    @model_validator(mode="after")
    def _check(self) -> "OpenEnvConfig":
        if self.app is not None and self.url is not None:
            raise ValueError(f"env.openenv.app={self.app!r} and env.openenv.url={self.url!r} are both set: set "
                             "exactly one (an app every env worker serves itself, or a running server)")
        if self.app is not None:
            module, _, attr = self.app.partition(":")
            if not module or not attr or ":" in attr:
                raise ValueError(f"env.openenv.app={self.app!r} must be 'module.path:app' (one colon, both parts "
                                 "non-empty)")
        if self.url is not None and not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"env.openenv.url={self.url!r} must start with http://, https://, ws:// or wss://")
        if not self.tool_name.isidentifier():
            raise ValueError(f"env.openenv.tool_name={self.tool_name!r} must be a Python identifier (a tool name)")
        return self


class GatewayConfig(Section):
    """The session gateway of ``env.agent`` runs (section ``env.gateway``): the OpenAI-compatible HTTP endpoint in
    front of the rollout engines that an agent program talks to (``cluster/runtime/gateway.py``, docs/agents.md)."""

    host: str = Field(
        "127.0.0.1", description="address the gateway binds to; 127.0.0.1 serves env workers on the driver's node "
        "only, a node address (or 0.0.0.0) serves env workers on other nodes",
    )
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 = a free port chosen at start")
    fork_policy: Literal["longest", "all", "refuse"] = Field(
        "longest",
        description="an episode whose agent sent a history that is not an extension of what the gateway returned "
        "(edited, summarised, reasoning stripped) forks (counted in agent/forks): longest = train the branch with "
        "the most sampled tokens; all = train every branch, each with its episode's reward and advantage (the "
        "group's statistics stay per episode); refuse = answer the request with an error, the episode ends as the "
        "agent does",
    )
    model_name: str = Field("policy", description="the model id /v1/models lists and responses name")
    harness: str | None = Field(
        None, description="a command line (split as a shell does, no shell; a first word python is the driver's "
        "interpreter) the driver starts once per run in place "
        "of env.agent: a separate program that takes the run's episodes itself over REST (POST /sessions with the "
        "run key in GSPO_GATEWAY_KEY at GSPO_GATEWAY_URL gives one episode's row, base URL and key; POST "
        "/s/<id>/close ends it with a reward). None = not used",
    )


class EnvConfig(Section):
    """Multi-turn environments (section ``env``): which environment an episode runs in and how the env workers
    run it (``reward/environment.py``, ``reward/env_worker.py``).

    The section is on when ``cls``, ``tools``, ``openenv`` or ``agent`` is set (``enabled``), and then exactly one
    of them is: ``cls`` names an ``Environment`` subclass; ``tools`` names tool functions for a
    ``ToolsEnvironment``, whose episode reward is the row's verifier on the final assistant text; ``openenv`` an
    OpenEnv server (``OpenEnvConfig``, played through ``reward.openenv_env``); ``agent`` an agent program that
    talks to the session gateway (``GatewayConfig``) through an OpenAI client.
    """

    cls: str | None = Field(
        None, description="'module.path:Class', a subclass of reward.environment.Environment; None = not used",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="'module.path:function' tools for a ToolsEnvironment (typed, with Google-style docstrings); "
        "the episode is scored by the row's verifier on the final answer. [] = not used",
    )
    max_turns: int = Field(8, ge=1, description="assistant turns per episode; the episode ends after the last one")
    tool_timeout_s: float = Field(
        10.0, gt=0, allow_inf_nan=False,
        description="deadline of one tool call, seconds; also of the environment's start, reward and close, and of "
        "a whole step once more than its tool calls; a call past it ends its episode with status timeout",
    )
    on_error: Literal["zero", "drop"] = Field(
        "zero",
        description="an episode that ended with an error or timeout of the environment's or agent's own code (the "
        "model's, or not known to be a service's): zero = reward 0; drop = reward NaN (an invalid sample: "
        "advantage 0, left out of its group's statistics). A service's failure (a worker lost, a server that died "
        "or timed out) follows reward.on_infra_failure instead",
    )
    max_abandoned_threads: int = Field(
        4, ge=1,
        description="timed-out calls whose threads still run (they cannot be killed) that an env worker may hold "
        "before the driver replaces it",
    )
    num_workers: int = Field(1, ge=1, description="env worker actors")
    num_cpus_per_worker: float = Field(0.25, gt=0, description="Ray CPUs reserved per env worker")
    node_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources (name: amount) each env worker's placement bundle asks for beside its "
        "CPUs (as reward.node_resources). {} = any node",
    )
    tool_format: str = Field(
        "hermes", description="how tool calls are written in the model's text (the rollout's tool-call parser)",
    )
    openenv: OpenEnvConfig = Field(default_factory=OpenEnvConfig)
    agent: str | None = Field(
        None, description="'module.path:function', an agent program called once per episode in an env worker with "
        "the row (dict) and an OpenAI client (sync, or async for an async function) whose base URL is the episode's "
        "session on the gateway; it returns the reward (a float or named components) or None (the row's verifier "
        "scores the last assistant message). None = not used",
    )
    episode_timeout_s: float = Field(
        300.0, gt=0, allow_inf_nan=False,
        description="an agent program's whole episode, seconds (env.agent); past it the episode ends with status "
        "timeout and its session refuses further requests",
    )
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    debug_rerender: bool = Field(
        False,
        description="DEBUG ONLY, never for training: every turn after the first is sampled on the episode's history "
        "decoded to text, one piece per prompt, turn and reply joined by newlines, and tokenized again (a naive "
        "re-rendering), while the episode keeps training on its sampled ids; agent/token_mismatch then counts "
        "those turns (it shows the token check failing)",
    )

    @property
    def enabled(self) -> bool:
        """True when episodes run in environments (``cls``, ``tools`` or ``openenv`` is set)."""
        return self.cls is not None or bool(self.tools) or self.openenv.enabled or self.agent_program

    @property
    def agent_program(self) -> bool:
        """True when episodes are agent programs behind the session gateway (``agent`` or ``gateway.harness``)."""
        return self.agent is not None or self.gateway.harness is not None

    @model_validator(mode="after")
    def _check(self) -> "EnvConfig":
        if self.cls is not None and self.tools:
            raise ValueError(f"env.cls={self.cls!r} and env.tools={self.tools} are both set: set exactly one (an "
                             "Environment subclass, or tool functions scored by the row's verifier)")
        ways = [k for k, on in (("cls", self.cls is not None), ("tools", bool(self.tools)),
                                ("openenv", self.openenv.enabled), ("agent", self.agent is not None),
                                ("gateway.harness", self.gateway.harness is not None)) if on]
        if self.gateway.harness is not None and len(ways) > 1:
            raise ValueError(f"env.gateway.harness={self.gateway.harness!r} is set beside env."
                             f"{', env.'.join(w for w in ways if w != 'gateway.harness')}: a harness program takes "
                             "its episodes itself; set exactly one way to define the episode")
        if self.agent is not None and len(ways) > 1:
            raise ValueError(f"env.agent={self.agent!r} is set beside env.{', env.'.join(w for w in ways if w != 'agent')}: "
                             "an agent program brings its own tools; set exactly one way to define the episode")
        if self.openenv.enabled and (self.cls is not None or self.tools):
            raise ValueError(f"env.openenv ({self.openenv.app or self.openenv.url!r}) and env.cls={self.cls!r} / "
                             f"env.tools={self.tools} are set: set exactly one way to define the environment")
        named = ([("env.cls", self.cls)] if self.cls is not None else []) + [
            (f"env.tools[{i}]", name) for i, name in enumerate(self.tools)] + (
            [("env.agent", self.agent)] if self.agent is not None else [])
        for key, name in named:
            module, _, attr = name.partition(":") if isinstance(name, str) else ("", "", "")
            if not module or not attr or ":" in attr:
                raise ValueError(f"{key}={name!r} must be 'module.path:name' (one colon, both parts non-empty)")
        if len(set(self.tools)) != len(self.tools):
            raise ValueError(f"env.tools={self.tools} names a tool more than once")
        if not self.tool_format:
            raise ValueError(f"env.tool_format={self.tool_format!r} must be a non-empty format name")
        return self
