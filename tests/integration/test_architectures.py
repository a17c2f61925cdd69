"""Architecture matrix: a real 3-step GSPO run per tiny random architecture (``cluster.models.tiny_archs``): a real
DeepSpeed learner rank, a real vLLM engine, rollouts sampled by the engine, one RL step per rollout batch
(``train_rollout_batch``: pre-update pass, MoE router hooks) and a streamed weight sync after every step.

After every sync the engine's log-probs of fixed sequences must equal the learner's (fp32, 1e-5), the next
rollout's behaviour log-probs must equal the learner's pre-update ones (``actor/train_rollout_logprob_diff``:
the symptom of the tied-embedding drift, 0.43-0.49 from step 2 on before the fix), and the weights must have
changed (learner checkpoint and the engine's log-probs).

Only ``qwen2_moe`` (routed + gated shared experts, qkv bias, un-normalised top-k) runs in the default suite;
the whole matrix runs with ``make test-matrix``, one architecture at a time.
"""

from __future__ import annotations

import pytest
import torch

from learner.config import LearnerConfig
from rollout.config import RolloutConfig
from tests.helpers.sync import learner_logprobs, weight_change

TOL = 1e-5


STEPS = 3


DEFAULT_ARCH = "qwen2_moe"


# arch -> ZeRO stage of its learner (stage 3 with every parameter partitioned exercises the gathered sync)
ZERO_STAGE = {"llama": 3, "qwen3_tied": 2, "qwen3_moe": 3, "qwen3_moe_tied": 2, "mixtral": 3, "mixtral_tied": 2,
              "qwen2_moe": 3, "olmoe": 2}


FIXED = [[1] + [5 + (i * 7) % 50 for i in range(30)], [1] + [40 + (i * 13) % 40 for i in range(20)]]


START = 4


# arch -> learner.routing_replay of its learner: the tied Mixtral (the upcycled SmolLM2's layout) replays the
# pre-update pass's experts (R2) in its training forward, with Mixtral's always-renormalised gates
REPLAY = {"mixtral_tied": "learner"}


def _params(arch: str):
    marks = [] if arch == DEFAULT_ARCH else [pytest.mark.matrix]
    return pytest.param(arch, marks=marks, id=arch)


def _max_diff(ray, learner, engine) -> tuple[float, torch.Tensor]:
    """(max |engine - learner| over the fixed sequences, the engine's log-probs concatenated)."""
    diffs, engine_all = [], []
    for seq in FIXED:
        e = torch.tensor(ray.get(engine.sequence_logprobs.remote(seq, START)))
        diffs.append((e - learner_logprobs(ray, learner, seq, START)).abs().max().item())
        engine_all.append(e)
    return max(diffs), torch.cat(engine_all)


def _rollout_batch(ray, engine, step: int):
    """One rollout batch: 4 prompts x 4 samples from the engine; reward = share of digits in the response
    (varies within a group, so the advantages are not all 0)."""
    from cluster.driver.batching import build_train_batch
    from learner.advantages import group_advantages
    from learner.objectives import loss_normalisers
    from rollout.contracts import PromptRow

    prompts = [PromptRow(f"p{step}-{i}", "", [1] + [10 + (step * 5 + i * 3 + j) % 60 for j in range(6)], "")
               for i in range(4)]
    done = ray.get(engine.generate.remote(prompts, 4, temperature=1.0, max_tokens=8, seed=step))
    rewards = torch.tensor([sum(t in range(20, 30) for t in c.response_token_ids) / max(len(c.response_token_ids), 1)
                            for c in done], dtype=torch.float32)
    batch = build_train_batch(done, rewards, group_advantages(rewards, 4), pad_token_id=0)
    seqs, toks = loss_normalisers(batch.response_mask)
    return batch, seqs, toks


@pytest.mark.parametrize("arch", [_params(a) for a in ZERO_STAGE])
def test_three_step_run_keeps_engine_equal_to_learner(ray_cluster, tmp_path, arch):
    from cluster.models.tiny_archs import build_tiny_arch
    from learner.service import LearnerRank
    from rollout.engine import RolloutEngine

    ray = ray_cluster
    path = str(build_tiny_arch(tmp_path / arch, arch, seed=0))
    cfg = LearnerConfig(zero_stage=ZERO_STAGE[arch], micro_batch_size=8, lr=1e-2, zero3_param_persistence_threshold=0,
                        pre_update_pass="always", routing_replay=REPLAY.get(arch, "off"))
    learner = ray.remote(LearnerRank).options(num_cpus=1).remote(
        path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0, seed=0, temperature=1.0)
    engine = ray.remote(RolloutEngine).options(
        num_cpus=1, runtime_env={"env_vars": {"TORCH_COMPILE_DISABLE": "1"}}).remote(
        path, RolloutConfig(max_model_len=64, max_response_tokens=8), cache_dir=str(tmp_path / "cache"))
    try:
        diff, engine_lp = _max_diff(ray, learner, engine)
        print(f"{arch} load: max|diff|={diff:.3g}")
        assert diff < TOL, (arch, "as loaded", diff)
        weights = ray.get(learner.checkpoint_state_dict.remote())
        for step in range(1, STEPS + 1):
            batch, seqs, toks = _rollout_batch(ray, engine, step)
            out = ray.get(learner.train_rollout_batch.remote([batch], [seqs], [toks]))
            assert out.optimizer_steps == 1
            m = out.metrics
            assert m["actor/train_rollout_logprob_diff"] < TOL, (arch, step, m["actor/train_rollout_logprob_diff"])
            assert ("moe/load_imbalance" in m) == (arch not in ("llama", "qwen3_tied")), sorted(m)
            report = ray.get(learner.sync_weights.remote([engine], step, 0.05, 2))
            assert not report.failed_engines and ray.get(engine.weight_version.remote()) == step
            new_weights = ray.get(learner.checkpoint_state_dict.remote())
            change = weight_change(weights, new_weights)
            diff, new_lp = _max_diff(ray, learner, engine)
            moved = (new_lp - engine_lp).abs().max().item()
            print(f"{arch} step {step}: max|diff|={diff:.3g} train_rollout={m['actor/train_rollout_logprob_diff']:.3g}"
                  f" weight_change={change:.3g} engine_logprob_change={moved:.3g}")
            assert diff < TOL, (arch, step, diff)
            assert change > 1e-4 and moved > 1e-4, (arch, step, change, moved)
            weights, engine_lp = new_weights, new_lp
    finally:
        for a in (learner, engine):
            ray.kill(a)
