"""PPO with a critic on two real DeepSpeed ranks (Ray actors, CPU, gloo): both models train, the critic's value
loss falls, the critic's advantages (not the batch's group advantages) drive the policy, and a checkpoint
restores the critic exactly (weights, optimizer state, counters, next step)."""

from __future__ import annotations

import torch

from learner.config import LearnerConfig
from learner.contracts import RolloutTrainResult
from learner.objectives import loss_normalisers
from tests.helpers.learner import TEMPERATURE, make_batch, port  # noqa: F401 - port: pytest fixture

N_ROWS, STEPS = 16, 5


def _rank_shards(batch):
    """Two minibatches of 8 rows; rank r gets rows r, r+2, ... of each. Returns (shards per rank, normalisers)."""
    mbs = [batch.select(list(range(0, 8))), batch.select(list(range(8, 16)))]
    shards = [[mb.select(list(range(r, len(mb), 2))) for mb in mbs] for r in range(2)]
    norms = [loss_normalisers(mb.response_mask) for mb in mbs]
    return shards, [s for s, _ in norms], [t for _, t in norms]


def test_ppo_trains_policy_and_critic_and_resumes_the_critic_exactly(ray_cluster, model_path, port, tmp_path):  # noqa: F811
    ray = ray_cluster
    from learner.service import LearnerRank

    cfg = LearnerConfig(algorithm="ppo", world_size=2, zero_stage=2, micro_batch_size=3, lr=1e-3,
                        critic={"lr": 3e-3})
    batch = make_batch(model_path, N_ROWS, seed=3)
    # a reward the critic can read from the prompt: its second token's parity; one invalid sample (NaN)
    batch.rewards = (batch.input_ids[:, 1] % 2).float()
    batch.rewards[5] = float("nan")
    # group advantages PPO must ignore: were they used, |loss/policy| would be of order 1e6
    batch.advantages = torch.full((N_ROWS,), 1e6)
    shards, n_seq, n_tok = _rank_shards(batch)
    cls = ray.remote(LearnerRank).options(num_cpus=1)
    ranks = [cls.remote(model_path, cfg, rank=r, world_size=2, master_addr="127.0.0.1", master_port=port, seed=0,
                        temperature=TEMPERATURE) for r in range(2)]

    def step() -> RolloutTrainResult:
        outs = ray.get([a.train_rollout_batch.remote(s, n_seq, n_tok) for a, s in zip(ranks, shards)])
        assert outs[0].metrics["critic/value_loss"] == outs[1].metrics["critic/value_loss"]  # all-reduced: one value
        return outs[0]

    def digests() -> list:
        return ray.get([a.critic_digest.remote() for a in ranks])

    try:
        policy0 = ray.get([a.state_digest.remote() for a in ranks])
        first = step()
        assert 0.0 < abs(first.loss) < 10.0  # the critic's whitened advantages drove the policy
        critic1 = digests()
        outs = [first] + [step() for _ in range(STEPS - 1)]
        losses = [o.metrics["critic/value_loss_first"] for o in outs]
        # values start at 0 (zero head) with returns in {0, 1}: the loss at the first update is 0.5 E[R^2]
        assert 0.1 < losses[0] < 0.5
        assert losses[-1] < 0.5 * losses[0], losses
        assert all(o.optimizer_steps == 2 and o.metrics["critic/num_optimizer_steps"] == 2.0 for o in outs)
        assert ray.get([a.state_digest.remote() for a in ranks]) != policy0  # the policy trained
        assert digests()[0]["weights"] != critic1[0]["weights"]  # and the critic
        assert len({d["weights"] for d in digests()}) == 1  # one critic on both ranks

        ckpt = str(tmp_path / "ckpt")
        ray.get([a.save_checkpoint.remote(ckpt) for a in ranks])
        saved = digests()
        after_save = step()
        assert digests()[0]["weights"] != saved[0]["weights"]
        ray.get([a.load_checkpoint.remote(ckpt) for a in ranks])
        assert digests() == saved  # weights, optimizer state and counters of every rank
        again = step()
        for key in ("critic/value_loss", "critic/values_mean", "loss/policy", "actor/grad_norm"):
            assert again.metrics[key] == after_save.metrics[key], key
    finally:
        ray.get([a.shutdown.remote() for a in ranks])
        for a in ranks:
            ray.kill(a)
