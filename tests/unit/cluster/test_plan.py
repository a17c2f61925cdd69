"""The dry-run resource plan: placement per node and the GPU memory check (cluster/planning/plan.py), and the GPU
configs validated through ``python -m cluster.train CONFIG --dry-run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from cluster.config import load_config
from cluster.planning.actor_placement import PlanError, cpu_oversubscription
from cluster.planning.memory_model import learner_host_offload_gib, learner_memory_gib, rollout_weights_gib
from cluster.planning.plan import plan
from tests.helpers import REPO_ROOT

GPU_CONFIGS = {
    "configs/qwen3_30b_a3b_gsm8k.yaml": {"nodes": 2, "group_size": 16},
    "configs/qwen3_1p7b_dense_gsm8k.yaml": {"nodes": 1, "group_size": 8},
}


GIB = 2**30


def dry_run(config: str, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "cluster.train", config, *overrides, "--dry-run"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_learner_memory_hand_values():
    p = float(GIB)  # 2**30 parameters: every term comes out in whole GiB
    # bfloat16, ZeRO-3 over 4 ranks: weights 2/4, fp32-accumulated gradients 4/4, optimizer 12/4 GiB, + 4 GiB.
    m = learner_memory_gib(p, zero_stage=3, dtype="bfloat16", world_size=4)
    assert (m["weights"], m["gradients"], m["optimizer"], m["reference"]) == (0.5, 1.0, 3.0, 0.0)
    assert m["total"] == 8.5
    # ZeRO-2 keeps whole weights; ZeRO-1 whole gradients; ZeRO-0 shards nothing.
    assert learner_memory_gib(p, zero_stage=2, dtype="bfloat16", world_size=4)["total"] == 2 + 1 + 3 + 4
    assert learner_memory_gib(p, zero_stage=1, dtype="bfloat16", world_size=4)["total"] == 2 + 4 + 3 + 4
    assert learner_memory_gib(p, zero_stage=0, dtype="bfloat16", world_size=4)["total"] == 2 + 4 + 12 + 4
    # float32: 4-byte weights and gradients, Adam's two moments only (8 bytes); a KL reference adds a full copy.
    f = learner_memory_gib(p, zero_stage=0, dtype="float32", world_size=1, reference_model=True)
    assert (f["weights"], f["gradients"], f["optimizer"], f["reference"], f["total"]) == (4, 4, 8, 4, 24)


def test_offloaded_learner_memory_hand_values():
    """learner.offload_optimizer=cpu: the optimizer leaves the GPU at every stage, ZeRO-3's gradient partitions
    too; the host holds 12 bytes a parameter of optimizer state over N, and 4 of fp32 gradients over N, twice at
    ZeRO-3 or in float32 (the gradient CPU Adam steps with and a host accumulation buffer)."""
    p = float(GIB)
    m = learner_memory_gib(p, zero_stage=3, dtype="bfloat16", world_size=4, offload_optimizer=True)
    assert (m["weights"], m["gradients"], m["optimizer"], m["total"]) == (0.5, 0.0, 0.0, 4.5)
    assert learner_host_offload_gib(p, zero_stage=3, dtype="bfloat16", world_size=4) == {
        "optimizer": 3.0, "gradients": 2.0, "total": 5.0}
    # ZeRO-2 and ZeRO-1 in bf16 keep their gradients on the GPU; the host one fp32 copy of the partition.
    assert learner_memory_gib(p, zero_stage=2, dtype="bfloat16", world_size=4, offload_optimizer=True)["total"] == 2 + 1 + 4
    assert learner_memory_gib(p, zero_stage=1, dtype="bfloat16", world_size=4, offload_optimizer=True)["total"] == 2 + 4 + 4
    assert learner_host_offload_gib(p, zero_stage=2, dtype="bfloat16", world_size=4)["total"] == 3 + 1
    # float32: the host's master partition is a copy too (12 bytes), and the host accumulates (2 x 4 bytes).
    assert learner_host_offload_gib(p, zero_stage=2, dtype="float32", world_size=2) == {
        "optimizer": 6.0, "gradients": 4.0, "total": 10.0}
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        learner_memory_gib(p, zero_stage=0, dtype="float32", world_size=1, offload_optimizer=True)
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        learner_host_offload_gib(p, zero_stage=0, dtype="float32", world_size=1)


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
    assert mem["learner_free_gib"] > 0.05 * 80
    assert mem["warnings"] == []
    kv = mem["rollout_kv"]
    assert kv["kv_tokens_needed"] <= kv["kv_tokens_per_engine"] and kv["sequences_per_engine_per_step"] == 256


def test_qwen3_30b_numbers_by_hand():
    """30.5 B parameters, bfloat16, ZeRO-3 over 8 ranks, optimizer offloaded: 2 x 30.5e9 / 8 bytes of weights
    + 4 GiB overhead on the GPU ((2 + 4 + 12) x 30.5e9 / 8 without offload), (12 + 2 x 4) x 30.5e9 / 8 bytes
    on the host; vLLM holds 2 x 30.5e9 / 2 bytes per GPU of a tensor-parallel-2 engine."""
    p = plan(load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml"))
    static = 2 * 30.5e9 / 8 / GIB + 4
    # 4096 tokens, checkpointed: each of 48 layers keeps its 2048-wide input, one layer recomputes 82048
    # elements per token (attention 3*2048 + 3*4096 + 4*512; MoE 2*2048 + 128 + 2*8*2048 + 4*8*768), bf16.
    act = 4096 * (48 * 2048 + 82048) * 2 / GIB
    logits = (2 * 4096 * 151936 * 2 + 12 * 2**25) / GIB
    gathered = 2 * (1e9 + 5e7) / GIB
    m = p["memory"]["learner_per_rank_gib"]
    assert (m["activations"], m["logits"], m["gathered"]) == (round(act, 2), round(logits, 2), round(gathered, 2))
    assert m["activations_without_checkpointing"] == round(4096 * 48 * 82048 * 2 / GIB, 2) == 30.05
    assert (m["gradients"], m["optimizer"]) == (0.0, 0.0)
    assert m["total"] == round(static + act + logits + gathered, 2) == 17.13
    assert p["memory"]["learner_free_gib"] == round(80 - 17.13, 2)
    host = p["memory"]["learner_host_offload_per_rank_gib"]
    assert (host["optimizer"], host["gradients"]) == (round(12 * 30.5e9 / 8 / GIB, 2), round(8 * 30.5e9 / 8 / GIB, 2))
    assert host["total"] == round(20 * 30.5e9 / 8 / GIB, 2) == 71.01
    assert "optimizer offloaded to host RAM" in p["memory"]["learner_formula"]
    no_offload = plan(load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml", ["learner.offload_optimizer=none"]))
    static_no_offload = (2 + 4 + 12) * 30.5e9 / 8 / GIB + 4
    assert no_offload["memory"]["learner_per_rank_gib"]["total"] == round(static_no_offload + act + logits + gathered,
                                                                          2) == 73.94
    assert "learner_host_offload_per_rank_gib" not in no_offload["memory"]
    # KV: 2 x 48 layers x (4 kv heads / 2 GPUs) x 128 x 2 bytes = 49152 bytes per token per GPU, blocks of 16.
    kv = p["memory"]["rollout_kv"]
    kv_bytes = round(0.85 * 80 - 2 * 30.5e9 / 2 / GIB - 2, 2) * GIB  # the plan's KV GiB per GPU
    assert kv["kv_bytes_per_token_per_gpu"] == 49152
    assert kv["kv_tokens_per_engine"] == int(kv_bytes // (49152 * 16)) * 16
    assert kv["kv_tokens_needed"] == 64 * 16 // 4 * 1536
    assert p["memory"]["rollout_per_gpu_gib"]["weights"] == round(2 * 30.5e9 / 2 / GIB, 2) == 28.41
    assert p["memory"]["rollout_per_gpu_gib"]["kv_cache"] == round(0.85 * 80 - 2 * 30.5e9 / 2 / GIB - 2, 2)
    # node 1 holds the four engines, two GPUs each
    engines = p["nodes"][1]["gpus"]
    assert [engines[g] for g in range(8)] == [[f"rollout engine {g // 2}"] for g in range(8)]


def test_over_budget_variant_fails_with_the_numbers():
    """ZeRO-1 keeps whole bf16 weights and fp32 gradients on every rank: 56.8 + 113.6 + 42.6 + 4 + activations
    1.4 + logits 2.7 = 221.1 GiB > 80 GiB without offload; offloading the optimizer leaves 178.5 GiB."""
    r = dry_run("configs/qwen3_30b_a3b_gsm8k.yaml", "learner.zero_stage=1", "learner.offload_optimizer=none")
    assert r.returncode != 0
    assert "GPU memory over budget on node 0 GPU 0: 221.1 GiB needed > 80 GiB per GPU" in r.stderr
    assert "weights 56.8 + gradients 113.6 + optimizer 42.6" in r.stderr
    assert "learner.zero_stage=1" in r.stderr and "raise learner.zero_stage (now 1)" in r.stderr
    assert "offload the optimizer to host RAM (learner.offload_optimizer=cpu)" in r.stderr
    r = dry_run("configs/qwen3_30b_a3b_gsm8k.yaml", "learner.zero_stage=1")
    assert "178.5 GiB needed > 80 GiB" in r.stderr and "optimizer 0.0" in r.stderr
    assert "learner.offload_optimizer=cpu)" not in r.stderr


def test_gpu_memory_is_a_parameter():
    """ZeRO-2 without offload: 56.8 + 14.2 + 42.6 + 4 + 1.4 + 2.7 = 121.7 GiB per rank: over an H100 (80 GiB),
    within an H200."""
    cfg = load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml",
                      ["learner.zero_stage=2", "learner.offload_optimizer=none"])
    with pytest.raises(PlanError, match=r"121\.7 GiB needed > 80 GiB"):
        plan(cfg)
    h200 = plan(cfg, gpu_memory_gib=141.0)["memory"]
    m = h200["learner_per_rank_gib"]
    learner = 30.5e9 * (2 + 4 / 8 + 12 / 8) / GIB + 4 + m["activations"] + m["logits"]
    assert m["gathered"] == 0.0 and abs(m["total"] - learner) < 0.02
    assert abs(h200["learner_free_gib"] - (141.0 - learner)) < 0.02
    # the fullest GPU is a learner's now (vLLM claims its share of the bigger GPU: 0.85 x 141 = 119.85 GiB)
    assert h200["fullest_gpu"]["claimed_gib"] == m["total"] > round(0.85 * 141, 2)


def test_rollout_weights_over_vllm_share():
    cfg = load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml",
                      ["rollout.tensor_parallel_size=1", "rollout.gpu_memory_utilization=0.5"])
    with pytest.raises(PlanError, match=r"weights 56\.8 GiB per GPU .*rollout.tensor_parallel_size=1.* 40\.0 GiB"):
        plan(cfg)


def test_learner_ranks_span_nodes_a_group_per_node_as_the_runtime_places_them():
    """16 ranks of one GPU on nodes of 8: ranks 0-7 on node 0, 8-15 on node 1 (one STRICT_PACK group per node,
    cluster/runtime/learner_group.py), the engines after them; not every rank on node 0."""
    cfg = load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml",
                      ["learner.world_size=16", "trainer.prompts_per_step=128"])
    out = plan(cfg)
    ranks = {n["node"]: [a for a in n["actors"] if a.startswith("learner")] for n in out["nodes"]}
    assert ranks[0] == [f"learner rank {r}" for r in range(8)]
    assert ranks[1] == [f"learner rank {r}" for r in range(8, 16)]
    assert out["placement"]["learner"]["groups"] == 2 and out["placement"]["learner"]["ranks_per_group"] == 8
    assert out["nodes_needed"] == 3 and plan(cfg, gpus_per_node=16)["nodes_needed"] == 2
    with pytest.raises(PlanError, match=r"learner.num_gpus_per_rank=16(\.0)? does not fit one node of 8 GPUs"):
        plan(load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml", ["learner.num_gpus_per_rank=16"]))


def test_fractional_gpus_share_a_device():
    """Half-GPU requests pack two actors on one device; the device must hold both claims."""
    base = ["learner.num_gpus_per_rank=0.5", "rollout.num_gpus_per_engine=0.5", "learner.gradient_checkpointing=true",
            "learner.max_tokens_per_micro_batch=4096"]
    cfg = load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", base)
    with pytest.raises(PlanError, match=r"rollout engine 0: 68\.0 GiB, rollout engine 1: 68\.0 GiB"):
        plan(cfg)
    ok = plan(load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", base + ["rollout.gpu_memory_utilization=0.4",
                                                                                          "trainer.prompts_per_step=64"]))
    gpus = ok["nodes"][0]["gpus"]
    assert gpus[0] == ["learner rank 0", "learner rank 1"] and gpus[2] == ["rollout engine 0", "rollout engine 1"]
    assert ok["memory"]["fullest_gpu"]["claimed_gib"] == 64.0
    with pytest.raises(PlanError, match="tensor_parallel_size=2 needs a whole GPU"):
        plan(load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", base + ["rollout.tensor_parallel_size=2"]))


def test_cpu_config_plan_has_no_gpu_check():
    p = plan(load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml"))
    assert p["gpus_total"] == 0 and p["logical_cpus"] == 1.75
    assert len(p["nodes"]) == 1 and "gpus" not in p["nodes"][0]
    assert p["memory"]["checked"] is False and p["memory"]["host_ram_gib"]["checked"] is False
    assert p["placement"]["learner"]["strategy"] == "PACK"


def test_cpu_plan_with_offload_counts_the_host_buffers():
    """On the CPU the host holds everything either way: offload (the tiny config, float32, ZeRO-2, 2 ranks, taken
    as 1e9 parameters) moves each rank's 8 P / 2 bytes of Adam moments out of the rank's device part and adds the
    offload's 12 + 2 x 4 bytes a parameter over 2 (a master copy and a host gradient accumulation buffer)."""
    big = ["model.num_params_b=1.0"]
    plain = plan(load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml", big))["memory"]
    off = plan(load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml", big + ["learner.offload_optimizer=cpu"]))["memory"]
    p = 1e9
    assert off["learner_per_rank_gib"]["optimizer"] == 0.0
    assert off["learner_host_offload_per_rank_gib"]["total"] == round(20 * p / 2 / GIB, 2)
    node, node_plain = off["host_ram_gib"]["node 0"], plain["host_ram_gib"]["node 0"]
    assert node["learner_optimizer_offload"] == pytest.approx(2 * 20 * p / 2 / GIB, abs=0.01)
    assert node_plain["learner_ranks"] - node["learner_ranks"] == pytest.approx(2 * 8 * p / 2 / GIB, abs=0.02)
    assert node_plain["learner_optimizer_offload"] == 0.0


def test_missing_param_count_is_reported_not_guessed():
    p = plan(load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", ["model.num_params_b=null",
                                                                                   "model.shape=null"]))
    assert p["memory"] == {"checked": False, "why": "model.num_params_b is not set"}


def test_dry_run_reads_the_cluster_section():
    """cluster.gpu_memory_gib from the config (or an override) drives the --dry-run memory check."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "cluster.train", "configs/qwen3_30b_a3b_gsm8k.yaml", "--dry-run"]
    ok = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    small = subprocess.run([*cmd, "cluster.gpu_memory_gib=40", "learner.offload_optimizer=none"], cwd=REPO_ROOT,
                           capture_output=True, text=True)
    assert small.returncode == 2
    assert "over budget" in small.stderr and "40 GiB per GPU" in small.stderr and "Traceback" not in small.stderr


def test_param_count_matches_the_real_tiny_model():
    """memory_model.param_count from the config keys equals the parameters transformers builds."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from cluster.planning import memory_model as mm
    from cluster.planning.memory_budget import model_shape

    cfg = load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml", ["model.num_experts=64"])
    shape = model_shape(cfg)
    m = cfg.model
    hf = Qwen3MoeConfig(vocab_size=shape.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                        head_dim=m.head_dim, moe_intermediate_size=m.moe_intermediate_size,
                        intermediate_size=m.moe_intermediate_size, num_experts=m.num_experts,
                        num_experts_per_tok=m.num_experts_per_tok, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(hf)
    assert mm.param_count(shape) == sum(p.numel() for p in model.parameters())


def test_kv_and_activation_hand_values():
    from cluster.config_sections import ModelShape
    from cluster.planning import memory_model as mm

    s = ModelShape(num_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   vocab_size=100, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
    # 2 (K, V) x 2 layers x 2 heads x 32 x 4 bytes; TP=4 keeps one head per GPU (replicated, not halved).
    assert mm.kv_bytes_per_token(s, dtype="float32", tensor_parallel_size=1) == 1024
    assert mm.kv_bytes_per_token(s, dtype="float32", tensor_parallel_size=4) == 512
    # 1 MiB holds 1024 tokens = 64 blocks; 1 MiB - 1 byte holds 63 whole blocks.
    assert mm.kv_tokens(2**20, s, dtype="float32", tensor_parallel_size=1) == 1024
    assert mm.kv_tokens(2**20 - 1, s, dtype="float32", tensor_parallel_size=1) == 1008
    assert mm.kv_tokens_needed(3, 17) == 3 * 32
    # per layer: attention 3*128 + 3*128 + 4*64 = 1024; MoE 2*128 + 8 + 2*2*128 + 4*2*64 = 1288
    assert mm.layer_activation_elems(s) == 2312
    assert mm.activation_bytes(s, 10, dtype="bfloat16", checkpointing=False) == 10 * 2 * 2312 * 2
    assert mm.activation_bytes(s, 10, dtype="bfloat16", checkpointing=True) == 10 * (2 * 128 + 2312) * 2


def test_zero3_constants_are_deepspeeds_defaults():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from cluster.planning import memory_model as mm

    fields = DeepSpeedZeroConfig.model_fields
    assert fields["max_live_parameters"].default == mm.ZERO3_MAX_LIVE_PARAMETERS
    assert fields["prefetch_bucket_size"].default == mm.ZERO3_PREFETCH_BUCKET_SIZE


def test_kv_refusal_names_the_keys():
    cfg = load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml", ["rollout.gpu_memory_utilization=0.45"])
    with pytest.raises(PlanError, match=r"rollout KV cache too small: .*rollout.gpu_memory_utilization=0.45.*"
                                        r"trainer.prompts_per_step=64 x trainer.group_size=16 / rollout.num_engines=4"):
        plan(cfg)
    cpu = load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml", ["rollout.kv_cache_gb=0.001"])
    with pytest.raises(PlanError, match=r"rollout.kv_cache_gb=0.001"):
        plan(cpu)


def test_without_checkpointing_the_30b_config_does_not_fit():
    """Without optimizer offload (73.9 GiB checkpointed) the 30.1 GiB of unsaved activations do not fit; with it
    (17.1 GiB) they do: 17.13 - 1.38 + 30.05 = 45.8 GiB."""
    r = dry_run("configs/qwen3_30b_a3b_gsm8k.yaml", "learner.gradient_checkpointing=false",
                "learner.offload_optimizer=none")
    assert r.returncode == 2
    assert "activations 30.0" in r.stderr and "turn on learner.gradient_checkpointing" in r.stderr
    offloaded = plan(load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml", ["learner.gradient_checkpointing=false"]))
    assert offloaded["memory"]["learner_per_rank_gib"]["total"] == round(17.13 - 1.38 + 30.05, 2)


def test_host_ram_per_node():
    """Node 0 of the 30B run: 8 ZeRO-3 ranks (6 GiB process each; at load each merges the whole checkpoint and
    stacks the fused experts, 2 x (30.5 B + 29.0 B expert parameters) bytes = 110.81 GiB, before any optimizer
    state exists; later 71.01 GiB of offloaded optimizer state and gradients each, and rank 0's 56.81 GiB export
    copy), 4 reward workers (0.15 GiB each), two 1 GiB sync buckets, the driver (0.7 GiB); the total takes the larger of the load and
    the training-time parts; refused over host_memory_gib."""
    cfg = load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml")
    host = plan(cfg)["memory"]["host_ram_gib"]
    experts = 48 * 3 * 128 * 2048 * 768
    load = round(8 * 2 * (30.5e9 + experts) / GIB, 2)
    assert host["node 0"]["learner_ranks"] == 8 * 6 and host["node 0"]["checkpoint_export_rank0"] == 56.81
    assert host["node 0"]["learner_load_zero3"] == load == 886.49
    assert host["node 0"]["learner_optimizer_offload"] == round(8 * 20 * 30.5e9 / 8 / GIB, 2) == 568.11
    assert host["node 0"]["total"] == round(48 + max(load, 568.11 + 56.81) + 4 * 0.15 + 2.0 + 0.7, 2) == 937.79
    assert host["node 1"]["learner_optimizer_offload"] == 0.0 and host["node 1"]["learner_load_zero3"] == 0.0
    plain = plan(load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml", ["learner.offload_optimizer=none"]))
    assert plain["memory"]["host_ram_gib"]["node 0"]["total"] == round(48 + load + 4 * 0.15 + 2.0 + 0.7, 2)
    # a dense model has no fused experts: b P per rank at load
    dense_cfg = load_config(REPO_ROOT / "configs/qwen3_1p7b_dense_gsm8k.yaml", ["learner.zero_stage=3"])
    dense = plan(dense_cfg)["memory"]
    ranks = dense["host_ram_gib"]["node 0"]["learner_ranks"] / 6
    assert ranks >= 1 and dense["host_ram_gib"]["node 0"]["learner_load_zero3"] == pytest.approx(
        ranks * 2 * dense["num_params_b"] * 1e9 / GIB, abs=0.02)
    # ZeRO-2 would load one full copy per rank: 8 x (6 + 56.81); offloaded, its gradients stay on the GPU and
    # the host holds 12 + 4 bytes a parameter over 8 per rank
    z2 = plan(load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml", ["learner.zero_stage=2"]),
              gpu_memory_gib=141.0)["memory"]["host_ram_gib"]
    assert z2["node 0"]["learner_ranks"] == round(8 * (6 + 2 * 30.5e9 / GIB), 2) == 502.49
    assert z2["node 0"]["learner_optimizer_offload"] == round(8 * 16 * 30.5e9 / 8 / GIB, 2)
    assert z2["node 0"]["learner_load_zero3"] == 0.0
    with pytest.raises(PlanError, match=r"host RAM over budget on node 0: 937.8 GiB needed > cluster.host_memory_gib=900"
                                        r".*every ZeRO-3 rank merges the whole checkpoint at load"
                                        r".*learner.offload_optimizer='cpu' keeps 71.0 GiB per rank on the host"):
        plan(load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml", ["cluster.host_memory_gib=900"]))
    assert plan(load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml",
                            ["cluster.host_memory_gib=938"]))["memory"]["host_ram_gib"]["checked"] is True


def test_gpu_smoke_dry_run_and_refusal_without_cuda():
    """The smoke script prints its plan on the CPU (64 experts, one GPU shared by 1 engine and 1 rank) and
    refuses to run without a CUDA device, saying so."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "cluster.tools.gpu_smoke", "--dry-run"], cwd=REPO_ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = yaml.safe_load(r.stdout)
    assert "model.num_experts=64" in out["overrides"]
    assert out["plan"]["memory"]["fullest_gpu"]["holds"] == ["learner rank 0", "rollout engine 0"]
    assert out["plan"]["memory"]["rollout_kv"]["kv_tokens_needed"] == 256 * 32
    r = subprocess.run([sys.executable, "-m", "cluster.tools.gpu_smoke"], cwd=REPO_ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr


def test_cpu_oversubscription_counts_overlapped_threads_together():
    """The overlapped step adds engine and learner threads; the on-policy step alternates them; GPUs never warn."""
    cfg = load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml")  # 1 engine x 2 threads, 2 ranks x 1 thread
    assert cpu_oversubscription(cfg, 2) is None  # on-policy: max(2, 2) threads
    over = load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml", ["trainer.max_staleness=1"])
    msg = cpu_oversubscription(over, 2)
    assert msg.startswith("4 compute threads at once on 2 CPU cores")
    assert "rollout.threads_per_engine=2" in msg and "learner.world_size=2" in msg and "max_staleness=1" in msg
    assert cpu_oversubscription(over, 4) is None
    lean = load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml", ["trainer.max_staleness=1", "rollout.threads_per_engine=1",
                                                             "learner.world_size=1", "learner.zero_stage=0"])
    assert cpu_oversubscription(lean, 2) is None
    assert cpu_oversubscription(load_config(REPO_ROOT / "configs/qwen3_30b_a3b_gsm8k.yaml"), 1) is None


def test_dry_run_warns_about_oversubscribed_cores():
    r = dry_run("configs/tiny_moe_zero2.yaml", "trainer.max_staleness=1", "rollout.threads_per_engine=64")
    assert r.returncode == 0 and "warning: " in r.stderr and "rollout.threads_per_engine=64" in r.stderr


SMOLLM2_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30,
                  "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
                  "vocab_size": 49152, "tie_word_embeddings": True}


def test_plan_reads_the_shape_of_a_model_folder(tmp_path):
    """A local ``model.path`` gives the plan its architecture from ``config.json``: SmolLM2-135M's numbers (no
    ``head_dim`` key: 576 / 9 = 64) count 134,518,848 parameters, the real model's 134,515,008 plus the Q/K norms
    a Qwen3 layer has and a Llama layer lacks (30 x 2 x 64); a Mixtral-style config's experts use
    ``intermediate_size``; a folder without ``config.json`` gives no shape."""
    from cluster.planning.memory_model import param_count
    from cluster.planning.shapes import folder_shape

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    shape = folder_shape(tmp_path)
    assert (shape.num_layers, shape.head_dim, shape.num_key_value_heads, shape.num_experts) == (30, 64, 3, 0)
    assert shape.tie_word_embeddings and param_count(shape) == 134_515_008 + 30 * 2 * 64
    cfg = load_config(None, [f"model.path={tmp_path}", "rollout.kv_cache_gb=1.0"])
    mem = plan(cfg)["memory"]
    assert mem["num_params_b"] == 0.134519 and mem["learner_per_rank_gib"]["logits"] > 0
    mixtral = {**SMOLLM2_CONFIG, "num_local_experts": 8, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(mixtral))
    moe = folder_shape(tmp_path)
    assert (moe.num_experts, moe.moe_intermediate_size, moe.intermediate_size, moe.num_experts_per_tok) == (8, 1536, 0, 2)
    assert folder_shape(tmp_path / "absent") is None


def test_plan_reports_host_memory_per_process():
    """``host_ram_gib.per_process``: what one learner rank, one engine and one reward worker hold, the parts the
    node totals add up (the two-rank tiny config: 2 ranks, 1 engine, 1 worker on node 0)."""
    host = plan(load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml"))["memory"]["host_ram_gib"]
    per, node = host["per_process"], host["node 0"]
    assert node["learner_ranks"] == pytest.approx(2 * per["learner_rank"], abs=0.011)
    assert node["engines"] == pytest.approx(per["engine"], abs=0.011)
    assert node["reward_workers"] == per["reward_worker"]
