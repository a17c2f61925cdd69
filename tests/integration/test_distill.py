"""On-policy distillation for real, on the embedded tiny model (Ray, the vLLM rollout engine, vLLM teacher engines,
DeepSpeed): one step of configs/tiny_moe.yaml through the trainer with a teacher built from another seed, the
student's own model (no warm start) scoring the same way as a teacher.

- The student's own model scores a rollout of the student's initial weights through the teacher's call
  (``RolloutEngine.sequences_logprobs``, here on the student's engine: the same weights by construction): its
  log-prob of every sampled token equals the behaviour log-prob (reverse KL ~0, per token), so the teacher's call
  scores the right positions.
- The other seed's teacher gives a clearly positive reverse KL on the same samples and in the run's step 1, no
  sample fails, and the learner's gradient comes from it: every group's rewards are equal (the random model never
  adds right), so the reward's advantages are all 0 and a nonzero gradient is the teacher's signal.

A teacher that times out and a longer run with the reward beside the teacher: tests/matrix/test_distill_e2e.py.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.distill import distill_config


@pytest.mark.timeout(1200)
def test_own_model_teacher_gives_zero_reverse_kl_and_another_seed_trains_the_student(tmp_path):
    import ray
    import torch

    from cluster.driver.trainer import Trainer

    cfg = distill_config(tmp_path, "trainer.total_steps=1", "warm_start.steps=0", "rollout.kv_cache_gb=0.05")
    t = Trainer(cfg, verbose=False)
    try:
        t.start()
        c = t.collector.collect(0)  # sampled with the student's initial weights (version 0)
        requests = [(x.prompt_token_ids + x.response_token_ids, len(x.prompt_token_ids)) for x in c.completions
                    if x.response_token_ids]  # (an empty response has no token to score)
        got = ray.get(t.fleet.engines[0].sequences_logprobs.remote(requests))  # the student's model as teacher
        t.run()
        step1 = [json.loads(line) for line in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["step"] == 1][0]
        assert step1["distill/failed"] == 0.0 and step1["reward/invalid"] == 0.0 and step1["distill/teacher_s"] > 0
        assert step1["distill/reverse_kl"] > 0.01, step1["distill/reverse_kl"]
        assert step1["reward/groups_all_equal"] == 1.0  # the reward's advantages are all 0 ...
        assert step1["actor/num_optimizer_steps"] == cfg.learner.num_minibatches and not step1["health/skipped"]
        assert step1["actor/grad_norm"] > 1e-3, step1["actor/grad_norm"]  # ... so this gradient is the teacher's
        # the shipped config in float32: step 1 checks the engine/learner gap (old_logprob_source=auto) and stays
        # on the engine's log-probs (measured ~3e-7 nats per token against the 1e-4 bound)
        assert step1["actor/old_logprob_recomputed"] == 0.0 and step1["actor/old_logprob_gap"] < 1e-4, step1

        t.distiller.annotate(c)  # the run's teacher (another seed) on the same samples
        old = torch.tensor([lp for x in c.completions for lp in x.response_logprobs])
        mine = torch.tensor([lp for row in got for lp in row])
        theirs = torch.tensor([lp for row in c.teacher_logprobs for lp in row])
        assert old.numel() == mine.numel() == theirs.numel() > 0
        assert (old - mine).abs().max().item() < 1e-3  # the same weights: the engine's log-probs, token by token
        # two random inits are both near uniform (log-probs ~ -4.6 over 100 tokens): a small KL, far above the noise
        assert (old - theirs).mean().item() > 0.01
        assert (old - theirs).mean().item() > 100 * (old - mine).abs().mean().item()
    finally:
        t.shutdown()
        ray.shutdown()
