"""PPO's value model on a learner rank: a second DeepSpeed engine beside the policy, and its part of the step.

Where it runs. Each learner rank holds the critic as a second DeepSpeed engine with its own AdamW, in the same
process group as the policy, trained on the same minibatch shards (the rank already has every sequence and
reward of its shard; no new actor, no new placement, no data movement). verl and OpenRLHF run the critic as its
own worker group, which lets it scale apart from the policy; here one process per rank is the simplest correct
choice, and the plan counts the critic's memory on every rank (``cluster/planning/plan.py``).

The model: the backbone (``AutoModel``, no LM head) of the policy's architecture, or of
``learner.critic.model_path``, with a scalar head ``Linear(hidden, 1)`` initialised to zero (values start at 0).
Without a ``model_path`` the critic starts from the policy's weights as they are at its first use (the first RL
step, after the warm start), as verl and OpenRLHF start the critic from the SFT model. ``V(t)`` is read from the
hidden state at position ``t``, the state in which the action ``input_ids[:, t + 1]`` is taken.

In a rollout batch (``learner.step.RolloutBatchStep`` calls these):

1. ``prepare``: the critic's values for every micro-batch (no gradient) -> GAE on the verifier's terminal reward
   (``learner.gae``) -> advantages whitened over every rank's tokens -> ``[b, T]`` advantages for the policy loss;
2. the policy trains as ``grpo`` does, on those token advantages (skipped in the first
   ``learner.critic.warmup_steps`` RL steps);
3. ``train``: when the policy's update was kept (not refused by the health guard), ``ppo_epochs`` passes of the
   clipped value loss over the same minibatches, one critic optimizer step per minibatch.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from learner import state
from learner.gae import gae, terminal_rewards, value_loss, whiten, whiten_stats, whiten_sums
from learner.microbatch import MicroBatch

if TYPE_CHECKING:
    from learner.step import RolloutBatchStep

log = logging.getLogger(__name__)

CRITIC_SUBDIR = "critic"  # the critic's DeepSpeed checkpoint inside a learner checkpoint folder
DS_TAG = "deepspeed"


class ValueModel(torch.nn.Module):
    """A transformer backbone with a scalar head: ``forward(input_ids, attention_mask)`` -> float32 ``[B, L]``
    values, ``V`` at every input position."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` float32 values from the last hidden states."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def build_value_model(policy: torch.nn.Module, policy_params, model_path: str | None, dtype: torch.dtype) -> ValueModel:
    """The critic's module: the policy's backbone (architecture from ``policy.config``, weights from
    ``policy_params``, ``(name, full CPU tensor)`` pairs with the policy's names) or ``model_path``'s.

    Raises:
        ValueError: ``model_path``'s vocabulary size differs from the policy's (another tokenizer).
    """
    from transformers import AutoModel

    if model_path is not None:
        backbone = AutoModel.from_pretrained(model_path, dtype=dtype)
        if backbone.config.vocab_size != policy.config.vocab_size:
            raise ValueError(f"learner.critic.model_path={model_path!r} has vocab_size={backbone.config.vocab_size}, "
                             f"the policy {policy.config.vocab_size}: the critic must read the policy's tokens")
    else:
        with torch.random.fork_rng(devices=[]):  # the throwaway initialisation leaves the rank's RNG as it was
            backbone = AutoModel.from_config(policy.config)
        prefix = policy.base_model_prefix + "."
        weights = {n[len(prefix):]: t for n, t in policy_params if n.startswith(prefix)}
        missing, unexpected = backbone.load_state_dict(weights, strict=False)
        if unexpected or [n for n in missing if n in dict(backbone.named_parameters())]:
            raise ValueError(f"the policy's backbone does not fit its own architecture: missing {missing}, "
                             f"unexpected {unexpected}")
    backbone.config.use_cache = False
    return ValueModel(backbone, backbone.config.hidden_size).to(dtype)


class Critic:
    """This rank's value model under DeepSpeed, built at its first use (``ensure_built``), and its step.

    Args:
        cfg: the ``learner`` section (``cfg.critic`` holds the critic's keys; ZeRO stage, dtype, clip as the
            policy's).
        world_size: data-parallel ranks; device: this rank's torch device.
    """

    def __init__(self, cfg, world_size: int, device: torch.device):
        self.cfg, self.ccfg = cfg, cfg.critic
        self.world_size, self.device = world_size, device
        self.engine = None
        self.updates = 0  # RL steps whose critic update ran
        self.optimizer_steps = 0
        self.lr = float(self.ccfg.lr if self.ccfg.lr is not None else cfg.lr)
        # per minibatch, per micro-batch of this rank: (old values, returns, mask) of the current rollout batch
        self.targets: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        self.value_tokens: list[float] = []  # per minibatch: masked tokens over all ranks (value-loss normaliser)
        self._dummy = torch.zeros((1, 2), dtype=torch.long, device=device)

    # -- building -----------------------------------------------------------------------------------------
    def ensure_built(self, policy_engine, zero3: bool) -> None:
        """Build the value model and its DeepSpeed engine if not yet built. Collective (every rank gathers the
        policy's weights under ZeRO-3 and ``deepspeed.initialize`` runs on all)."""
        if self.engine is not None:
            return
        import deepspeed

        from learner.ds_config import build_ds_config

        dtype = torch.bfloat16 if self.cfg.dtype == "bfloat16" else torch.float32
        params = [] if self.ccfg.model_path else state.full_params(policy_engine, zero3, keep=True)
        model = build_value_model(policy_engine.module, params, self.ccfg.model_path, dtype)
        if self.cfg.offload_optimizer == "cpu":  # ZeRO-Offload needs DeepSpeed's CPU Adam (as the policy's)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(model.parameters(), lr=self.lr, betas=tuple(self.cfg.adam_betas),
                                         weight_decay=self.cfg.weight_decay, adamw_mode=True)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, betas=tuple(self.cfg.adam_betas),
                                          weight_decay=self.cfg.weight_decay)
        ds_config = build_ds_config(self.cfg, self.world_size, on_gpu=self.device.type == "cuda")
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                                    dist_init_required=False)
        self.engine.eval()  # no dropout: old and new values come from one function

    def policy_trains(self) -> bool:
        """False during the first ``learner.critic.warmup_steps`` RL steps (critic only, verl's critic_warmup)."""
        return self.updates >= self.ccfg.warmup_steps

    # -- forwards -----------------------------------------------------------------------------------------
    def values(self, mb: MicroBatch) -> torch.Tensor:
        """``[b, w-1]`` float32 ``V(t)`` for the targets of ``mb`` (the state before each target token)."""
        return self.engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask)[:, :-1]

    def _dummy_pass(self, with_grad: bool) -> None:
        """Keep this rank in step with ranks that have more micro-batches (zero gradient)."""
        if with_grad:
            v = self.engine(input_ids=self._dummy, attention_mask=torch.ones_like(self._dummy))
            self.engine.backward(v.sum() * 0.0, scale_wrt_gas=False)
        else:
            with torch.no_grad():
                self.engine(input_ids=self._dummy, attention_mask=torch.ones_like(self._dummy))

    # -- 1. values, GAE, whitening ------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, step: "RolloutBatchStep") -> tuple[list[list[torch.Tensor]], dict[str, float]]:
        """Old values, GAE advantages and returns of every micro-batch of ``step.minibatches`` (cut as the
        policy's training passes cut them). Collective.

        Rows with a NaN reward (invalid samples) are left out: advantage 0, no value target.

        Returns:
            ``(advantages, metrics)``: ``advantages[m][k]`` float32 ``[b, w-1]`` for micro-batch ``k`` of
            minibatch ``m`` (whitened when ``learner.critic.whiten_advantages``), and ``critic/values_mean``,
            ``critic/returns_mean``, ``critic/advantages_raw_mean``, ``critic/advantages_raw_std`` over every
            rank's response tokens.
        """
        r, c = step.r, self.ccfg
        self.targets, raw, local_tokens = [], [], []
        sums = [0.0] * 5  # advantages (sum, sq, count), values sum, returns sum
        for batch in step.minibatches:
            slices = r.slices(batch)
            (n_passes,) = r.aligned_counts([len(slices)])
            self.targets.append([])
            raw.append([])
            tokens = 0.0
            for k in range(n_passes):
                if k >= len(slices):
                    self._dummy_pass(with_grad=False)
                    continue
                lo, hi = slices[k]
                mb = MicroBatch(batch, lo, hi, r.device, "response_mask")
                rewards = batch.rewards[lo:hi].to(r.device)
                mask = mb.mask & torch.isfinite(rewards)[:, None]
                values = torch.where(mask, self.values(mb), 0.0)
                adv, ret = gae(terminal_rewards(torch.nan_to_num(rewards, nan=0.0), mask), values, mask, c.gamma, c.lam)
                self.targets[-1].append((values, ret, mask))
                raw[-1].append((adv, mask))
                s = whiten_sums(adv, mask)
                sums = [a + b for a, b in zip(sums, s + [float(values[mask].sum()), float(ret[mask].sum())])]
                tokens += s[2]
            local_tokens.append(tokens)
        self.value_tokens = r.all_reduce(local_tokens) if local_tokens else []
        tot = r.all_reduce(sums)
        mean, var = whiten_stats(*tot[:3])
        n = max(tot[2], 1.0)
        out = [[whiten(a, m, mean, var) if c.whiten_advantages else a for a, m in row] for row in raw]
        metrics = {"critic/values_mean": tot[3] / n, "critic/returns_mean": tot[4] / n,
                   "critic/advantages_raw_mean": mean, "critic/advantages_raw_std": math.sqrt(var)}
        return out, metrics

    # -- 3. the value update ------------------------------------------------------------------------------
    def train(self, step: "RolloutBatchStep") -> dict[str, float]:
        """``ppo_epochs`` passes of the clipped value loss over the minibatches prepared by ``prepare``, one
        critic optimizer step each. Collective. Returns ``critic/value_loss`` (mean over its optimizer steps of
        the minibatch loss, all ranks), ``critic/value_loss_first`` and ``_last`` (first and last optimizer
        step's), ``critic/clip_fraction``, ``critic/grad_norm``, ``critic/lr``, ``critic/num_optimizer_steps``."""
        r, losses, norms, counts = step.r, [], [], [0.0, 0.0]
        for _epoch in range(self.cfg.ppo_epochs):
            for m, batch in enumerate(step.minibatches):
                loss, clipped, tokens, norm = self._train_minibatch(r, m, batch)
                losses.append(loss)
                norms.append(norm)
                counts = [counts[0] + clipped, counts[1] + tokens]
        self.updates += 1
        tot = r.all_reduce(losses + counts)
        losses, counts = tot[: len(losses)], tot[len(losses):]
        return {"critic/value_loss": sum(losses) / max(len(losses), 1),
                "critic/value_loss_first": losses[0] if losses else 0.0,
                "critic/value_loss_last": losses[-1] if losses else 0.0,
                "critic/clip_fraction": counts[0] / counts[1] if counts[1] else 0.0,
                "critic/grad_norm": sum(norms) / max(len(norms), 1), "critic/lr": self.current_lr(),
                "critic/num_optimizer_steps": float(len(norms))}

    def _train_minibatch(self, r, m: int, batch) -> tuple[float, float, float, float]:
        """One critic optimizer step on minibatch ``m``: (this rank's loss part, clipped tokens, tokens, grad
        norm)."""
        slices = r.slices(batch)
        (n_passes,) = r.aligned_counts([len(slices)])
        loss_sum, clipped, tokens = 0.0, 0.0, 0.0
        for k in range(n_passes):
            self.engine.set_gradient_accumulation_boundary(k == n_passes - 1)
            if k >= len(slices):
                self._dummy_pass(with_grad=True)
                continue
            mb = MicroBatch(batch, *slices[k], r.device, "response_mask")
            old, ret, mask = self.targets[m][k]
            loss, met = value_loss(self.values(mb), old, ret, mask, self.ccfg.cliprange_value,
                                   num_tokens=self.value_tokens[m])
            # DeepSpeed averages gradients over the ranks: x world_size makes it the sum (learner/service.py)
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            loss_sum += float(loss.detach())
            clipped, tokens = clipped + met["num_clipped"], tokens + met["num_tokens"]
        self._set_lr(self.current_lr(self.optimizer_steps + 1))
        self.engine.step()
        self.optimizer_steps += 1
        norm = self.engine.get_global_grad_norm()
        return loss_sum, clipped, tokens, float(norm) if norm is not None else float("nan")

    def current_lr(self, step: int | None = None) -> float:
        """The critic lr at its optimizer step ``step`` (from 1; None: the last one taken): linear warm-up over
        ``learner.critic.lr_warmup_steps``, then ``lr``."""
        s = self.optimizer_steps if step is None else step
        w = self.ccfg.lr_warmup_steps
        return self.lr * (min(1.0, max(s, 1) / w) if w else 1.0)

    def _set_lr(self, lr: float) -> None:
        for group in state.base_optimizer(self.engine).param_groups:
            group["lr"] = lr
        for group in getattr(self.engine.optimizer, "param_groups", []):
            group["lr"] = lr

    # -- checkpoints --------------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """The critic's DeepSpeed checkpoint (weights, optimizer partitions, counters) into
        ``path/critic``. Collective; the driver renames the whole checkpoint folder when every part is written."""
        self.engine.save_checkpoint(str(Path(path) / CRITIC_SUBDIR), tag=DS_TAG, save_latest=False,
                                    client_state={"updates": self.updates, "optimizer_steps": self.optimizer_steps})

    def load(self, path: str) -> bool:
        """Restore what ``save`` wrote; False (and a warning) when ``path`` holds no critic (a checkpoint of
        another algorithm: the critic then starts fresh). Collective."""
        folder = Path(path) / CRITIC_SUBDIR
        if not (folder / DS_TAG).is_dir():
            log.warning("no critic in %s: the critic starts from its initial weights", path)
            return False
        load_path, client = self.engine.load_checkpoint(str(folder), tag=DS_TAG, load_optimizer_states=True,
                                                        load_lr_scheduler_states=True)
        if load_path is None:
            raise FileNotFoundError(f"DeepSpeed found no critic checkpoint in {str(folder)!r}")
        self.updates = int((client or {}).get("updates", 0))
        self.optimizer_steps = int((client or {}).get("optimizer_steps", 0))
        return True

    def digest(self, zero3: bool) -> dict[str, Any]:
        """SHA-256 of the critic's full weights (collective under ZeRO-3) and of this rank's optimizer state,
        with its counters: equal digests mean a bit-identical critic."""
        return {"weights": state.weights_digest(state.full_params(self.engine, zero3, keep=True)),
                "optimizer": state.optimizer_state_digest(self.engine), "updates": self.updates,
                "optimizer_steps": self.optimizer_steps}
