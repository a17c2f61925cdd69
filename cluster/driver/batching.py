"""Padding and splitting: completions -> ``TrainBatch``, worked examples -> ``SFTBatch``, and the split of a
rollout batch into minibatches and data-parallel shards with their global normalisers."""

from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from learner.advantages import group_advantages, turn_returns, turn_token_advantages
from learner.contracts import SFTBatch, TrainBatch
from rollout.contracts import Completion
from learner.objectives import loss_normalisers

log = logging.getLogger("cluster.train")

#: the loss that trains on per-turn advantages (``learner.loss_registry``'s name for GSPO-token, section 4.3)
PER_TURN_ALGORITHM = "gspo_token"
_summed_logged = False  # sequence-level losses' sum of per-turn rewards is logged once per process


@dataclass
class RolloutAdvantages:
    """What ``rollout_advantages`` gives ``build_train_batch``.

    Attributes:
        returns: float32 ``[N]``: each episode's return, its reward ``R_i`` plus its per-turn rewards
            ``sum_k r_i,k`` (just ``R_i`` without them); NaN = invalid sample. ``TrainBatch.rewards``.
        advantages: float32 ``[N]`` (one per sequence), or, with ``per_turn``, float32 ``[N, R]`` (``R`` the
            longest response): entry ``[i, j]`` is the advantage of response token ``j`` of episode ``i``.
        per_turn: the advantages are per response token (``gspo_token`` with per-turn rewards).
        summed_turn_rewards: per-turn rewards were added into the sequence-level return (another algorithm).
    """

    returns: torch.Tensor
    advantages: torch.Tensor
    per_turn: bool = False
    summed_turn_rewards: bool = False


def rollout_advantages(completions: list[Completion], rewards: torch.Tensor, group_size: int, *, algorithm: str,
                       normalize_std: bool) -> RolloutAdvantages:
    """The group advantages of a rollout batch, per sequence or, for ``gspo_token`` episodes with per-turn rewards,
    per turn.

    - No completion with a nonzero ``Completion.turn_rewards`` (single answers; episodes whose environment gives
      no per-turn reward): ``learner.advantages.group_advantages`` of ``rewards``, float32 ``[N]``, as always.
    - ``algorithm == "gspo_token"`` and some nonzero per-turn reward: ``learner.advantages.turn_token_advantages``
      (turn k of episode i carries ``(G_i,k - mean G_i,1) / (std G_i,1 + eps)`` on all its tokens, ``G_i,k = R_i +
      sum_{j>=k} r_i,j``; our multi-turn extension of GSPO-token), float32 ``[N, R]`` per response token.
    - Any other algorithm (sequence-level: ``gspo``, ``grpo``, ``ppo``, a user loss, ...) and some nonzero
      per-turn reward: the per-turn rewards are summed into the episode's return, ``R_i + sum_k r_i,k``, whose
      group advantage is taken as above (``[N]``); logged once per process.

    Args:
        completions: N completions (groups of ``group_size`` consecutive).
        rewards: float32 ``[N]``, the episodes' rewards (``RewardResult.score``; NaN = invalid sample).
        group_size: completions per prompt (G).
        algorithm: ``learner.algorithm``.
        normalize_std: ``learner.advantage_std()`` (z-score, or mean-only).

    Raises:
        ValueError: a completion's turn data that do not fit it (``Completion.turn_problem``), ``rewards`` not
            ``[N]``, or the errors of ``learner.advantages``.
    """
    global _summed_logged
    n = len(completions)
    if tuple(rewards.shape) != (n,):
        raise ValueError(f"rewards {tuple(rewards.shape)} must be ({n},)")
    for c in completions:
        if problem := c.turn_problem():  # fields set after construction are checked here
            raise ValueError(problem)
    if not any(c.turn_rewards and any(r != 0.0 for r in c.turn_rewards) for c in completions):
        return RolloutAdvantages(rewards, group_advantages(rewards, group_size, normalize_std=normalize_std))
    returns = turn_returns(rewards, _turn_table(completions))[:, 0].to(torch.float32)  # R_i + sum_k r_i,k
    if algorithm == PER_TURN_ALGORITHM:
        adv = turn_token_advantages(rewards, [c.turn_rewards for c in completions],
                                    [c.turn_starts for c in completions],
                                    [len(c.response_token_ids) for c in completions], group_size,
                                    normalize_std=normalize_std)
        return RolloutAdvantages(returns, adv.to(torch.float32), per_turn=True)
    if not _summed_logged:
        _summed_logged = True
        log.info("the environment gives per-turn rewards: learner.algorithm=%r trains on one advantage per "
                 "episode, so they are added into each episode's return (R + sum of per-turn rewards); "
                 "per-turn advantages need learner.algorithm=%r", algorithm, PER_TURN_ALGORITHM)
    return RolloutAdvantages(returns, group_advantages(returns, group_size, normalize_std=normalize_std),
                             summed_turn_rewards=True)


def with_branches(completions: list[Completion], adv: RolloutAdvantages, episodes: list[tuple[str, int]],
                  branches: dict[str, list[tuple[int, Completion]]], unit: int, pad_token_id: int) -> tuple[
                      list[Completion], RolloutAdvantages, list[tuple[str, int]]]:
    """The batch with every episode's other branches beside it (``env.gateway.fork_policy=all``): each branch
    trains with its episode's return and advantage (the group's statistics were taken per episode, before);
    then empty rows (no response token, return NaN, advantage 0: nothing trains on them) up to a multiple of
    ``unit`` (``num_minibatches x world_size``, which ``split_for_ranks`` needs).

    Args:
        completions: the N episodes' completions (the branch each episode ended on).
        adv: their ``RolloutAdvantages`` (``rollout_advantages``), ``[N]`` per sequence.
        episodes: ``(episode_id, branch)`` of each of the N.
        branches: the other branches by episode id, ``(branch, Completion)`` (``Collected.branches``); episodes
            absent have none.
        unit: the batch's size must be a multiple of it.
        pad_token_id: the empty rows' one prompt token.

    Returns:
        ``(completions, advantages, episodes)`` extended alike (the inputs themselves when no episode has another
        branch); ``episodes`` names each row's ``(episode_id, branch)`` for the token check, ``("", 0)`` the empty
        rows.

    Raises:
        ValueError: per-token advantages (``gspo_token`` with per-turn rewards): a branch's turns are not its
            episode's.
    """
    owners = [(i, b, comp) for i, (eid, _) in enumerate(episodes) for b, comp in branches.get(eid, [])]
    if not owners:
        return completions, adv, episodes
    if adv.per_turn:
        raise ValueError("env.gateway.fork_policy=all trains one advantage per sequence; per-turn advantages "
                         "(gspo_token with per-turn rewards) do not map onto another branch's turns")
    pad = -(len(completions) + len(owners)) % unit
    empty = [Completion(completions[0].prompt_uid, 0, [pad_token_id], [], [], "", "stop",
                        completions[0].weight_version) for _ in range(pad)]
    idx = torch.tensor([i for i, _, _ in owners], dtype=torch.long)
    returns = torch.cat([adv.returns, adv.returns[idx], torch.full((pad,), float("nan"))]).to(torch.float32)
    advantages = torch.cat([adv.advantages, adv.advantages[idx], torch.zeros(pad)]).to(torch.float32)
    rows = completions + [comp for _, _, comp in owners] + empty
    keys = episodes + [(episodes[i][0], b) for i, b, _ in owners] + [("", 0)] * pad
    return rows, dataclasses.replace(adv, returns=returns, advantages=advantages), keys


def _turn_table(completions: list[Completion]) -> torch.Tensor:
    """float64 ``[N, K]``: each completion's per-turn rewards, 0 where it has none."""
    k = max([len(c.turn_rewards or ()) for c in completions] + [1])
    out = torch.zeros((len(completions), k), dtype=torch.float64)
    for i, c in enumerate(completions):
        if c.turn_rewards:
            out[i, : len(c.turn_rewards)] = torch.tensor(c.turn_rewards, dtype=torch.float64)
    return out


def build_train_batch(
    completions: list[Completion], rewards: torch.Tensor, advantages: torch.Tensor, pad_token_id: int
) -> TrainBatch:
    """Right-pad ``prompt + response`` of every completion into a ``TrainBatch``.

    Args:
        completions: N completions (groups consecutive).
        rewards: float32 ``[N]`` (NaN = invalid sample): the episodes' returns (``RolloutAdvantages.returns``).
        advantages: float32 ``[N]``, one per sequence, or ``[N, R]`` with ``R`` >= the longest response, one per
            response token (``RolloutAdvantages.advantages`` with ``per_turn``): laid out as
            ``TrainBatch.advantages`` ``[N, L-1]``, target ``p - 1 + j`` taking response token ``j``'s value
            (``p`` the prompt's length), 0 on prompt and padding targets.
        pad_token_id: id used for padding.

    Returns:
        TrainBatch with targets aligned to ``input_ids[:, 1:]``: ``response_mask[i, t]`` is True where
        ``input_ids[i, t+1]`` is a response token an engine sampled (``Completion.response_mask``: an
        environment's tokens in an episode are context, not response), ``old_log_probs[i, t]`` its behaviour
        log-prob.

    Raises:
        ValueError: lengths disagree (rewards/advantages vs completions, or log-probs or a response mask vs
            response tokens).
    """
    n = len(completions)
    lengths = [len(c.prompt_token_ids) + len(c.response_token_ids) for c in completions]
    longest = max([len(c.response_token_ids) for c in completions] + [0])
    per_token = advantages.dim() == 2
    if rewards.shape != (n,) or advantages.shape[:1] != (n,) or advantages.dim() > 2 or (
            per_token and advantages.shape[1] < longest):
        raise ValueError(f"rewards {tuple(rewards.shape)} must be ({n},) and advantages {tuple(advantages.shape)} "
                         f"({n},) or ({n}, R >= {longest})")
    L = max(max(lengths), 2)
    input_ids = torch.full((n, L), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, L), dtype=torch.long)
    response_mask = torch.zeros((n, L - 1), dtype=torch.bool)
    old = torch.zeros((n, L - 1), dtype=torch.float32)
    adv = torch.zeros((n, L - 1), dtype=torch.float32) if per_token else advantages.to(torch.float32)
    for i, c in enumerate(completions):
        p, r = len(c.prompt_token_ids), len(c.response_token_ids)
        if len(c.response_logprobs) != r:
            raise ValueError(
                f"completion {c.prompt_uid}#{c.sample_index}: {len(c.response_logprobs)} log-probs for {r} tokens"
            )
        if p == 0:
            raise ValueError(f"completion {c.prompt_uid}#{c.sample_index} has an empty prompt")
        input_ids[i, :p] = torch.tensor(c.prompt_token_ids, dtype=torch.long)
        if r:
            input_ids[i, p : p + r] = torch.tensor(c.response_token_ids, dtype=torch.long)
            # Target t predicts token t+1: response token j sits at p+j, so its target index is p+j-1.
            response_mask[i, p - 1 : p - 1 + r] = True if c.response_mask is None else _sampled(c)
            old[i, p - 1 : p - 1 + r] = torch.tensor(c.response_logprobs, dtype=torch.float32)
            if per_token:
                adv[i, p - 1 : p - 1 + r] = advantages[i, :r].to(torch.float32)
        attention_mask[i, : p + r] = 1
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        old_log_probs=old,
        advantages=adv,
        rewards=rewards.to(torch.float32),
        prompt_uids=[c.prompt_uid for c in completions],
        weight_versions=torch.tensor([c.weight_version for c in completions], dtype=torch.long),
        rollout_routes=rollout_routes(completions, L),
    )


def _sampled(c: Completion) -> torch.Tensor:
    """bool ``[R]``: ``c.response_mask`` checked against the response's length."""
    if len(c.response_mask) != len(c.response_token_ids):
        raise ValueError(f"completion {c.prompt_uid}#{c.sample_index}: a response mask of {len(c.response_mask)} "
                         f"for {len(c.response_token_ids)} tokens")
    return torch.tensor(c.response_mask, dtype=torch.bool)


def rollout_routes(completions: list[Completion], width: int) -> torch.Tensor | None:
    """The engine routings of ``completions`` padded into int16 ``[N, width, layers, k]`` (-1 where none:
    padding and each row's last token), or None when no completion carries one.

    Raises:
        ValueError: some completions carry a routing and others not, or a routing whose shape is not
            ``[P + R - 1, layers, k]`` with the same ``layers, k`` for all.
    """
    have = [c.routed_experts is not None for c in completions]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{have.count(False)} of {len(completions)} completions carry no routed_experts while the "
                         "others do (rollout.return_routed_experts must be on in every engine)")
    shape = tuple(completions[0].routed_experts.shape[1:])
    out = torch.full((len(completions), width, *shape), -1, dtype=torch.int16)
    for i, c in enumerate(completions):
        ids = torch.from_numpy(np.array(c.routed_experts, dtype=np.int16))  # a copy: Ray hands read-only arrays
        t = len(c.prompt_token_ids) + len(c.response_token_ids) - 1
        if tuple(ids.shape) != (t, *shape):
            raise ValueError(f"completion {c.prompt_uid}#{c.sample_index}: routed_experts has shape "
                             f"{tuple(ids.shape)}, expected {(t, *shape)}")
        out[i, :t] = ids
    return out


def build_sft_batch(prompts: list[list[int]], responses: list[list[int]], pad_token_id: int,
                    response_masks: list[list[int]] | None = None) -> SFTBatch:
    """Right-pad supervised examples; the loss covers the response tokens only (targets aligned to
    ``input_ids[:, 1:]``), and of a multi-turn demonstration only its assistant tokens: ``response_masks[i]``
    (length of ``responses[i]``) is 1 where the model is to write the token, 0 where an environment did."""
    n = len(prompts)
    L = max(max(len(p) + len(r) for p, r in zip(prompts, responses)), 2)
    input_ids = torch.full((n, L), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, L), dtype=torch.long)
    loss_mask = torch.zeros((n, L - 1), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = p + r
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[i, : len(seq)] = 1
        loss_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = (
            True if response_masks is None else torch.tensor(response_masks[i], dtype=torch.bool))
    return SFTBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)


@dataclass
class RankPlan:
    """What one learner rank trains on for one rollout batch."""

    minibatches: list[TrainBatch]
    num_sequences: list[int]
    num_tokens: list[int]
    row_indices: list[list[int]]  # per minibatch: the rows of the step's batch in this rank's shard, in order


def split_for_ranks(batch: TrainBatch, num_minibatches: int, world_size: int, seed: int) -> list[RankPlan]:
    """Shuffle the sequences (seeded), cut them into ``num_minibatches`` minibatches and each minibatch into
    ``world_size`` equal shards. Each rank gets its shard of every minibatch plus the minibatch's totals over
    all ranks (sequences with at least one response token, and response tokens): the global normalisers of
    the loss (``learner.objectives.loss_normalisers``).

    Raises:
        ValueError: N is not divisible by ``num_minibatches * world_size``.
    """
    n = len(batch)
    if n % (num_minibatches * world_size):
        raise ValueError(f"{n} sequences do not split into {num_minibatches} minibatches x {world_size} ranks")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    mb = n // num_minibatches
    shard = mb // world_size
    plans = [RankPlan([], [], [], []) for _ in range(world_size)]
    for m in range(num_minibatches):
        idx = perm[m * mb : (m + 1) * mb]
        # sequences with at least one response token, and response tokens, over the whole minibatch
        sequences, tokens = loss_normalisers(batch.response_mask[idx])
        for r in range(world_size):
            rows = idx[r * shard : (r + 1) * shard]
            plans[r].minibatches.append(batch.select(rows))
            plans[r].row_indices.append(rows.tolist())
            plans[r].num_sequences.append(sequences)
            plans[r].num_tokens.append(tokens)
    return plans
