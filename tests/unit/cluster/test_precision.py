"""The ``precision`` switch (cluster/precision.py): the CPU's bf16 flags, what auto / bf16 / fp32 set, keys the
config sets winning or refused by name, the report in devices.json, and the GPU configs' memory plan following
the dtype it chose."""

from __future__ import annotations

import json

import pytest

from cluster import precision
from cluster.config import Config, ConfigError, load_config
from cluster.planning.actor_placement import PlanError
from cluster.planning.plan import plan
from tests.helpers import REPO_ROOT

TINY = REPO_ROOT / "configs/tiny_moe.yaml"  # learner.zero_stage: 0, set
ZERO2 = REPO_ROOT / "configs/tiny_moe_zero2.yaml"  # learner.zero_stage: 2, no dtype key set
GIB = 2**30

# the first processor's lines of /proc/cpuinfo, cut to what matters
ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel\t\t: 17\n"
        "flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512vl\n\n"
        "processor\t: 1\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512vl\n")
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_fp16 amx_bf16 amx_tile amx_int8 avx512_bf16\n"
AMX_ONLY = "processor\t: 0\nflags\t\t: avx2 avx512f amx_tile amx_bf16\n"
ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma avx512bw_lookalike bf16x\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


@pytest.fixture
def cpu(monkeypatch, tmp_path):
    """``cpu(text)``: this machine's /proc/cpuinfo reads as ``text`` (None: no such file)."""
    def use(text: str | None) -> None:
        path = tmp_path / "cpuinfo"
        if text is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(text)
        monkeypatch.setattr(precision, "CPUINFO_PATH", path)
    return use


def test_bf16_flags_from_cpuinfo():
    assert precision.cpu_bf16_flags(ZEN4) == ["avx512_bf16"]
    assert precision.cpu_bf16_flags(SAPPHIRE) == ["avx512_bf16", "amx_bf16"]
    assert precision.cpu_bf16_flags(AMX_ONLY) == ["amx_bf16"]
    assert precision.cpu_bf16_flags(ZEN3) == []  # whole flags only: no substring matches
    assert precision.cpu_bf16_flags(ARM) == [] and precision.cpu_bf16_flags("") == []


@pytest.mark.parametrize("text, flags", [(ZEN4, ["avx512_bf16"]), (AMX_ONLY, ["amx_bf16"])])
def test_auto_picks_bf16_on_a_cpu_with_bf16_units(cpu, text, flags):
    cpu(text)
    cfg = load_config(ZERO2, ["precision=auto"])
    r = cfg.precision_report
    assert (r["requested"], r["chosen"], r["cpu_bf16_flags"]) == ("auto", "bf16", flags)
    assert flags[0] in r["reason"] and "on the CPU" in r["reason"]
    assert (cfg.rollout.dtype, cfg.learner.dtype, cfg.learner.autocast) == ("bfloat16", "bfloat16", "off")
    assert cfg.learner.old_logprob_source == "recompute" and cfg.learner.zero_stage == 2
    assert r["filled"] == {"rollout.dtype": "bfloat16", "learner.dtype": "bfloat16", "learner.autocast": "off",
                           "learner.old_logprob_source": "recompute"}
    assert r["effective"]["learner.old_logprob_source"] == "recompute"


@pytest.mark.parametrize("text", [ZEN3, ARM, None])
def test_auto_keeps_fp32_on_a_cpu_without_them(cpu, text):
    cpu(text)
    cfg = load_config(ZERO2, ["precision=auto"])
    r = cfg.precision_report
    assert r["chosen"] == "fp32" and "none of avx512_bf16, amx_bf16" in r["reason"]
    assert (cfg.rollout.dtype, cfg.learner.dtype, cfg.learner.old_logprob_source) == ("float32", "float32", "auto")


def test_auto_picks_bf16_on_gpus_whatever_the_cpu(cpu):
    cpu(ZEN3)
    cfg = load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", ["precision=auto"])
    assert cfg.precision_report["chosen"] == "bf16" and "on GPUs" in cfg.precision_report["reason"]
    # one role on the CPU: its CPU decides
    cfg = load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", ["precision=auto", "learner.num_gpus_per_rank=0"])
    assert cfg.precision_report["chosen"] == "fp32" and "learner on the CPU" in cfg.precision_report["reason"]


def test_auto_follows_keys_the_config_sets(cpu):
    """tiny_moe.yaml sets learner.zero_stage=0, where DeepSpeed's bf16 cannot run: auto takes fp32 and says
    why; on a CPU without bf16 units a config that sets the bf16 keys gets bf16; keys of both are refused."""
    cpu(ZEN4)
    r = load_config(TINY, ["precision=auto"]).precision_report
    assert r["chosen"] == "fp32" and "but the config sets learner.zero_stage=0" in r["reason"]
    cpu(ZEN3)
    cfg = load_config(ZERO2, ["precision=auto", "rollout.dtype=bfloat16"])
    assert (cfg.precision_report["chosen"], cfg.learner.dtype) == ("bf16", "bfloat16")
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["precision=auto", "rollout.dtype=bfloat16"])
    msg = str(err.value)
    assert "precision=auto" in msg and "rollout.dtype=bfloat16" in msg and "learner.zero_stage=0" in msg


def test_explicit_precision_refuses_keys_set_to_the_other_one(cpu):
    cpu(ZEN4)
    with pytest.raises(ConfigError) as err:
        load_config(ZERO2, ["precision=bf16", "rollout.dtype=float32"])
    assert "precision=bf16 contradicts rollout.dtype=float32" in str(err.value)
    assert "drop rollout.dtype (precision sets it)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["precision=bf16"])
    assert "learner.zero_stage=0" in str(err.value) and "set learner.zero_stage >= 1" in str(err.value)
    with pytest.raises(ConfigError, match="precision=fp32 contradicts learner.dtype=bfloat16, learner.autocast="):
        load_config(ZERO2, ["precision=fp32", "learner.dtype=bfloat16", "learner.autocast=bfloat16"])
    # bf16 on a CPU without bf16 units is the user's call: it runs (slower there, cpu-stack.md)
    cpu(ZEN3)
    assert load_config(TINY, ["precision=bf16", "learner.zero_stage=1"]).learner.dtype == "bfloat16"


def test_keys_that_agree_are_accepted_and_the_behaviour_source_can_be_kept(cpu):
    cpu(ZEN4)
    cfg = load_config(ZERO2, ["precision=bf16", "rollout.dtype=bfloat16", "learner.autocast=bfloat16"])
    assert cfg.precision_report["filled"] == {"learner.dtype": "bfloat16", "learner.old_logprob_source": "recompute"}
    assert cfg.learner.autocast == "bfloat16"  # bf16 weights under autocast: the same bf16 learner
    cfg = load_config(ZERO2, ["precision=bf16", "learner.old_logprob_source=rollout"])
    assert cfg.learner.old_logprob_source == "rollout"
    assert "docs/results.md" in cfg.precision_report["kept"]["learner.old_logprob_source"]
    assert "kept learner.old_logprob_source=rollout" in precision.summary(cfg.precision_report)
    cfg = load_config(ZERO2, ["precision=bf16", "learner.pre_update_pass=never", "learner.moe_diagnostics=false",
                              "health.enabled=false"])
    assert cfg.learner.old_logprob_source == "auto"  # with no pass it reads as rollout (learner/step.py)
    assert "pre_update_pass=never" in cfg.precision_report["kept"]["learner.old_logprob_source"]
    cfg = load_config(ZERO2, ["precision=bf16", "learner.old_logprob_source=auto"])  # set: it measures, then switches
    assert cfg.learner.old_logprob_source == "auto"
    assert "max_rollout_logprob_gap" in cfg.precision_report["kept"]["learner.old_logprob_source"]
    assert "learner.old_logprob_source" not in cfg.precision_report["filled"]


def test_unset_switch_keeps_every_config_as_it_was(cpu):
    """The default (null) touches nothing, on any CPU: make train and the suite's configs run as before."""
    cpu(SAPPHIRE)
    for path in (TINY, ZERO2, REPO_ROOT / "configs/tiny_code.yaml"):
        cfg = load_config(path)
        r = cfg.precision_report
        assert (r["requested"], r["chosen"], r["filled"], r["kept"]) == (None, "fp32", {}, {})
        assert (cfg.rollout.dtype, cfg.learner.dtype, cfg.learner.autocast) == ("float32", "float32", "off")
    assert load_config(ZERO2, ["rollout.dtype=bfloat16"]).precision_report["chosen"] == "mixed"
    assert Config().precision is None and Config().precision_report["chosen"] == "fp32"


@pytest.mark.parametrize("switch", ["auto", "bf16", "fp32"])
def test_resolved_config_validates_again_to_the_same(cpu, switch):
    """A resolved config dumped (config.yaml, a checkpoint) and loaded again, also where auto would pick the
    other precision, resolves to the same keys."""
    cpu(ZEN4)
    cfg = load_config(ZERO2, [f"precision={switch}"])
    cpu(ZEN3)
    again = Config.model_validate(cfg.model_dump(mode="json"))
    assert again.model_dump() == cfg.model_dump()
    assert again.precision_report["chosen"] == cfg.precision_report["chosen"]


def test_devices_json_holds_the_choice(cpu, tmp_path, monkeypatch):
    """devices.record writes the report beside the ranks' and engines' devices (fake ranks and engines)."""
    import ray

    from cluster.runtime import devices

    cpu(ZEN4)
    cfg = load_config(ZERO2, ["precision=auto"])

    class Learners:
        def call(self, name):
            assert name == "devices"
            return [{"params": ["cpu"], "master": ["cpu"], "optimizer_state": ["cpu"], "backend": "gloo"}]

    class Engine:
        class device_report:  # noqa: N801 - the actor method's name
            @staticmethod
            def remote():
                return {"weights": ["cpu"]}

    class Fleet:
        engines = [Engine()]

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    path = tmp_path / devices.DEVICES_FILE
    devices.record(Learners(), Fleet(), path, precision=cfg.precision_report)
    written = json.loads(path.read_text())
    assert written["precision"]["chosen"] == "bf16" and written["precision"]["cpu_bf16_flags"] == ["avx512_bf16"]
    assert written["precision"]["effective"]["learner.dtype"] == "bfloat16"
    assert devices.device_problems(written, cfg) == []


@pytest.mark.parametrize("name", ["qwen3_1p7b_dense_gsm8k", "qwen3_30b_a3b_gsm8k"])
def test_gpu_configs_take_the_bf16_path_through_the_switch(name):
    cfg = load_config(REPO_ROOT / f"configs/{name}.yaml")
    eff = cfg.precision_report["effective"]
    assert cfg.precision == "bf16" and cfg.precision_report["chosen"] == "bf16"
    assert (eff["rollout.dtype"], eff["learner.dtype"], eff["learner.autocast"]) == ("bfloat16", "bfloat16", "off")
    assert eff["learner.old_logprob_source"] == "recompute" and eff["learner.zero_stage"] >= 1


def test_memory_plan_follows_the_chosen_dtype():
    """Qwen3-1.7B (P = 1.72e9, ZeRO-2 over N = 4, one-GPU engines): bf16 holds 2P of weights, 4P/N of fp32
    gradients and 12P/N of fp32 master weights and moments per rank, the engine 2P and 2 bytes per KV element;
    precision=fp32 4P, 4P/N, 8P/N, 4P and 4 bytes, and the micro-batch's activations double: over an 80 GiB GPU
    (refused, the message proposing bf16), within a 141 GiB one."""
    path, p = REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", 1.72e9
    with pytest.raises(PlanError, match=r"learner.dtype=float32.*train in bf16 \(precision=bf16"):
        plan(load_config(path, ["precision=fp32"]))  # 87.2 GiB a rank on an 80 GiB GPU
    mem = {s: plan(load_config(path, [f"precision={s}"]), gpu_memory_gib=141.0)["memory"] for s in ("bf16", "fp32")}
    for s, b, k in (("bf16", 2, 12), ("fp32", 4, 8)):
        m = mem[s]["learner_per_rank_gib"]
        assert (m["weights"], m["gradients"], m["optimizer"]) == (round(b * p / GIB, 2), round(4 * p / 4 / GIB, 2),
                                                                 round(k * p / 4 / GIB, 2))
        assert mem[s]["rollout_per_gpu_gib"]["weights"] == round(b * p / GIB, 2)
        assert mem[s]["rollout_kv"]["kv_bytes_per_token_per_gpu"] == 2 * 28 * 8 * 128 * b
    lb, lf = mem["bf16"]["learner_per_rank_gib"], mem["fp32"]["learner_per_rank_gib"]
    assert abs(lf["activations"] - 2 * lb["activations"]) <= 0.02
    assert "bfloat16" in mem["bf16"]["learner_formula"] and "float32" in mem["fp32"]["learner_formula"]


def test_dry_run_prints_the_choice(cpu, capsys):
    import yaml

    from cluster.train import main

    cpu(AMX_ONLY)
    assert main([str(ZERO2), "precision=auto", "--dry-run"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["config"]["precision"] == "auto" and out["config"]["learner"]["dtype"] == "bfloat16"
    assert out["precision"]["chosen"] == "bf16" and out["precision"]["cpu_bf16_flags"] == ["amx_bf16"]
