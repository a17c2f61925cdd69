"""LoRA's wide cases (``make test-matrix``): two learner ranks under each ZeRO stage (ZeRO-3 with every parameter
partitioned, so the merge runs on gathered buckets) and a dense Llama with its MLP adapted too, each switched to
LoRA after a full step, trained and synced twice; the engine's log-probs equal the learner's (fp32, 1e-5).

Not in ``make test`` (the tiny MoE at ZeRO-2 on one rank is there: tests/integration/test_lora.py)."""

from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from learner.contracts import TrainBatch
from rollout.config import RolloutConfig
from tests.helpers.sync import sft_batch

TOL = 1e-5
MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("arch,zero_stage,targets", [("qwen3_moe", 3, None), ("qwen3_moe", 0, None),
                                                     ("llama", 2, MLP)])
def test_lora_sync_exact_across_ranks_and_stages(ray_cluster, tmp_path, arch, zero_stage, targets):
    from cluster.common import free_port
    from cluster.models.tiny_archs import build_tiny_arch
    from learner.service import LearnerRank
    from rollout.engine import RolloutEngine

    ray = ray_cluster
    path = str(build_tiny_arch(tmp_path / arch, arch))
    lora = {"rank": 4, "alpha": 8} | ({"target_modules": targets} if targets else {})
    cfg = LearnerConfig(world_size=2, zero_stage=zero_stage, micro_batch_size=4, lr=1e-2, lora=lora,
                        zero3_param_persistence_threshold=0)
    port = free_port()
    ranks = [ray.remote(LearnerRank).options(num_cpus=0.5).remote(
        path, cfg, rank=r, world_size=2, master_addr="127.0.0.1", master_port=port, seed=0, temperature=1.0)
        for r in range(2)]
    engine = ray.remote(RolloutEngine).options(num_cpus=0.5, runtime_env={"env_vars": {"TORCH_COMPILE_DISABLE": "1"}}
                                               ).remote(path, RolloutConfig(max_model_len=64, max_response_tokens=4),
                                                        cache_dir=str(tmp_path / "cache"))
    try:
        def both(method, *args):
            return ray.get([getattr(r, method).remote(*args) for r in ranks])

        both("sft_step", sft_batch(0, n=4), 8 * 11)  # each rank half of the 8 rows: 8 x 11 loss tokens in all
        assert both("enable_lora") == [True, True]
        seq, start = [1] + [5 + (i * 7) % 50 for i in range(30)], 6
        for version in (1, 2):
            both("sft_step", sft_batch(version, n=4), 4 * 11 * 2)
            report = ray.get([ranks[0].sync_weights.remote([engine], version, 0.01),
                              ranks[1].sync_weights.remote([engine], version, 0.01)])[0]
            assert not report.failed_engines
            engine_lp = torch.tensor(ray.get(engine.sequence_logprobs.remote(seq, start)))
            # compute_log_probs is collective under ZeRO-3: both ranks run it
            ids = torch.tensor([seq])
            resp = torch.zeros((1, len(seq) - 1), dtype=torch.bool)
            resp[0, start - 1 :] = True
            batch = TrainBatch(ids, torch.ones_like(ids), resp, torch.zeros(resp.shape), torch.zeros(1),
                               torch.zeros(1), ["s"], torch.zeros(1, dtype=torch.long))
            lps = ray.get([r.compute_log_probs.remote(batch) for r in ranks])
            want = lps[0][0][resp[0]]
            assert (engine_lp - want).abs().max().item() < TOL, (arch, zero_stage, version)
    finally:
        for a in (*ranks, engine):
            ray.kill(a)
