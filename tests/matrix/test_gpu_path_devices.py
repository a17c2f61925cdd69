"""The GPU path's device choices, checked on the CPU (issue 26): every service takes its device from the config,
never from a CPU setting in the environment; the engine runs vLLM's V1 model runner when it captures routing;
the learner is built before the engines when they share GPUs; the smoke's device check refuses a learner that
ran on the CPU."""

from __future__ import annotations

from rollout.config import RolloutConfig


def test_engine_with_routing_capture_runs_v1_even_when_the_environment_asks_for_v2(ray_cluster, tiny_moe, tmp_path):
    """``VLLM_USE_V2_MODEL_RUNNER=1`` in the actor's environment (what vLLM's CUDA build picks by itself where
    Triton is installed) is overridden by the engine when it captures routing: it starts on V1, captures, and
    reports its device and runner (``RolloutEngine.device_report``)."""
    from rollout.engine import RolloutEngine

    cfg = RolloutConfig(max_model_len=128, max_response_tokens=4, return_routed_experts=True, seed=1)
    engine = ray_cluster.remote(RolloutEngine).options(
        num_cpus=1, runtime_env={"env_vars": {"VLLM_USE_V2_MODEL_RUNNER": "1"}}
    ).remote(str(tiny_moe), cfg, cache_dir=str(tmp_path))
    try:
        report = ray_cluster.get(engine.device_report.remote())
        assert report == {"weights": ["cpu"], "runner": "vllm.v1.worker.cpu_model_runner.CPUModelRunner"}
    finally:
        ray_cluster.get(engine.shutdown.remote())
        ray_cluster.kill(engine)
