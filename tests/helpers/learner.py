"""The learner service: real DeepSpeed (CPU accelerator, gloo) on the embedded tiny Qwen3-MoE.

Fast tests run one rank in this process (world_size=1). Slow tests start 2 ranks as Ray actors and prove that
micro-batched, data-parallel training gives exactly the gradient and update of one full-batch step computed
with plain torch and ``policy_loss`` (GSPO and GRPO, ZeRO stages 1, 2 and 3).
"""

from __future__ import annotations

import pytest
import torch

from cluster.common import free_port
from learner.config import LearnerConfig
from learner.contracts import RolloutTrainResult, SFTBatch, TrainBatch
from learner.logprobs import token_log_probs
from learner.objectives import loss_normalisers, policy_loss, resolve_objective

TEMPERATURE = 0.7


GRAD_RTOL = 1e-5


def _free_port() -> int:
    return free_port("0.0.0.0")  # torch's TCPStore listens on every address


def _ref_model(path: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.config.use_cache = False
    return m.eval()


def _ref_log_probs(model, batch: TrainBatch | SFTBatch, temperature: float = TEMPERATURE) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1]
    return token_log_probs(logits, batch.input_ids[:, 1:], temperature)


def make_batch(model_path: str, n: int, seed: int, noise: float = 1e-3, length: int = 14, empty_row: bool = False) -> TrainBatch:
    """n right-padded sequences of different lengths; rollout log-probs = the model's own + noise (so some
    GSPO sequences are clipped and some not); random advantages."""
    g = torch.Generator().manual_seed(seed)
    vocab = 100
    input_ids = torch.zeros((n, length), dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    response_mask = torch.zeros((n, length - 1), dtype=torch.bool)
    for i in range(n):
        p = int(torch.randint(2, 5, (1,), generator=g))
        r = int(torch.randint(1, length - p + 1, (1,), generator=g))
        if empty_row and i == n - 1:
            r = 0
        seq = torch.randint(4, vocab, (p + r,), generator=g)
        input_ids[i, : p + r] = seq
        attention_mask[i, : p + r] = 1
        response_mask[i, p - 1 : p - 1 + r] = True
    with torch.no_grad():
        lp = _ref_log_probs(_ref_model(model_path), TrainBatch(input_ids, attention_mask, response_mask, None, None, None, [], None))
    old = torch.where(response_mask, lp + noise * torch.randn(lp.shape, generator=g), 0.0).float()
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        old_log_probs=old,
        advantages=torch.randn(n, generator=g),
        rewards=torch.zeros(n),
        prompt_uids=[f"p{i}" for i in range(n)],
        weight_versions=torch.zeros(n, dtype=torch.long),
    )


def reference_step(model_path: str, batches: list[TrainBatch], cfg: LearnerConfig, old_source: str = "rollout"):
    """Plain torch, no DeepSpeed: one full-minibatch loss per minibatch, AdamW + global-norm clip.
    Returns (gradients of the first step, parameters after all steps)."""
    model = _ref_model(model_path)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)
    olds = []
    if old_source == "recompute":
        with torch.no_grad():
            olds = [torch.where(b.response_mask, _ref_log_probs(model, b), 0.0) for b in batches]
    first = None
    for m, b in enumerate(batches):
        old = olds[m] if olds else b.old_log_probs
        lp = _ref_log_probs(model, b)
        result = policy_loss(lp, old, b.advantages, b.response_mask,
            resolve_objective(cfg.algorithm, clip_low=cfg.clip_low, clip_high=cfg.clip_high, loss_agg=cfg.loss_agg,
                              options=cfg.loss_options))
        loss, _ = result.loss, result.metrics
        opt.zero_grad()
        loss.backward()
        if first is None:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
    return first, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_grads_close(got: dict, want: dict, rtol: float = GRAD_RTOL) -> None:
    assert set(got) == set(want)
    # Relative to the size of the whole tensor's gradient (entries that are 0 in both compare exactly).
    for name, w in want.items():
        g = got[name]
        assert g is not None, name
        err = float((g - w).abs().max())
        scale = float(w.abs().max())
        assert err <= rtol * scale + 1e-12, f"{name}: max |diff| {err:.3e} vs max |grad| {scale:.3e}"
    total_got = torch.sqrt(sum((g.double() ** 2).sum() for g in got.values()))
    total_want = torch.sqrt(sum((w.double() ** 2).sum() for w in want.values()))
    assert abs(float(total_got / total_want) - 1.0) < rtol


def assert_params_close(got: dict, want: dict, lr: float, ref_grads: dict) -> None:
    """Parameters after one AdamW step. The first Adam update is ``lr * g / (|g| + eps)``: where ``|g|`` is
    near ``eps`` (1e-8) it turns float noise in the gradient into parameter differences of order lr, so the
    tight check (1e-3 lr) covers entries with ``|g| > 1e-6`` and the rest only need to stay within lr."""
    assert set(got) == set(want)
    for name, w in want.items():
        diff = (got[name].float() - w).abs()
        big = ref_grads[name].abs() > 1e-6
        worst = float(torch.where(big, diff, 0.0).max())
        assert worst <= 1e-3 * lr, f"{name}: max |diff| {worst:.3e} where |grad| > 1e-6"
        assert float(diff.max()) <= 2 * lr, name


@pytest.fixture(scope="module")
def port() -> int:
    return _free_port()


def _start_ranks(ray, model_path: str, cfg: LearnerConfig, world_size: int = 2) -> list:
    from learner.service import LearnerRank

    port = _free_port()
    cls = ray.remote(LearnerRank).options(num_cpus=1)
    actors = [cls.remote(model_path, cfg, rank=r, world_size=world_size, master_addr="127.0.0.1", master_port=port,
                         seed=0, temperature=TEMPERATURE) for r in range(world_size)]
    ray.get([a.pid.remote() for a in actors])
    return actors


def _stop(ray, actors) -> None:
    ray.get([a.shutdown.remote() for a in actors])
    for a in actors:
        ray.kill(a)


def _train(ray, actors, shards_per_rank: list[list[TrainBatch]],
           full: list[TrainBatch]) -> list[RolloutTrainResult]:
    norms = [loss_normalisers(b.response_mask) for b in full]
    return ray.get([a.train_rollout_batch.remote(shards, [s for s, _ in norms], [t for _, t in norms])
                    for a, shards in zip(actors, shards_per_rank)])


def two_ranks_match_reference(ray, model_path: str, cfg: LearnerConfig, batch: TrainBatch,
                              shards: list[TrainBatch]) -> tuple[list[RolloutTrainResult], dict, list[dict]]:
    """One minibatch ``batch``, ``shards[r]`` on rank r of 2, against the plain-torch full-batch step: asserts
    identical results on both ranks, each rank's one captured gradient close to the reference gradient,
    identical weights on both ranks, and rank 0's update close to the reference update. Returns ``(result per
    rank, reference gradients, full state dict per rank)`` for further checks."""
    actors = _start_ranks(ray, model_path, cfg)
    try:
        ray.get([a.capture_gradients.remote(True) for a in actors])
        outs = _train(ray, actors, [[s] for s in shards], [batch])
        grads = ray.get([a.captured_gradients.remote() for a in actors])
        ref_grads, ref_params = reference_step(model_path, [batch], cfg)
        assert outs[0] == outs[1]
        for g in grads:
            assert len(g) == 1
            assert_grads_close(g[0], ref_grads)
        digests = ray.get([a.state_digest.remote() for a in actors])
        assert digests[0] == digests[1]
        exported = ray.get([a.full_state_dict.remote() for a in actors])
        assert_params_close(exported[0], ref_params, cfg.lr, ref_grads)
        return outs, ref_grads, exported
    finally:
        _stop(ray, actors)
