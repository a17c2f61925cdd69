"""A ``tensor_parallel_size=2`` rollout engine on the CPU (vLLM's ``mp`` executor: two worker processes) loads a
weight sync exactly: its log-probs of a fixed sequence equal a TP=1 engine's before and after the same sync.

Not in ``make test`` (two engine starts, minutes on 2 cores): run with ``make test-matrix``.
"""

from __future__ import annotations

import pytest
import torch

from rollout.config import RolloutConfig

pytestmark = [pytest.mark.slow, pytest.mark.matrix]
TOL = 1e-5
SEQ, START = [1] + [5 + (i * 7) % 50 for i in range(30)], 6


def perturbed_state(folder) -> dict[str, torch.Tensor]:
    """The model folder's weights plus seeded noise (std 0.02), in checkpoint names."""
    from transformers import AutoModelForCausalLM

    from learner.weight_sync import to_checkpoint_format

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return {k: v.clone() for k, v in to_checkpoint_format(model, model.state_dict()).items()}


def test_tp2_engine_loads_a_sync_exactly(ray_cluster, tmp_path):
    from cluster.tiny_model import build_tiny_moe
    from learner.weight_sync import pack_bucket
    from rollout.engine import RolloutEngine

    ray = ray_cluster
    build_tiny_moe(tmp_path / "m", seed=0)
    path = str(tmp_path / "m")
    env = {"env_vars": {"TORCH_COMPILE_DISABLE": "1"}}
    engines = {
        tp: ray.remote(RolloutEngine).options(num_cpus=0, runtime_env=env).remote(
            path, RolloutConfig(max_model_len=64, max_response_tokens=4, tensor_parallel_size=tp, in_process=tp == 1),
            engine_index=0, cache_dir=str(tmp_path / f"cache{tp}"))
        for tp in (1, 2)
    }
    try:
        before = {tp: torch.tensor(ray.get(e.sequence_logprobs.remote(SEQ, START))) for tp, e in engines.items()}
        assert (before[1] - before[2]).abs().max().item() < TOL
        meta, buffers, _ = pack_bucket(perturbed_state(path))
        ref = ray.put(buffers)
        for e in engines.values():
            ray.get(e.start_weight_update.remote())
            ray.get(e.update_weights.remote(meta, ref))
            ray.get(e.finish_weight_update.remote(1))
        after = {tp: torch.tensor(ray.get(e.sequence_logprobs.remote(SEQ, START))) for tp, e in engines.items()}
        assert (after[1] - before[1]).abs().max().item() > 0.1  # the sync changed the weights
        assert (after[1] - after[2]).abs().max().item() < TOL
    finally:
        for e in engines.values():
            ray.kill(e)
