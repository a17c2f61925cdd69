"""The GPU path's device choices, checked on the CPU (issue 26): every service takes its device from the config,
never from a CPU setting in the environment; the engine runs vLLM's V1 model runner when it captures routing;
the learner is built before the engines when they share GPUs; the smoke's device check refuses a learner that
ran on the CPU."""

from __future__ import annotations

import pytest

from cluster.config import Config
from cluster.runtime.devices import device_problems, learner_first
from cluster.runtime.services import actor_env
from learner.config import LearnerConfig
from rollout.config import RolloutConfig
from rollout.vllm_setup import runner_environment


def _cfg(learner_gpus: float, engine_gpus: float, **learner) -> Config:
    from cluster.config import load_config
    from tests.helpers import REPO_ROOT

    cfg = load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml")
    lc = cfg.learner.model_copy(update={"num_gpus_per_rank": learner_gpus, **learner})
    rc = cfg.rollout.model_copy(update={"num_gpus_per_engine": engine_gpus})
    return cfg.model_copy(update={"learner": lc, "rollout": rc})


def test_actor_env_keeps_cpu_settings_out_of_gpu_actors(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what `make` exports on a CPU machine, inherited by Ray
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    gpu = actor_env(4, "cuda")
    assert gpu["DS_ACCELERATOR"] == "cuda"
    assert not any(k.startswith("VLLM_CPU_") for k in gpu)
    cpu = actor_env(1, "cpu")
    assert cpu["DS_ACCELERATOR"] == "cpu" and cpu["VLLM_CPU_KVCACHE_SPACE"] == "4"
    job = actor_env(1)  # job-wide: no device setting at all
    assert "DS_ACCELERATOR" not in job and "VLLM_CPU_KVCACHE_SPACE" not in job
    with pytest.raises(ValueError, match="device='gpu'"):
        actor_env(1, "gpu")


def test_learner_env_sets_mkl_strict_reproducibility_on_cpu_ranks_under_deterministic(monkeypatch):
    from cluster.runtime.learner_group import MKL_STRICT_CNR, learner_env

    monkeypatch.delenv("MKL_CBWR", raising=False)
    cpu = _cfg(0, 0)
    assert learner_env(cpu)["MKL_CBWR"] == MKL_STRICT_CNR == "AUTO,STRICT"
    loose = cpu.model_copy(update={"trainer": cpu.trainer.model_copy(update={"deterministic": False})})
    assert "MKL_CBWR" not in learner_env(loose)
    assert "MKL_CBWR" not in learner_env(_cfg(1, 1))  # no MKL GEMM on a GPU rank
    monkeypatch.setenv("MKL_CBWR", "AVX2,STRICT")  # the user's own choice (one code path on every AVX2 CPU) wins
    assert learner_env(cpu)["MKL_CBWR"] == "AVX2,STRICT"


def test_engine_env_of_a_gpu_engine_has_no_cpu_settings(monkeypatch):
    from cluster.runtime.services import engine_env

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    gpu = engine_env(_cfg(1, 1).rollout)
    assert gpu["DS_ACCELERATOR"] == "cuda" and "TORCH_COMPILE_DISABLE" not in gpu
    cpu = engine_env(_cfg(0, 0).rollout)
    assert cpu["DS_ACCELERATOR"] == "cpu" and cpu["TORCH_COMPILE_DISABLE"] == "1"  # tiny_moe runs eager


def test_learner_device_comes_from_the_config_not_the_environment(monkeypatch):
    from learner.rank_setup import learner_device

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert learner_device(LearnerConfig(num_gpus_per_rank=1)) == "cuda"
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert learner_device(LearnerConfig()) == "cpu"


def test_a_gpu_learner_without_a_gpu_refuses_at_once(monkeypatch):
    """Before this check the learner quietly trained on the CPU with gloo while holding a GPU share."""
    import torch

    from learner.service import LearnerRank

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(RuntimeError, match="learner.num_gpus_per_rank > 0 but this learner process sees no CUDA"):
        LearnerRank("unused", LearnerConfig(num_gpus_per_rank=1, zero_stage=3), rank=0, world_size=1,
                    master_addr="127.0.0.1", master_port=1, seed=0, temperature=1.0)


def test_partitioned_build_needs_zero3():
    from learner.service import LearnerRank

    with pytest.raises(ValueError, match="partitioned_build=True needs learner.zero_stage=3"):
        LearnerRank("unused", LearnerConfig(zero_stage=2), rank=0, world_size=1, master_addr="127.0.0.1",
                    master_port=1, seed=0, temperature=1.0, partitioned_build=True)


def test_routing_capture_forces_the_v1_model_runner():
    assert runner_environment(RolloutConfig(return_routed_experts=True)) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert runner_environment(RolloutConfig()) == {}  # vLLM keeps its own choice


def test_the_learner_is_built_first_only_when_it_shares_gpus_with_engines():
    assert learner_first(_cfg(1, 1)) and learner_first(_cfg(0.4, 0.5))
    assert not learner_first(_cfg(0, 0)) and not learner_first(_cfg(1, 0))


def _report(params="cuda", master="cuda", opt="cuda", backend="nccl", engine="cuda"):
    return {"learner": [{"params": [params], "master": [master], "optimizer_state": [opt] if opt else [],
                         "backend": backend}],
            "engines": [{"weights": [engine], "runner": "vllm.v1.worker.gpu_model_runner.GPUModelRunner"}]}


def test_device_check_fails_a_gpu_run_whose_learner_ran_on_the_cpu():
    gpu = _cfg(1, 1)
    assert device_problems(_report(), gpu) == []
    cpu_learner = device_problems(_report(params="cpu", master="cpu", opt="cpu", backend="gloo"), gpu)
    assert any("params on ['cpu'], expected cuda" in p for p in cpu_learner)
    assert any("process group 'gloo', expected 'nccl'" in p for p in cpu_learner)
    assert any("engine 0: weights on ['cpu']" in p for p in device_problems(_report(engine="cpu"), gpu))
    assert any("no optimizer state" in p for p in device_problems(_report(opt=None), gpu))
    # an offloaded optimizer keeps its master weights and moments in host RAM: that is expected there
    offload = _cfg(1, 1, offload_optimizer="cpu", zero_stage=3)
    assert device_problems(_report(master="cpu", opt="cpu"), offload) == []
    assert device_problems(_report(), offload) != []
    with pytest.raises(ValueError, match="without learner ranks or engines"):
        device_problems({"learner": [], "engines": []}, gpu)


def test_gpu_configs_that_offload_give_cpu_adam_the_ranks_cores():
    """DeepSpeed's CPU Adam runs on the rank's OpenMP threads (``learner.threads_per_rank``): a GPU config that
    offloads the optimizer steps on more than one thread and on no more than the CPUs the rank reserves."""
    from cluster.config import load_config
    from tests.helpers import REPO_ROOT

    offloading = []
    for path in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        lc = load_config(path).learner
        if lc.num_gpus_per_rank > 0 and lc.offload_optimizer == "cpu":
            offloading.append(path.name)
            assert 1 < lc.threads_per_rank <= lc.num_cpus_per_rank, (path.name, lc.threads_per_rank)
    assert "qwen3_30b_a3b_gsm8k.yaml" in offloading


def test_a_gpu_job_is_submitted_without_the_cpu_settings(monkeypatch):
    from cluster.submit.job import job_runtime_env

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gpu = job_runtime_env(on_gpu=True)["env_vars"]
    assert "DS_ACCELERATOR" not in gpu and "VLLM_CPU_KVCACHE_SPACE" not in gpu and gpu["HF_HUB_OFFLINE"] == "1"
    cpu = job_runtime_env()["env_vars"]
    assert cpu["DS_ACCELERATOR"] == "cpu" and cpu["VLLM_CPU_KVCACHE_SPACE"] == "4"
