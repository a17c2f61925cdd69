"""The offline ratio audit's response mask: rebuilt from the prompt lengths, the attention mask and, for
multi-turn episodes (docs/agents.md), the engines' sampled-token masks saved with the step, then checked against
the mask training used (the first phase of ``learner.audit.run_audit``).

Written independently of the training code, like ``learner/audit_checks.py``: nothing here comes from
``cluster.driver.batching``. Target ``t`` predicts token ``t + 1``, so response token ``j`` of a sequence with
``P`` prompt tokens (at position ``P + j``) has target ``P - 1 + j``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from learner.audit_checks import Check, SavedBatch, _argmax2, _judge, _skip


def expected_response_mask(prompt_lengths: Tensor, attention_mask: Tensor, sampled: Tensor | None = None) -> Tensor:
    """The response mask rebuilt from the prompt lengths and the (right-padded) attention mask.

    Sequence ``i`` has ``P_i`` prompt tokens and ``n_i = attention_mask[i].sum()`` real tokens; its response
    tokens sit at ``P_i .. n_i - 1`` and are predicted at target positions ``P_i - 1 .. n_i - 2``. With
    ``sampled`` (multi-turn episodes), an episode's response keeps only the tokens the engines sampled
    (``sampled_target_mask``): the environment's reply tokens are context, not trained.

    Args:
        prompt_lengths: int64 ``[N]``; attention_mask: int ``[N, L]``.
        sampled: None (single answers), or int8 ``[N, R]``, the engines' per-response-token masks
            (``sampled_target_mask``).

    Returns:
        bool ``[N, L-1]``. Rows with an unknown prompt length (< 0) are all False.
    """
    n, length = attention_mask.shape
    out = torch.zeros((n, length - 1), dtype=torch.bool)
    for i in range(n):
        p, total = int(prompt_lengths[i]), int(attention_mask[i].sum())
        if p > 0 and total > p:
            out[i, p - 1 : total - 1] = True
    if sampled is not None:
        out &= sampled_target_mask(prompt_lengths, sampled, length - 1)
    return out


def sampled_target_mask(prompt_lengths: Tensor, sampled: Tensor, width: int) -> Tensor:
    """The engines' sampled-token masks of episodes, mapped to target positions.

    Args:
        prompt_lengths: int64 ``[N]``, ``P_i`` (< 1: unknown, the row is all False).
        sampled: int8 ``[N, R]``, per response token ``j``: 1 sampled by an engine, 0 put there by the
            environment, -1 past the response; a row of -1s has no episode mask (a single answer).
        width: ``L - 1``, the number of target positions.

    Returns:
        bool ``[N, width]``: for an episode row, True at target ``P_i - 1 + j`` where ``sampled[i, j] == 1``
        (response token ``j`` sits at ``P_i + j``, and target ``t`` predicts token ``t + 1``); all True for a
        row without an episode mask.
    """
    out = torch.ones((sampled.shape[0], width), dtype=torch.bool)
    for i in range(sampled.shape[0]):
        if not bool((sampled[i] >= 0).any()):
            continue
        out[i] = False
        p = int(prompt_lengths[i])
        if p > 0:
            targets = p - 1 + torch.nonzero(sampled[i] == 1).flatten()
            out[i, targets[targets < width]] = True
    return out


def episode_lengths(sampled: Tensor) -> Tensor:
    """int64 ``[N]``: the length of each row's episode mask (entries >= 0 of ``sampled`` ``[N, R]``), -1 for
    a row without one."""
    counts = (sampled >= 0).sum(-1)
    return torch.where(counts > 0, counts, torch.full_like(counts, -1))


def mask_checks(batch: SavedBatch, meta: dict[str, Any]) -> tuple[Tensor, Tensor, list[Check]]:
    """The response mask rebuilt from the prompt lengths, the attention mask and, for episodes, the engines'
    sampled-token masks, against the saved one (``mask_alignment``, ``prompt_tokens``, ``length_normalisation``,
    with episodes ``episode_mask_length``); with unknown prompt lengths only ``mask_on_padding``.

    Returns:
        ``(mask, lengths, checks)``: the audit's response mask, bool ``[N, L-1]`` (the saved one when the prompt
        lengths are unknown), and its row counts ``|y_i|`` (an episode's sampled tokens), int64 ``[N]``.
    """
    saved_mask, attn = batch.saved_mask, batch.attention_mask
    n = saved_mask.shape[0]
    on_padding = saved_mask & (attn[:, 1:] == 0)
    if not bool((batch.prompt_lengths > 0).all()):
        return saved_mask.clone(), saved_mask.sum(-1), [
            _skip("mask_alignment", "prompt lengths unknown (rows not found in the dataset)"),
            _judge("mask_on_padding", float(on_padding.sum()), 0, f"{n} rows", exact=True)]
    mask = expected_response_mask(batch.prompt_lengths, attn, batch.sampled)
    lengths = mask.sum(-1)
    checks = [_alignment_check(batch, mask, on_padding), _prompt_tokens_check(batch, meta),
              _length_check(batch, lengths)]
    if batch.sampled is not None:
        checks.append(_episode_length_check(batch))
    return mask, lengths, checks


def _alignment_check(batch: SavedBatch, mask: Tensor, on_padding: Tensor) -> Check:
    """``mask_alignment``: target positions where the saved mask ``[N, L-1]`` differs from the audit's ``mask``
    or lies on padding."""
    saved_mask, n = batch.saved_mask, batch.saved_mask.shape[0]
    wrong = (saved_mask != mask) | on_padding
    where = f"{n} rows"
    if bool(wrong.any()):
        i, j = _argmax2(wrong.to(torch.int64))
        where = (f"row {i}, target {j}: saved mask {bool(saved_mask[i, j])}, expected {bool(mask[i, j])} "
                 f"(prompt {int(batch.prompt_lengths[i])} tokens, {int(batch.attention_mask[i].sum())} real tokens"
                 + (", an episode: the engines' sampled tokens only)" if batch.is_episode(i) else ")"))
    return _judge("mask_alignment", float(wrong.sum()), 0, where, exact=True)


def _prompt_tokens_check(batch: SavedBatch, meta: dict[str, Any]) -> Check:
    """``prompt_tokens``: rows whose first tokens are not their prompt's ids (an episode's own prompt,
    ``meta["episode_prompt_token_ids"][str(row)]``, where the dump saved one; else the dataset row's by uid)."""
    prompts, own = meta.get("prompt_token_ids", {}), meta.get("episode_prompt_token_ids", {})
    bad = []
    for i, uid in enumerate(meta.get("prompt_uids", [])):
        ids = own.get(str(i), prompts.get(uid))
        if ids is not None and batch.input_ids[i, : len(ids)].tolist() != list(ids):
            bad.append(i)
    n = batch.saved_mask.shape[0]
    return _judge("prompt_tokens", float(len(bad)), 0, f"row {bad[0]}" if bad else f"{n} rows", exact=True)


def _length_check(batch: SavedBatch, lengths: Tensor) -> Check:
    """``length_normalisation``: rows whose saved-mask count differs from the audit's ``|y_i|`` (``lengths``
    ``[N]``)."""
    saved_mask, n = batch.saved_mask, batch.saved_mask.shape[0]
    dl = (saved_mask.sum(-1) - lengths).abs()
    i = int(torch.argmax(dl)) if n else 0
    return _judge("length_normalisation", float((dl > 0).sum()), 0,
                  f"row {i}: |y| in saved mask {int(saved_mask[i].sum())}, response length "
                  f"{int(lengths[i])}" if n and dl[i] else f"{n} rows", exact=True)


def _episode_length_check(batch: SavedBatch) -> Check:
    """``episode_mask_length``: episode rows whose sampled-token mask (``SavedBatch.sampled``) does not cover
    exactly the response rebuilt from the prompt length and the attention mask (``n_i - P_i`` tokens)."""
    ep = episode_lengths(batch.sampled)
    response = batch.attention_mask.sum(-1) - batch.prompt_lengths
    bad = torch.nonzero((ep >= 0) & (ep != response)).flatten().tolist()
    where = (f"row {bad[0]}: a sampled-token mask of {int(ep[bad[0]])} for {int(response[bad[0]])} response tokens"
             if bad else f"{int((ep >= 0).sum())} episodes")
    return _judge("episode_mask_length", float(len(bad)), 0, where, exact=True)
