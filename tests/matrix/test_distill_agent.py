"""On-policy distillation of multi-turn, tool-using episodes for real (Ray, the vLLM rollout engine, a vLLM teacher
engine, an env worker, DeepSpeed): two GSPO-token steps of configs/tiny_agent_calc.yaml with the student's own
model as its teacher, through the trainer's own step (``Trainer.rl_step``).

The untrained tiny model never writes a tool call (a character-level tokenizer, random weights; an episode ends
at a turn without one), so the run warm-starts first; the teacher (``distill.model_path=builtin:tiny_moe``, the
student's build: same seed and shape keys) then receives the warm-started weights through the run's own weight
stream (``WeightSync.push`` into the teacher's engines, as into the rollout engines), so teacher and sampler hold
the same weights. With ``trainer.max_staleness=1`` both steps' rollouts are sampled with those weights (step 2's
is collected beside step 1's learner, before its sync), so the per-token reverse KL must be ~0 on both.

- the episodes have several turns with the environment's tokens between them (``response_mask`` 0 inside a
  response, followed by sampled tokens);
- the ids trained on are the ids sampled (``agent/token_mismatch`` 0);
- ``distill/reverse_kl`` ~0 (and per token on every sampled token), while the teacher's log-probs of the
  environment's tokens are clearly not (so the metric would not be ~0 if they were counted);
- no teacher call failed, and the learner trained (finite loss and gradient norm).

Not in ``make test`` (a warm start, a teacher engine and two steps): ``make test-matrix``. Distillation without
episodes: tests/integration/test_distill.py; the masking alone: tests/unit/cluster/test_distill_driver.py.
"""

from __future__ import annotations

import math

import pytest

from tests.helpers import REPO_ROOT

OVERRIDES = [
    "trainer.total_steps=2", "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.eval_every=0",
    "trainer.save_every=0", "trainer.plots=false", "trainer.max_staleness=1", "learner.micro_batch_size=8",
    "warm_start.steps=150", "data.num_train=512", "data.num_eval=8", "wandb.mode=disabled",
    "learner.algorithm=gspo_token", "distill.model_path=builtin:tiny_moe", "distill.build_seed=0",
    "distill.reward_weight=1.0", "distill.num_cpus_per_engine=0.25", "distill.kv_cache_gb=0.05",
    "distill.timeout_s=120",
]


@pytest.mark.timeout(1200)
def test_distilled_episodes_score_only_sampled_tokens_with_zero_kl_from_the_students_own_model(tmp_path):
    import ray
    import torch

    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    cfg = load_config(REPO_ROOT / "configs" / "tiny_agent_calc.yaml",
                      [f"trainer.output_dir={tmp_path}", "trainer.run_name=distill_agent", *OVERRIDES])
    assert cfg.rollout.temperature == 1.0  # the engine's log-probs are then the teacher's kind (temperature 1)
    assert cfg.distill.build_seed == cfg.model.build_seed  # the student's build (the shape keys: the defaults)
    t = Trainer(cfg, verbose=False)
    try:
        t.start()
        t.warm_start()  # the engines get version 1
        t.fleet.settle()  # (sync.load_beside_learner) the rollout engines' loads done before the teacher's
        teacher = t.distiller.teacher
        report = t.weight_sync.push(list(teacher.engines), t.weight_version)  # the teacher: the student's weights
        assert not report.failed_engines, report.failed_engines
        assert ray.get([e.weight_version.remote() for e in teacher.engines]) == [t.weight_version]
        version = t.weight_version

        seen = []  # every rollout the teacher annotated (step 1's, then step 2's collected beside the learner)
        annotate = t.distiller.annotate

        def recording(c):
            annotate(c)
            seen.append(c)

        t.distiller.annotate = recording
        steps = [t.rl_step(), t.rl_step()]
        assert len(seen) == 2

        for m in steps:
            assert m["distill/failed"] == 0.0 and m["distill/teacher_s"] > 0.0 and m["reward/invalid"] == 0.0
            assert m["agent/token_mismatch"] == 0.0  # the ids trained on are the ids sampled
            # Why this can fail: k = log pi_old(y_t) - log pi_teacher(y_t) is ~0 only if the teacher scores, at
            # every sampled position, the same token under the same prefix with the same weights. It is not
            # ~0 if the environment's tokens were counted (their stored behaviour log-prob is 0.0, the
            # teacher's is that of reading "<result>...</result>", so k there is large and positive; see
            # below), if the teacher's log-probs were shifted by a position (the log-prob of another token,
            # e.g. a wrong start of the scored span), if the teacher held other weights than the sampler (the
            # push above failed, or a rollout was sampled with a later version), or if the engine returned
            # post-temperature/processed log-probs at a temperature other than 1.
            assert abs(m["distill/reverse_kl"]) < 1e-3, m["distill/reverse_kl"]
            assert abs(m["distill/reverse_kl_seq"]) < 1e-2, m["distill/reverse_kl_seq"]
            assert m["actor/num_optimizer_steps"] >= 1 and not m["health/skipped"]
            assert math.isfinite(m["loss/policy"]) and math.isfinite(m["actor/grad_norm"]), m
        # step 1 is on-policy: a group whose rewards differ (reward_weight 1) gives a gradient. Step 2's samples
        # are a version old, their sequence ratios (against the engine's log-probs) far past GSPO's 3e-4 clip:
        # its gradient may be 0 (every sample clipped), as GSPO's trust region has it; only finite there.
        if steps[0]["reward/groups_all_equal"] < 1.0:
            assert steps[0]["actor/grad_norm"] > 0.0, steps[0]["actor/grad_norm"]
        assert steps[1]["step"] == 2 and steps[1]["weight_version"] == version + 2

        sampled_gap, env_teacher = [], []
        for c in seen:
            assert c.reward_metrics["agent/turns_mean"] > 1.0 and c.reward_metrics["agent/env_failed"] == 0.0
            assert len(c.teacher_logprobs) == len(c.completions)
            for x, teacher_row in zip(c.completions, c.teacher_logprobs):
                assert teacher_row is not None and len(teacher_row) == len(x.response_token_ids)
                assert len(x.response_mask) == len(x.response_token_ids) == len(x.response_logprobs)
                # sampled with the teacher's weights (step 2's rollout too: collected before step 1's sync)
                assert {v for v, s in zip(x.token_versions, x.response_mask) if s} <= {version}, x.token_versions
                for old, lp, s in zip(x.response_logprobs, teacher_row, x.response_mask):
                    (sampled_gap if s else env_teacher).append(old - lp if s else lp)
        between = [x for c in seen for x in c.completions
                   if 0 in x.response_mask and 1 in x.response_mask[x.response_mask.index(0):]]
        assert between, "no episode had the environment's tokens between two sampled turns"
        assert env_teacher and sampled_gap
        gap = torch.tensor(sampled_gap, dtype=torch.float64)
        assert gap.abs().max().item() < 1e-3, gap.abs().max().item()  # token by token, not only on average
        # the k the environment's tokens would add if counted (behaviour log-prob stored as 0.0 there)
        env_k = -torch.tensor(env_teacher, dtype=torch.float64)
        assert env_k.mean().item() > 0.1, env_k.mean().item()
    finally:
        t.shutdown()
        ray.shutdown()
