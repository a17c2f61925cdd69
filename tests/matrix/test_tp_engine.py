"""A ``tensor_parallel_size=2`` rollout engine on the CPU (vLLM's ``mp`` executor: two worker processes) loads a
weight sync exactly: its log-probs of a fixed sequence equal a TP=1 engine's before and after the same sync.

Not in ``make test`` (two engine starts, minutes on 2 cores): run with ``make test-matrix``.
"""

from __future__ import annotations

import torch

from rollout.config import RolloutConfig

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
    from cluster.models.tiny_model import build_tiny_moe
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


def test_tp2_engine_loads_a_collective_sync_exactly(ray_cluster, tmp_path):
    """``sync.transport=collective`` with a TP=2 engine: both of its workers join the transfer group (ranks 2
    and 3 after a TP=1 engine's rank 1; this process sends as rank 0 over gloo); every worker receives the
    whole bucket and loads its shard; log-probs equal the TP=1 engine's after the sync."""
    from cluster.models.tiny_model import build_tiny_moe
    from learner.weight_sync import TransferGroup, _Fanout, pack_flat
    from rollout.engine import RolloutEngine

    ray = ray_cluster
    build_tiny_moe(tmp_path / "m", seed=0)
    path = str(tmp_path / "m")
    env = {"env_vars": {"TORCH_COMPILE_DISABLE": "1"}}
    engines = [ray.remote(RolloutEngine).options(num_cpus=0, runtime_env=env).remote(
        path, RolloutConfig(max_model_len=64, max_response_tokens=4, tensor_parallel_size=tp, in_process=tp == 1),
        engine_index=0, cache_dir=str(tmp_path / f"cache{tp}")) for tp in (1, 2)]
    group = None
    try:
        before = [torch.tensor(ray.get(e.sequence_logprobs.remote(SEQ, START))) for e in engines]
        fan = _Fanout(engines, timeout_s=120)
        fan.wait(fan.call("start_weight_update"))
        group = TransferGroup(fan, ("tp1", "tp2"), torch.device("cpu"), timeout_s=60)
        state = perturbed_state(path)
        names = list(state)
        for index, lo in enumerate(range(0, len(names), 7)):
            meta, flat = pack_flat({n: state[n] for n in names[lo : lo + 7]}, index)
            calls = fan.call("update_weights", meta, None)
            group.broadcast(flat)
            assert len(fan.wait(calls)[0]) == 2, fan.failed
        assert len(fan.wait(fan.call("finish_weight_update", 1))[0]) == 2, fan.failed
        after = [torch.tensor(ray.get(e.sequence_logprobs.remote(SEQ, START))) for e in engines]
        assert (after[0] - before[0]).abs().max().item() > 0.1  # the sync changed the weights
        assert (after[0] - after[1]).abs().max().item() < TOL
    finally:
        if group is not None:
            group.close()
        for e in engines:
            ray.kill(e)
