"""The config schema: defaults load, bad keys/values/combinations stop with errors naming key and value; every
section is strict, every key is described, docs/config.md is generated from the schema, and the facts the
schema shares with the learner core (algorithm names, the GSPO aggregation rule, the health-guard keys) have
one home."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel, ValidationError

from cluster.config import Config, ConfigError, load_config
from cluster.config_sections import HealthConfig
from cluster.tools.config_reference import COMMAND, reference_markdown, sections
from learner import objectives
from learner.config import LearnerConfig
from learner.health import GUARD_CHECKS, validate_guard
from tests.helpers import REPO_ROOT

TINY = REPO_ROOT / "configs" / "tiny_moe_zero2.yaml"


CONFIGS = [REPO_ROOT / "configs" / "tiny_moe.yaml", REPO_ROOT / "configs" / "tiny_moe_zero2.yaml",
           REPO_ROOT / "configs" / "gsm8k_tiny.yaml"]


def test_default_config_runs_the_fast_cpu_layout_with_the_guard_and_the_monitor_on():
    """configs/tiny_moe.yaml (`make train`): bench/trl_compare.py's `lean` layout, the guard on, the mismatch
    monitor on; tiny_moe_zero2.yaml is the same job on two ZeRO-2 ranks, on-policy, with the guard's pre-checks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_compare", REPO_ROOT / "bench" / "trl_compare.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    default, zero2 = load_config(CONFIGS[0]), load_config(CONFIGS[1])
    lean = [o for o in bench.LEAN if not o.startswith("health.")]  # the default keeps the guard on
    assert load_config(CONFIGS[0], lean).model_dump() == default.model_dump()
    assert default.health.enabled and default.health.guard() == {"max_grad_norm": 1000.0}
    assert default.learner.pre_update_pass == "auto" and default.learner.mismatch_monitor_every == 10
    assert default.learner.pre_update_pass_needs(default.health.guard()) == []
    assert (zero2.learner.world_size, zero2.learner.zero_stage, zero2.trainer.max_staleness) == (2, 2, 0)
    assert "health.max_logprob_diff" in zero2.learner.pre_update_pass_needs(zero2.health.guard())
    assert default.sync.load_beside_learner and not zero2.sync.load_beside_learner
    same = {k: v for k, v in zero2.model_dump().items() if k not in ("learner", "rollout", "health", "trainer", "sync")}
    assert zero2.sync.model_dump() == {**default.sync.model_dump(), "load_beside_learner": False}
    assert same == {k: v for k, v in default.model_dump().items() if k in same}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.learner.algorithm in ("gspo", "gspo_token", "grpo")


def test_defaults_follow_the_paper():
    cfg = load_config(TINY)
    assert cfg.learner.algorithm == "gspo"
    assert cfg.learner.clip_low is None and cfg.learner.clip_high is None  # objective defaults: 3e-4 / 4e-4
    assert cfg.learner.kl_coef == 0.0
    assert cfg.learner.num_minibatches == 4
    assert cfg.learner.normalize_adv_std is None and cfg.learner.advantage_std() is True  # null: the algorithm's own


def test_overrides_are_typed():
    cfg = load_config(TINY, ["trainer.total_steps=3", "rollout.num_engines=2", "learner.zero_stage=3"])
    assert cfg.trainer.total_steps == 3 and cfg.rollout.num_engines == 2 and cfg.learner.zero_stage == 3


@pytest.mark.parametrize(
    "override, needle",
    [
        ("learner.no_such_key=1", "learner.no_such_key"),
        ("trainer.total_steps=abc", "trainer.total_steps"),
        ("trainer.group_size=1", "trainer.group_size"),
        ("learner.clip_low=-0.1", "learner.clip_low"),
        ("learner.micro_batch_size=7", "learner.micro_batch_size=7"),
        ("trainer.prompts_per_step=6", "trainer.prompts_per_step=6"),
        ("learner.loss_agg=token_mean", "learner.loss_agg='token_mean'"),
        ("learner.algorithm=gpso", "learner.algorithm"),
        ("learner.kl_estimator=k4", "learner.kl_estimator"),
        ("rollout.top_p=0.9", "rollout.top_p=0.9"),
        ("learner.zero_stage=5", "learner.zero_stage"),
        ("learner.offload_optimizer=gpu", "learner.offload_optimizer"),
        ("sync.engine_timeout_s=400", "sync.engine_timeout_s=400 must be below learner.dist_timeout_s=300"),
    ],
)
def test_bad_values_name_key_and_value(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert needle in str(err.value)


def test_optimizer_offload_needs_a_zero_stage():
    """learner.offload_optimizer: 'none' by default, 'cpu' at ZeRO stages 1-3; at stage 0 refused, naming both
    keys and their values (DeepSpeed offloads a ZeRO optimizer's partitions only)."""
    assert load_config(TINY).learner.offload_optimizer == "none"
    for stage in (1, 2, 3):
        cfg = load_config(TINY, [f"learner.zero_stage={stage}", "learner.offload_optimizer=cpu"])
        assert cfg.learner.offload_optimizer == "cpu" and cfg.learner.zero_stage == stage
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["learner.zero_stage=0", "learner.offload_optimizer=cpu"])
    assert "learner.offload_optimizer='cpu' with learner.zero_stage=0" in str(err.value)
    assert LearnerConfig(zero_stage=0, offload_optimizer="none").zero_stage == 0


def test_grpo_accepts_token_mean():
    cfg = load_config(TINY, ["learner.algorithm=grpo", "learner.loss_agg=token_mean"])
    assert cfg.learner.loss_agg == "token_mean"


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(REPO_ROOT / "configs" / "nope.yaml")
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(TINY, ["trainer.total_steps"])


def test_gspo_token_refuses_length_weighted_aggregation_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["learner.algorithm=gspo_token", "learner.loss_agg=seq_mean_token_sum"])
    assert "learner.loss_agg='seq_mean_token_sum'" in str(err.value)
    assert "learner.algorithm='gspo_token'" in str(err.value)


def test_learner_names_are_the_cores():
    """The schema's choices are the core's tuples (not a copy that could drift), and for every pair the
    config refuses exactly what the core refuses."""
    fields = LearnerConfig.model_fields
    # algorithm is a string (a built-in name or a user's module:function loss): every core name is accepted
    for algorithm in objectives.ALGORITHMS:
        assert LearnerConfig(algorithm=algorithm).algorithm == algorithm
    with pytest.raises(ValidationError, match="algorithm='ppo_x' is not one of"):
        LearnerConfig(algorithm="ppo_x")
    assert typing.get_args(fields["kl_estimator"].annotation) == objectives.KL_ESTIMATORS
    loss_agg_choices = [a for a in typing.get_args(fields["loss_agg"].annotation) if a is not type(None)]
    assert typing.get_args(loss_agg_choices[0]) == objectives.LOSS_AGGS
    refused = set()
    for algorithm in objectives.ALGORITHMS:
        options = {"norm_length": 4} if algorithm == "dr_grpo" else {}  # Dr. GRPO's constant, set by a run config
        for loss_agg in (None, *objectives.LOSS_AGGS):
            try:
                LearnerConfig(algorithm=algorithm, loss_agg=loss_agg, loss_options=options)
            except ValidationError:
                refused.add((algorithm, loss_agg))
            try:
                objectives.resolve_objective(algorithm, loss_agg=loss_agg, options=options)
            except ValueError:
                assert (algorithm, loss_agg) in refused
            else:
                assert (algorithm, loss_agg) not in refused
    # hand-written: GSPO, GSPO-token and GMPO (one ratio per sequence) take only the sequence mean of token means
    assert refused == {(a, agg) for a in ("gspo", "gspo_token", "gmpo") for agg in ("token_mean", "seq_mean_token_sum")}


def test_assignment_is_checked_by_the_core_rule():
    cfg = LearnerConfig(algorithm="grpo", loss_agg="token_mean")
    with pytest.raises(ValidationError, match="learner.loss_agg='token_mean' is refused with learner.algorithm='gspo'"):
        cfg.algorithm = "gspo"


def test_health_guard_keys_come_from_the_learner():
    """Every check the learner knows has a threshold key in ``health``; ``guard()`` passes each one that is set
    and only those, and the learner accepts the result."""
    thresholds = {k: f for k, f in HealthConfig.model_fields.items() if k in GUARD_CHECKS}
    assert set(thresholds) == set(GUARD_CHECKS)
    values = {"max_grad_norm": 100.0, "max_clip_fraction": 0.5, "max_logprob_diff": 0.25, "min_entropy": 0.01,
              "max_load_imbalance": 3.0}
    assert set(values) == set(GUARD_CHECKS)
    full = HealthConfig(enabled=True, **values).guard()
    assert full == values and validate_guard(full) == values
    assert HealthConfig(enabled=True, min_entropy=0.5).guard() == {"min_entropy": 0.5}
    assert HealthConfig(enabled=True).guard() == {}
    assert HealthConfig(enabled=False, **values).guard() is None
    for key, (metric, _, _) in GUARD_CHECKS.items():
        assert metric in thresholds[key].description, key


def _section_instances() -> dict[str, BaseModel]:
    """One instance of every section (dotted name -> instance), from a config with one reward term."""
    root = Config.model_validate({"reward": {"extra_terms": [{"verifier": "exact"}]}})
    out = {}
    for dotted, cls in sections():
        node = root
        for part in filter(None, dotted.split(".")):
            node = getattr(node, part.removesuffix("[]"))
            if part.endswith("[]"):
                node = node[0]
        assert type(node) is cls, dotted
        out[dotted or "<root>"] = node
    return out


def test_sections_cover_the_schema():
    names = [d for d, _ in sections()]
    assert names[0] == "" and len(names) == len(set(names))
    for expected in ("model", "data", "rollout", "reward", "reward.sandbox", "reward.extra_terms[]", "learner",
                     "warm_start", "sync", "trainer", "health", "cluster", "wandb"):
        assert expected in names


@pytest.mark.parametrize("dotted", [d or "<root>" for d, _ in sections()])
def test_every_section_is_strict(dotted):
    """Unknown keys are refused, and assignments are validated (a wrong value cannot be set after loading)."""
    node = _section_instances()[dotted]
    cls = type(node)
    assert cls.model_config.get("extra") == "forbid" and cls.model_config.get("validate_assignment") is True
    with pytest.raises(ValidationError, match="no_such_key"):
        cls.model_validate({**node.model_dump(), "no_such_key": 1})
    first = next(iter(cls.model_fields))
    with pytest.raises(ValidationError):
        setattr(node, first, object())


@pytest.mark.parametrize("dotted", [d for d, _ in sections() if d])
def test_every_key_has_a_description(dotted):
    cls = dict(sections())[dotted]
    assert (cls.__doc__ or "").strip(), f"section {dotted} ({cls.__name__}) has no docstring"
    for name, field in cls.model_fields.items():
        is_section = dotted + "." + name in dict(sections()) or dotted + "." + name + "[]" in dict(sections())
        assert is_section or (field.description or "").strip(), f"{dotted}.{name} has no description"


def test_config_reference_is_in_sync_with_the_schema():
    written = (REPO_ROOT / "docs" / "config.md").read_text()
    assert written == reference_markdown(), f"docs/config.md is out of date: run `{COMMAND}`"
    for dotted, cls in sections()[1:]:
        assert f"## `{dotted}`" in written
        for name in cls.model_fields:
            assert f"| `{name}` |" in written, f"{dotted}.{name}"


def test_prompt_and_response_limits_must_fit_the_engine_context():
    """tiny_moe: max_model_len 32, max_response_tokens 4: prompts of up to 28 tokens fit, 29 do not."""
    assert load_config(TINY, ["data.max_prompt_tokens=28"]).data.max_prompt_tokens == 28
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["data.max_prompt_tokens=29"])
    msg = str(err.value)
    for needle in ("data.max_prompt_tokens=29", "rollout.max_response_tokens=4", "= 33", "rollout.max_model_len=32"):
        assert needle in msg
    with pytest.raises(ConfigError, match="rollout.max_response_tokens=8 = 36 exceeds rollout.max_model_len=32"):
        load_config(TINY, ["rollout.max_response_tokens=8"])


def test_overlong_shaping_takes_its_length_limit_from_the_rollout():
    """reward.max_response_tokens (DAPO's L_max) is set from rollout.max_response_tokens, a different value is
    refused naming both keys, and a buffer longer than the rollout's limit is refused before any worker starts."""
    cfg = load_config(TINY, ["reward.overlong_buffer_len=2"])
    assert cfg.reward.max_response_tokens == cfg.rollout.max_response_tokens == 4
    assert load_config(TINY, ["reward.max_response_tokens=4"]).reward.max_response_tokens == 4
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["reward.max_response_tokens=20", "reward.overlong_buffer_len=4"])
    assert "reward.max_response_tokens=20" in str(err.value) and "rollout.max_response_tokens=4" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["reward.overlong_buffer_len=5"])
    assert "reward.overlong_buffer_len=5" in str(err.value) and "rollout.max_response_tokens=4" in str(err.value)
    assert load_config(TINY, ["reward.overlong_buffer_len=4"]).reward.overlong_buffer_len == 4


@pytest.mark.parametrize("value, ok", [(0.005, False), (0.0099, False), (0.01, True), (1.0, True), (2.0, True),
                                       (2.5, False)])
def test_temperatures_vllm_would_change_or_refuse_are_refused(value, ok):
    if ok:
        assert load_config(TINY, [f"rollout.temperature={value}"]).rollout.temperature == value
        return
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [f"rollout.temperature={value}"])
    assert f"rollout.temperature={value}" in str(err.value)


def test_temperature_range_is_the_installed_vllms():
    """The bounds the config enforces are the ones in vllm/sampling_params.py (read from its source, so the
    test does not import vLLM): ``_MAX_TEMP`` (the minimum it clamps to) and the ``temperature > X`` refusal."""
    import ast
    import importlib.util
    from pathlib import Path

    from cluster.config import VLLM_MAX_TEMPERATURE, VLLM_MIN_TEMPERATURE

    spec = importlib.util.find_spec("vllm")
    tree = ast.parse((Path(spec.origin).parent / "sampling_params.py").read_text())
    consts = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    assert consts["_MAX_TEMP"] == VLLM_MIN_TEMPERATURE
    upper = [n.comparators[0].value for n in ast.walk(tree) if isinstance(n, ast.Compare)
             and isinstance(n.left, ast.Attribute) and n.left.attr == "temperature"
             and isinstance(n.ops[0], ast.Gt) and isinstance(n.comparators[0], ast.Constant)]
    assert upper == [VLLM_MAX_TEMPERATURE]


def test_never_pre_update_pass_refused_when_the_guard_needs_it():
    """The health guard's pre-update checks need the pass: refused at load, naming the guard keys."""
    with pytest.raises(ConfigError, match="health.max_logprob_diff"):
        load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", ["learner.pre_update_pass=never",
                                                              "learner.moe_diagnostics=false"])
    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", ["learner.pre_update_pass=never",
                                                                "learner.moe_diagnostics=false", "health.enabled=false"])
    assert cfg.learner.pre_update_pass == "never"


def test_audit_steps_refused_in_the_overlapped_mode():
    """The audit recomputes a step at the weights that sampled it; overlapped steps train on older samples."""
    with pytest.raises(ConfigError, match="trainer.audit_steps"):
        load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", ["trainer.max_staleness=1", "trainer.audit_steps=[2]"])
    # the decoupled anchor (learner's pre-update weights) is allowed beside the overlapped mode
    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", ["trainer.max_staleness=1",
                                                                "learner.old_logprob_source=recompute"])
    assert "learner.old_logprob_source='recompute'" in cfg.learner.pre_update_pass_needs(None)


def test_audit_steps_refused_for_an_algorithm_the_audit_does_not_recompute():
    """The offline audit recomputes gspo, gspo_token, grpo and dr_grpo; another algorithm is refused at load, not
    by the audit after the run."""
    zero2 = REPO_ROOT / "configs" / "tiny_moe_zero2.yaml"
    for algorithm in ("gspo_token", "grpo", "dr_grpo"):
        assert load_config(zero2, [f"learner.algorithm={algorithm}", "trainer.audit_steps=[2]"]).trainer.audit_steps
    for algorithm in ("cispo", "ppo"):
        want = f"trainer.audit_steps=.2. is refused with learner.algorithm='{algorithm}'"
        with pytest.raises(ConfigError, match=want):
            load_config(zero2, [f"learner.algorithm={algorithm}", "trainer.audit_steps=[2]"])
    with pytest.raises(ConfigError, match="is refused with learner.rollout_correction='seq_mis'"):
        load_config(zero2, ["learner.rollout_correction=seq_mis", "trainer.audit_steps=[2]"])


def test_linear_warmup_hand_values():
    from cluster.driver.warm_start import linear_warmup

    assert [linear_warmup(1e-6, s, 4) for s in range(6)] == pytest.approx([2.5e-7, 5e-7, 7.5e-7, 1e-6, 1e-6, 1e-6])
    assert linear_warmup(3e-6, 0, 0) == 3e-6  # no warm-up: the constant lr
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        LearnerConfig(lr_warmup_steps=-1)

def test_the_rl_learning_rate_is_set_once_per_process_without_a_warmup():
    """A run resumed from a warm start's checkpoint (gspo-compare's arms: an arm's 3e-5 against the checkpoint's
    1e-4) trains with its own learner.lr: the first step of a process sets it, later steps do not
    call the ranks again, and a rollback (``forget``) sets it again."""
    from cluster.driver.warm_start import RLLearningRate

    class Ranks:
        def __init__(self):
            self.calls = []

        def call(self, name, *args):
            self.calls.append((name, *args))

    ranks = Ranks()
    lr = RLLearningRate(ranks, load_config("configs/tiny_moe.yaml", ["learner.lr=3.0e-5"]))
    for step in range(3):
        lr.apply(step)
    assert ranks.calls == [("set_lr", 3e-5)]
    lr.forget()
    lr.apply(3)
    assert ranks.calls == [("set_lr", 3e-5)] * 2


def test_correction_warning_counts_the_unit_the_correction_drops():
    from cluster.driver.step_metrics import correction_warning

    lc = LearnerConfig(algorithm="gspo", rollout_correction="seq_geo_rs", rollout_correction_low=0.998,
                       rollout_correction_high=1.002)
    assert correction_warning({}, lc) is None  # no correction metrics: nothing to say
    assert correction_warning({"mismatch/masked_seq_share": 0.25, "mismatch/masked_token_share": 0.1}, lc) is None
    msg = correction_warning({"mismatch/masked_seq_share": 0.79, "mismatch/masked_token_share": 0.0}, lc)
    assert msg.startswith("learner.rollout_correction='seq_geo_rs' dropped 79% of the step's sequences")
    assert "[0.998, 1.002]" in msg
    assert correction_warning({"mismatch/masked_seq_share": 0.79, "health/skipped": 1.0}, lc) is None  # refused step
    # token_mis: one dropped token marks its sequence as masked; the share that matters is the tokens'
    tok = LearnerConfig(algorithm="grpo", rollout_correction="token_mis")
    assert correction_warning({"mismatch/masked_seq_share": 1.0, "mismatch/masked_token_share": 0.01}, tok) is None
    assert "60% of the step's tokens" in correction_warning({"mismatch/masked_token_share": 0.6}, tok)


def test_routing_capture_refuses_cuda_graphs_on_gpu():
    from rollout.config import RolloutConfig

    with pytest.raises(ValueError, match="rollout.return_routed_experts=true with rollout.enforce_eager=false"):
        RolloutConfig(num_gpus_per_engine=1, return_routed_experts=True, enforce_eager=False)
    RolloutConfig(num_gpus_per_engine=0, return_routed_experts=True, enforce_eager=False)  # CPU: no CUDA graphs
    RolloutConfig(num_gpus_per_engine=1, return_routed_experts=True, enforce_eager=True)


def test_collective_transport_needs_one_device_kind_and_whole_gpus():
    """sync.transport=collective: gloo on the CPU (the default config), NCCL with a GPU per member; a learner and
    engines on different kinds of device, or a fractional GPU (two NCCL members could share it), are refused."""
    assert load_config(TINY, ["sync.transport=collective"]).sync.transport == "collective"
    gpu = "configs/qwen3_30b_a3b_gsm8k.yaml"
    assert load_config(gpu).sync.transport == "collective"
    with pytest.raises(ConfigError, match=r"sync.transport=collective on GPUs needs whole GPUs \(learner.num_gpus_per_rank"
                                          r"=1, rollout.num_gpus_per_engine=0.5\)"):
        load_config(gpu, ["rollout.num_gpus_per_engine=0.5"])
    with pytest.raises(ConfigError, match=r"same kind of device \(learner.num_gpus_per_rank=0, "
                                          r"rollout.num_gpus_per_engine=1\)"):
        load_config(gpu, ["learner.num_gpus_per_rank=0"])
    assert load_config(gpu, ["rollout.num_gpus_per_engine=0.5", "sync.transport=object_store"])


def test_monitor_steps_are_counted_by_global_step():
    from cluster.driver.trainer import monitor_step

    path = REPO_ROOT / "configs" / "tiny_moe.yaml"
    cfg = load_config(path, ["learner.mismatch_monitor_every=3"])
    assert [s for s in range(1, 11) if monitor_step(cfg, s)] == [1, 4, 7, 10]
    off = load_config(path, ["learner.mismatch_monitor_every=0"])
    assert not any(monitor_step(off, s) for s in range(1, 5))
    always = load_config(path, ["learner.pre_update_pass=always", "learner.old_logprob_source=rollout"])
    assert not monitor_step(always, 1)  # the pass runs anyway: nothing to schedule
    # with old_logprob_source=auto (the default) the monitor's steps are its check steps under 'always' too:
    # sampled on-policy in the overlapped mode, so the gap it compares is the engine/learner gap alone
    always_auto = load_config(path, ["learner.pre_update_pass=always", "learner.mismatch_monitor_every=3"])
    assert [s for s in range(1, 8) if monitor_step(always_auto, s)] == [1, 4, 7]


@pytest.mark.parametrize("field", ["model.path", "reward.judge.model_path", "distill.model_path"])
def test_an_unknown_builtin_model_is_refused_at_load_naming_the_field(field):
    extra = ["learner.algorithm=gspo_token"] if field.startswith("distill") else []
    with pytest.raises(ConfigError, match=rf"{field}='builtin:tiny' is no builtin model: .*builtin:tiny_moe"):
        load_config("configs/tiny_moe.yaml", [f"{field}=builtin:tiny", *extra])
    load_config("configs/tiny_moe.yaml", [f"{field}=builtin:tiny_llama", *extra])  # a builtin of another arch loads
