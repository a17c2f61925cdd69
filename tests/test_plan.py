"""The dry-run resource plan: placement per node and the GPU memory check (cluster/plan.py), and the GPU
configs validated through ``python -m cluster.train CONFIG --dry-run``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from cluster.config import load_config
from cluster.plan import PlanError, learner_memory_gib, plan, rollout_weights_gib
from tests.conftest import REPO_ROOT

GPU_CONFIGS = {
    "configs/qwen3_30b_a3b_gsm8k.yaml": {"nodes": 2, "group_size": 16},
    "configs/qwen3_1p7b_dense_gsm8k.yaml": {"nodes": 1, "group_size": 8},
}
GIB = 2**30


def dry_run(config: str, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "cluster.train", config, *overrides, "--dry-run"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------------------------------- the formula


def test_learner_memory_hand_values():
    p = float(GIB)  # 2**30 parameters: every term comes out in whole GiB
    # bfloat16, ZeRO-3 over 4 ranks: weights 2/4, gradients 2/4, optimizer 12/4 GiB, + 4 GiB overhead.
    m = learner_memory_gib(p, zero_stage=3, dtype="bfloat16", world_size=4)
    assert (m["weights"], m["gradients"], m["optimizer"], m["reference"]) == (0.5, 0.5, 3.0, 0.0)
    assert m["total"] == 8.0
    # ZeRO-2 keeps whole weights; ZeRO-1 whole gradients; ZeRO-0 shards nothing.
    assert learner_memory_gib(p, zero_stage=2, dtype="bfloat16", world_size=4)["total"] == 2 + 0.5 + 3 + 4
    assert learner_memory_gib(p, zero_stage=1, dtype="bfloat16", world_size=4)["total"] == 2 + 2 + 3 + 4
    assert learner_memory_gib(p, zero_stage=0, dtype="bfloat16", world_size=4)["total"] == 2 + 2 + 12 + 4
    # float32: 4-byte weights and gradients, Adam's two moments only (8 bytes); a KL reference adds a full copy.
    f = learner_memory_gib(p, zero_stage=0, dtype="float32", world_size=1, reference_model=True)
    assert (f["weights"], f["gradients"], f["optimizer"], f["reference"], f["total"]) == (4, 4, 8, 4, 24)


def test_learner_memory_refuses_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        learner_memory_gib(1e9, zero_stage=2, dtype="float16", world_size=1)
    with pytest.raises(ValueError, match="zero_stage"):
        learner_memory_gib(1e9, zero_stage=4, dtype="bfloat16", world_size=1)
    with pytest.raises(ValueError, match="world_size"):
        learner_memory_gib(1e9, zero_stage=2, dtype="bfloat16", world_size=0)


def test_rollout_weights_per_gpu():
    assert rollout_weights_gib(float(GIB), dtype="bfloat16", tensor_parallel_size=2) == 1.0
    assert rollout_weights_gib(float(GIB), dtype="float32", tensor_parallel_size=1) == 4.0


# ------------------------------------------------------------------------------------- the GPU configs


@pytest.mark.parametrize("config", sorted(GPU_CONFIGS))
def test_gpu_config_dry_run_fits(config):
    r = dry_run(config)
    assert r.returncode == 0, r.stderr[-3000:]
    out = yaml.safe_load(r.stdout)
    cfg, p = out["config"], out["plan"]
    # The paper's GSPO settings.
    lc = cfg["learner"]
    assert lc["algorithm"] == "gspo" and lc["clip_low"] == 3e-4 and lc["clip_high"] == 4e-4
    assert lc["kl_coef"] == 0.0 and lc["num_minibatches"] == 4 and lc["normalize_adv_std"] is True
    assert cfg["trainer"]["group_size"] == GPU_CONFIGS[config]["group_size"]
    assert cfg["data"]["task"] == "gsm8k" and cfg["data"]["train_path"].startswith("../shared/data/gsm8k/")
    assert lc["num_gpus_per_rank"] == 1 and cfg["rollout"]["num_gpus_per_engine"] == 1
    # The plan: placement per node, every GPU used once, memory checked and within 80 GiB.
    assert p["nodes_needed"] == GPU_CONFIGS[config]["nodes"]
    assert p["placement"]["learner"]["strategy"] == "STRICT_PACK"
    held = [g for n in p["nodes"] for g in n["gpus"].values()]
    assert sum(len(u) for u in held) == p["gpus_total"]
    learner_gpus = [u for u in held if u[0].startswith("learner")]
    assert len(learner_gpus) == lc["world_size"] and all(len(u) == 1 for u in learner_gpus)
    assert all(n["node"] == 0 for n in p["nodes"] if any("learner" in a for a in n["actors"]))
    mem = p["memory"]
    assert mem["checked"] is True and mem["gpu_memory_gib"] == 80.0
    assert mem["fullest_gpu"]["claimed_gib"] <= 80.0
    assert mem["rollout_per_gpu_gib"]["kv_cache"] > 8.0
    assert mem["learner_activation_headroom_gib"] > 8.0
    assert mem["warnings"] == []


def test_qwen3_30b_numbers_by_hand():
    """30.5 B parameters, bfloat16, ZeRO-3 over 8 ranks: (2 + 2 + 12) x 30.5e9 / 8 bytes + 4 GiB overhead;
    vLLM holds 2 x 30.5e9 / 2 bytes per GPU of a tensor-parallel-2 engine."""
    p = plan(load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml"))
    learner = 16 * 30.5e9 / 8 / GIB + 4
    assert p["memory"]["learner_per_rank_gib"]["total"] == round(learner, 2) == 60.81
    assert p["memory"]["rollout_per_gpu_gib"]["weights"] == round(2 * 30.5e9 / 2 / GIB, 2) == 28.41
    assert p["memory"]["rollout_per_gpu_gib"]["kv_cache"] == round(0.85 * 80 - 2 * 30.5e9 / 2 / GIB - 2, 2)
    # node 1 holds the four engines, two GPUs each
    engines = p["nodes"][1]["gpus"]
    assert [engines[g] for g in range(8)] == [[f"rollout engine {g // 2}"] for g in range(8)]


def test_over_budget_variant_fails_with_the_numbers():
    """ZeRO-1 keeps whole bf16 weights and gradients on every rank: 2 x 56.8 + 42.6 + 4 = 160.2 GiB > 80 GiB."""
    r = dry_run("configs/qwen3_30b_a3b_gsm8k.yaml", "learner.zero_stage=1")
    assert r.returncode != 0
    assert "GPU memory over budget on node 0 GPU 0: 160.2 GiB needed > 80 GiB per GPU" in r.stderr
    assert "weights 56.8 + gradients 56.8 + optimizer 42.6" in r.stderr
    assert "learner.zero_stage=1" in r.stderr and "raise learner.zero_stage (now 1)" in r.stderr


def test_gpu_memory_is_a_parameter():
    """ZeRO-2: 56.8 + 7.1 + 42.6 + 4 = 110.5 GiB per rank: over an H100 (80 GiB), within an H200 (141 GiB)."""
    cfg = load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml", ["learner.zero_stage=2"])
    with pytest.raises(PlanError, match=r"110\.5 GiB needed > 80 GiB"):
        plan(cfg)
    h200 = plan(cfg, gpu_memory_gib=141.0)["memory"]
    learner = 30.5e9 * (2 + 2 / 8 + 12 / 8) / GIB + 4
    assert h200["learner_per_rank_gib"]["total"] == round(learner, 2) == 110.52
    assert h200["learner_activation_headroom_gib"] == round(141.0 - learner, 2)
    # vLLM claims its share of the bigger GPU: 0.85 x 141 GiB
    assert h200["fullest_gpu"]["claimed_gib"] == round(0.85 * 141, 2)


def test_rollout_weights_over_vllm_share():
    cfg = load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml",
                      ["rollout.tensor_parallel_size=1", "rollout.gpu_memory_utilization=0.5"])
    with pytest.raises(PlanError, match=r"weights 56\.8 GiB per GPU .*rollout.tensor_parallel_size=1.* 40\.0 GiB"):
        plan(cfg)


def test_learner_group_must_fit_one_node():
    cfg = load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml",
                      ["learner.world_size=16", "trainer.prompts_per_step=128"])
    with pytest.raises(PlanError, match="learner.world_size=16 .* one node of 8 GPUs: .*STRICT_PACK"):
        plan(cfg)
    assert plan(cfg, gpus_per_node=16)["nodes_needed"] == 2


def test_fractional_gpus_share_a_device():
    """Half-GPU requests pack two actors on one device; the device must hold both claims."""
    base = ["learner.num_gpus_per_rank=0.5", "rollout.num_gpus_per_engine=0.5"]
    cfg = load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", base)
    with pytest.raises(PlanError, match=r"rollout engine 0: 68\.0 GiB, rollout engine 1: 68\.0 GiB"):
        plan(cfg)
    ok = plan(load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", base + ["rollout.gpu_memory_utilization=0.4"]))
    gpus = ok["nodes"][0]["gpus"]
    assert gpus[0] == ["learner rank 0", "learner rank 1"] and gpus[2] == ["rollout engine 0", "rollout engine 1"]
    assert ok["memory"]["fullest_gpu"]["claimed_gib"] == 64.0
    with pytest.raises(PlanError, match="tensor_parallel_size=2 needs a whole GPU"):
        plan(load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", base + ["rollout.tensor_parallel_size=2"]))


def test_cpu_config_plan_has_no_gpu_check():
    p = plan(load_config(REPO_ROOT / "configs/tiny_moe.yaml"))
    assert p["gpus_total"] == 0 and p["logical_cpus"] == 1.75
    assert len(p["nodes"]) == 1 and "gpus" not in p["nodes"][0] and "memory" not in p
    assert p["placement"]["learner"]["strategy"] == "PACK"


def test_missing_param_count_is_reported_not_guessed():
    p = plan(load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", ["model.num_params_b=null"]))
    assert p["memory"] == {"checked": False, "why": "model.num_params_b is not set"}


def test_dry_run_reads_the_cluster_section():
    """cluster.gpu_memory_gib from the config (or an override) drives the --dry-run memory check."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "cluster.train", "configs/qwen3_30b_a3b_gsm8k.yaml", "--dry-run"]
    ok = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    small = subprocess.run([*cmd, "cluster.gpu_memory_gib=40"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert small.returncode == 2
    assert "over budget" in small.stderr and "40 GiB per GPU" in small.stderr and "Traceback" not in small.stderr
