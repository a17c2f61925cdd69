"""LoRA RL for real (learner.lora): a DeepSpeed learner rank on the tiny Qwen3-MoE takes a full-parameter step
(the warm start), switches to a peft adapter, trains it with real optimizer steps and streams the merged
weights into an in-process vLLM engine: the engine's log-probs equal the learner's (fp32, 1e-5) after every
sync, and each sync's bytes are the merged model's. A checkpoint keeps the adapter in peft's format; a second
learner resumed from it continues bit for bit (the same weights digest after the same next step), and
gspo-merge-lora's full model gives the learner's log-probs."""

from __future__ import annotations

import json

import torch

from learner.config import LearnerConfig
from rollout.config import RolloutConfig
from tests.helpers.sync import learner_logprobs, sft_batch

TOL = 1e-5


def start_learner(ray, path: str, cfg: LearnerConfig):
    from learner.service import LearnerRank

    return ray.remote(LearnerRank).options(num_cpus=1).remote(
        path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0, seed=0, temperature=1.0)


def test_lora_sync_is_exact_and_resume_is_bit_exact(ray_cluster, tmp_path):
    from cluster.models.tiny_model import build_tiny_moe
    from learner.lora_merge import main as merge_main
    from rollout.engine import RolloutEngine

    ray = ray_cluster
    path = str(build_tiny_moe(tmp_path / "model", seed=0))
    cfg = LearnerConfig(zero_stage=2, micro_batch_size=4, lr=1e-2, lora={"rank": 4, "alpha": 8, "dropout": 0.1})
    learner = start_learner(ray, path, cfg)
    engine = ray.remote(RolloutEngine).options(num_cpus=1, runtime_env={"env_vars": {"TORCH_COMPILE_DISABLE": "1"}}
                                               ).remote(path, RolloutConfig(max_model_len=64, max_response_tokens=4),
                                                        cache_dir=str(tmp_path / "cache"))
    resumed = None
    try:
        ray.get(learner.sft_step.remote(sft_batch(0), 8 * 11))  # the warm start: every parameter moves
        assert ray.get(learner.enable_lora.remote()) is True
        assert ray.get(learner.enable_lora.remote()) is False  # idempotent
        merged_bytes = sum(t.numel() * t.element_size() for t in ray.get(learner.checkpoint_state_dict.remote()).values())
        seq, start = [1] + [5 + (i * 7) % 50 for i in range(30)], 6
        before = None
        for version in (1, 2):
            ray.get(learner.sft_step.remote(sft_batch(version), 8 * 11))  # trains the adapter alone
            report = ray.get(learner.sync_weights.remote([engine], version, 0.01))
            assert report.bytes == merged_bytes and not report.failed_engines  # the merged model, each byte once
            engine_lp = torch.tensor(ray.get(engine.sequence_logprobs.remote(seq, start)))
            learner_lp = learner_logprobs(ray, learner, seq, start)
            assert (engine_lp - learner_lp).abs().max().item() < TOL, version
            if before is not None:
                assert (learner_lp - before).abs().max().item() > 1e-4  # the adapter's step changed the policy
            before = learner_lp
        ckpt = tmp_path / "ckpt"
        ray.get(learner.save_checkpoint.remote(str(ckpt)))
        assert json.loads((ckpt / "learner_state.json").read_text())["lora"] is True
        assert json.loads((ckpt / "adapter" / "adapter_config.json").read_text())["r"] == 4
        ray.get(learner.sft_step.remote(sft_batch(3), 8 * 11))
        want = ray.get(learner.state_digest.remote())

        ray.kill(engine)  # its CPU for the resumed rank (the fixture's cluster has two)
        resumed = start_learner(ray, path, cfg)  # a fresh rank: full model until the checkpoint says LoRA
        ray.get(resumed.load_checkpoint.remote(str(ckpt)))
        assert ray.get(resumed.lora_enabled.remote())
        ray.get(resumed.sft_step.remote(sft_batch(3), 8 * 11))
        assert ray.get(resumed.state_digest.remote()) == want  # dropout's RNG and Adam's state restored too

        assert merge_main([str(ckpt), str(tmp_path / "merged")]) == 0
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, :-1]
        merged_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0][start - 1 :]
        assert (merged_lp - before).abs().max().item() < TOL  # the checkpoint's policy (before step 3)
    finally:
        for a in (learner, engine, resumed):
            if a is not None:
                ray.kill(a)
