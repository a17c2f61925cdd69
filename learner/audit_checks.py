"""The offline ratio audit's own float64 math and its checks, one function per phase of
``learner.audit.run_audit`` (see ``learner/audit.py`` for what each check compares and the exit codes); the
first phase, the response mask (single answers and multi-turn episodes), is ``learner/audit_masks.py``.

Written independently of the training code: nothing here comes from ``learner.objectives``,
``learner.logprobs`` or ``cluster.driver.batching``. Inputs are tensors, the saved split / objective / metrics as plain
dicts and lists, and the behaviour model; outputs are ``Check`` records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

LOG_RATIO_BAND = 20.0  # |log ratio| band before exp, as documented in learner/README.md
# Optional learner metric: the loss of every optimizer step of the call, in order (first = first minibatch).
PER_STEP_LOSS_KEY = "loss/policy_minibatches"
# Optional tensor of the saved batch: the episodes' sampled-token masks (``SavedBatch.sampled``).
EPISODE_MASK_KEY = "episode_response_mask"


@dataclass
class Check:
    """One audited quantity: its largest difference, the tolerance and where the difference is largest."""

    name: str
    diff: float
    tolerance: float
    where: str = ""
    status: str = "ok"  # "ok", "FAIL" or "skipped"
    note: str = ""
    exact: bool = False
    values: dict[str, float] = field(default_factory=dict)  # the compared figures, for machine readers

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def _judge(name: str, diff: float, tol: float, where: str = "", note: str = "", exact: bool = False) -> Check:
    bad = not math.isfinite(diff) or (diff != 0 if exact else diff > tol)
    return Check(name, float(diff), 0.0 if exact else float(tol), where, "FAIL" if bad else "ok", note, exact)


def _skip(name: str, note: str) -> Check:
    return Check(name, float("nan"), float("nan"), "", "skipped", note)



# ---------------------------------------------------------------------------------------------------------
# the audit's own math (float64)


def row_log_probs(model, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """Token log-probs and entropies of one unpadded sequence.

    Args:
        model: a causal LM (its dtype is the compute dtype).
        ids: int64 ``[n]`` token ids (prompt + response, no padding), ``n >= 2``.
        temperature: > 0; the distribution is ``softmax(logits / temperature)``.

    Returns:
        ``(lp, entropy)``, float64 ``[n - 1]``: ``lp[t] = log p(ids[t+1] | ids[:t+1])`` (differentiable when
        grad is enabled) and the entropy (nats) of the distribution at ``t`` (detached).
    """
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].to(torch.float64) / float(temperature)
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    lp = logp.gather(-1, ids[1:, None]).squeeze(-1)
    with torch.no_grad():
        p = logp.exp()
        ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    return lp, ent


def sequence_log_ratios(lp: Tensor, old: Tensor, mask: Tensor, lengths: Tensor | None = None) -> Tensor:
    """GSPO's length-normalised sequence log-ratio (Eq. 7): ``(1/|y_i|) sum_{t in mask} (lp - old)``.

    Args:
        lp, old: float ``[N, T]``; mask: bool ``[N, T]``.
        lengths: ``|y_i|`` per row (default: the mask's row counts); rows with length 0 give 0.

    Returns:
        float64 ``[N]``.
    """
    diff = torch.where(mask.bool(), lp.to(torch.float64) - old.to(torch.float64), torch.zeros((), dtype=torch.float64))
    n = mask.bool().sum(-1) if lengths is None else lengths
    return diff.sum(-1) / n.clamp(min=1).to(torch.float64)


def _gspo_token_per_token(lp: Tensor, a: Tensor, mask: Tensor, log_s: Tensor, clip: tuple[float, float],
                          num_sequences: float) -> tuple[Tensor, Tensor]:
    """GSPO-token's loss with per-token advantages ``a`` ``[B, T]`` (multi-turn episodes with per-turn rewards),
    float64: token ``t``'s term is ``s_i,t A_i,t`` with ``s_i,t = sg[s_i] exp(lp_t - sg[lp_t])`` (value ``s_i``,
    no gradient outside the clamp band), clipped per token when ``A_i,t > 0 and s_i > hi`` or ``A_i,t < 0 and
    s_i < lo``; ``loss = -(1/S) sum_i (1/|y_i|) sum_t term_i,t``. Returns ``(loss, clipped share of the tokens of
    each sequence with a response token)``."""
    lo, hi = clip
    zero = torch.zeros((), dtype=lp.dtype)
    counts = mask.sum(-1)
    s = torch.exp(log_s.clamp(-LOG_RATIO_BAND, LOG_RATIO_BAND)).detach()
    inside = (log_s.abs() <= LOG_RATIO_BAND)[:, None] & mask
    s_t = s[:, None] * torch.exp(torch.where(inside, lp - lp.detach(), zero))
    clipped = (((a > 0) & (s_t > hi)) | ((a < 0) & (s_t < lo))) & mask
    term = torch.where(mask, torch.where(clipped, s_t.detach().clamp(lo, hi) * a, s_t * a), zero)
    loss = -(term.sum(-1) / counts.clamp(min=1).to(lp.dtype)).sum() / max(float(num_sequences), 1.0)
    has = counts > 0
    return loss, clipped.sum(-1)[has].to(lp.dtype) / counts[has].to(lp.dtype)


def policy_objective(
    lp: Tensor,
    old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    algorithm: str,
    clip_low: float,
    clip_high: float,
    loss_agg: str,
    num_sequences: float,
    num_tokens: float,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """The clipped policy loss of one whole minibatch, written out independently of ``learner.objectives``.

    GSPO / GSPO-token (Eq. 5, 7): ``s_i = exp(clamp(log s_i, +-20))``; a sequence is clipped when ``A_i > 0``
    and ``s_i > 1 + clip_high`` or ``A_i < 0`` and ``s_i < 1 - clip_low`` (then its term is a constant);
    ``loss = -(1/S) sum_i term_i`` over sequences with a response token (with sequence advantages GSPO-token
    has the same value and gradient). GRPO: the same per token with ``r = exp(clamp(lp - old, +-20))``,
    aggregated by ``loss_agg`` (``token_mean``: ``/N``; ``seq_mean_token_mean``: per-sequence means ``/S``;
    ``seq_mean_token_sum``: ``/S``). Dr. GRPO (Liu et al., arXiv 2503.20783): GRPO's loss divided by the constant
    ``norm_length`` (with ``seq_mean_token_sum``: ``-(1/S) sum_i (1/L) sum_t term``).

    GSPO-token with per-token advantages ``[B, T]``: ``_gspo_token_per_token``.

    Args:
        lp: float ``[B, T]`` current log-probs (differentiable); old: behaviour log-probs; advantages: ``[B]``
            (``[B, T]`` for ``gspo_token`` only);
        mask: bool ``[B, T]``; num_sequences ``S`` and num_tokens ``N``: the minibatch's normalisers;
        norm_length: Dr. GRPO's ``L`` (``learner.loss_options.norm_length``), for ``dr_grpo`` only.

    Returns:
        ``(loss, stats)``: 0-dim float64 loss; stats with ``clip_fraction``, ``ratio_mean|min|max`` (of the
        units the objective used: sequences for GSPO, tokens for GRPO), ``seq_ratio_mean|min|max`` (GSPO's
        ``s_i`` whatever the algorithm) and ``num_units``.

    Raises:
        ValueError: unknown algorithm or loss_agg, or ``dr_grpo`` without a ``norm_length`` >= 1.
    """
    if algorithm == "dr_grpo":
        if not norm_length or norm_length < 1:
            raise ValueError(f"algorithm='dr_grpo' needs norm_length >= 1, got {norm_length!r}")
        loss, stats = policy_objective(lp, old, advantages, mask, algorithm="grpo", clip_low=clip_low,
                                       clip_high=clip_high, loss_agg=loss_agg, num_sequences=num_sequences,
                                       num_tokens=num_tokens)
        return loss / float(norm_length), stats
    mask = mask.bool()
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64)
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    delta = torch.where(mask, lp.to(f64) - old.to(f64), zero)
    counts = mask.sum(-1)
    has = counts > 0
    a = advantages.to(f64)
    log_s = delta.sum(-1) / counts.clamp(min=1).to(f64)
    s = torch.exp(log_s.clamp(-LOG_RATIO_BAND, LOG_RATIO_BAND))
    if a.dim() == 2 and algorithm != "gspo_token":
        raise ValueError(f"per-token advantages {tuple(a.shape)} are audited with algorithm='gspo_token' only")
    if a.dim() == 2:  # GSPO-token with per-token advantages
        loss, unit_clip = _gspo_token_per_token(lp.to(f64), a, mask, log_s, (lo, hi), num_sequences)
        unit_ratio = s[has]
    elif algorithm in ("gspo", "gspo_token"):
        clipped = ((a > 0) & (s > hi)) | ((a < 0) & (s < lo))
        term = torch.where(clipped, s.detach().clamp(lo, hi) * a, s * a)
        loss = -torch.where(has, term, zero).sum() / max(float(num_sequences), 1.0)
        unit_ratio, unit_clip = s[has], clipped[has]
    elif algorithm == "grpo":
        r = torch.exp(delta.clamp(-LOG_RATIO_BAND, LOG_RATIO_BAND))
        a2 = a[:, None].expand_as(r)
        clipped = (((a2 > 0) & (r > hi)) | ((a2 < 0) & (r < lo))) & mask
        term = torch.where(mask, torch.where(clipped, r.detach().clamp(lo, hi) * a2, r * a2), zero)
        if loss_agg == "token_mean":
            loss = -term.sum() / max(float(num_tokens), 1.0)
        elif loss_agg == "seq_mean_token_mean":
            loss = -(term.sum(-1) / counts.clamp(min=1).to(f64)).sum() / max(float(num_sequences), 1.0)
        elif loss_agg == "seq_mean_token_sum":
            loss = -term.sum() / max(float(num_sequences), 1.0)
        else:
            raise ValueError(f"loss_agg={loss_agg!r} is not known to the audit")
        unit_ratio, unit_clip = r[mask], clipped[mask]
    else:
        raise ValueError(f"algorithm={algorithm!r} is not known to the audit")
    sv = s[has].detach()
    ur = unit_ratio.detach()
    stats = {
        "num_units": int(ur.numel()),
        "clip_fraction": float(unit_clip.double().mean()) if ur.numel() else 0.0,
        "ratio_mean": float(ur.mean()) if ur.numel() else 1.0,
        "ratio_min": float(ur.min()) if ur.numel() else 1.0,
        "ratio_max": float(ur.max()) if ur.numel() else 1.0,
        "seq_ratio_mean": float(sv.mean()) if sv.numel() else 1.0,
        "seq_ratio_min": float(sv.min()) if sv.numel() else 1.0,
        "seq_ratio_max": float(sv.max()) if sv.numel() else 1.0,
    }
    return loss, stats



@dataclass
class SavedBatch:
    """The saved batch as the audit reads it: ids and masks as int64 / bool, log-probs and advantages in float64."""

    input_ids: Tensor  # int64 [N, L], right-padded
    attention_mask: Tensor  # int64 [N, L]
    saved_mask: Tensor  # bool [N, L-1]: the response mask training used
    old: Tensor  # float64 [N, L-1]: the engines' behaviour log-probs
    learner_lp: Tensor  # float64 [N, L-1]: the learner's own pre-update log-probs
    advantages: Tensor  # float64 [N], or [N, L-1] per target token (gspo_token with per-turn rewards)
    prompt_lengths: Tensor  # int64 [N]; <= 0 where the row was not found in the dataset
    # int8 [N, R]: episodes' sampled-token masks as the engines reported them (1 sampled, 0 the environment's,
    # -1 past the response or a row that is a single answer); None: no episode in the step (or an older dump)
    sampled: Tensor | None = None

    @classmethod
    def from_tensors(cls, t: dict[str, Tensor]) -> "SavedBatch":
        sampled = t.get(EPISODE_MASK_KEY)
        return cls(
            input_ids=t["input_ids"].long(), attention_mask=t["attention_mask"].long(),
            saved_mask=t["response_mask"].bool(), old=t["old_log_probs"].to(torch.float64),
            learner_lp=t["learner_log_probs"].to(torch.float64), advantages=t["advantages"].to(torch.float64),
            prompt_lengths=t["prompt_lengths"].long(), sampled=None if sampled is None else sampled.to(torch.int8),
        )

    def is_episode(self, i: int) -> bool:
        """Whether row ``i`` has an episode mask (a multi-turn episode)."""
        return self.sampled is not None and bool((self.sampled[i] >= 0).any())


def _argmax2(x: Tensor) -> tuple[int, int]:
    flat = int(torch.argmax(x))
    return flat // x.shape[1], flat % x.shape[1]


def _metric(metrics: dict[str, Any] | None, key: str) -> float | None:
    if not metrics or metrics.get(key) is None:
        return None
    try:
        return float(metrics[key])
    except (TypeError, ValueError):
        return None




# ---------------------------------------------------------------------------------------------------------
# the phases of run_audit, in order


def recompute_log_probs(model, batch: SavedBatch, temperature: float) -> tuple[Tensor, Tensor]:
    """Token log-probs and entropies of every row at the behaviour weights, one unpadded sequence at a time.

    Returns:
        ``(audit_lp, entropy)``, float64 ``[N, L-1]``, zero past each row's last real target.
    """
    input_ids, attn = batch.input_ids, batch.attention_mask
    n, width = batch.saved_mask.shape
    audit_lp = torch.zeros((n, width), dtype=torch.float64)
    entropy = torch.zeros((n, width), dtype=torch.float64)
    with torch.no_grad():
        for i in range(n):
            total = int(attn[i].sum())
            if total < 2:
                continue
            lp_i, ent_i = row_log_probs(model, input_ids[i, :total], temperature)
            audit_lp[i, : total - 1] = lp_i
            entropy[i, : total - 1] = ent_i
    return audit_lp, entropy


def log_prob_checks(batch: SavedBatch, audit_lp: Tensor, mask: Tensor, lengths: Tensor,
                    tolerance: float) -> list[Check]:
    """``behaviour_log_probs`` and ``learner_log_probs`` on the saved mask, and ``sequence_log_ratio``: GSPO's
    ``log s_i`` from the audit's log-probs and lengths vs from the learner's log-probs and the saved mask."""
    saved_mask, old, learner_lp, input_ids = batch.saved_mask, batch.old, batch.learner_lp, batch.input_ids

    def lp_check(name: str, other: Tensor, what: str) -> Check:
        d = torch.where(saved_mask, (audit_lp - other).abs(), torch.zeros((), dtype=torch.float64))
        if not bool(saved_mask.any()):
            return _skip(name, "no response token")
        i, j = _argmax2(d)
        return _judge(name, float(d[i, j]), tolerance,
                      f"row {i}, target {j} (token {int(input_ids[i, j + 1])}): audit {float(audit_lp[i, j]):.6f}, "
                      f"{what} {float(other[i, j]):.6f}")

    checks = [lp_check("behaviour_log_probs", old, "engine"), lp_check("learner_log_probs", learner_lp, "learner")]
    has = lengths > 0
    if bool(has.any()):
        audit_seq = sequence_log_ratios(audit_lp, old, mask, lengths)
        train_seq = sequence_log_ratios(learner_lp, old, saved_mask)
        d = torch.where(has, (audit_seq - train_seq).abs(), torch.zeros((), dtype=torch.float64))
        i = int(torch.argmax(d))
        checks.append(_judge("sequence_log_ratio", float(d[i]), tolerance,
                             f"row {i}: audit log s = {float(audit_seq[i]):.3e}, from learner/saved mask "
                             f"{float(train_seq[i]):.3e}"))
    else:
        checks.append(_skip("sequence_log_ratio", "no response token"))
    return checks


def split_checks(split: list[dict[str, Any]], objective: dict[str, Any], mask: Tensor) -> list[Check]:
    """``minibatch_split``: every row trained once per epoch in equal shards over ``world_size`` ranks;
    ``normalisers``: each minibatch's normalisers (sequences with a response token, response tokens) as the
    driver passed them vs the audit's own count."""
    n = mask.shape[0]
    seen = torch.zeros(n, dtype=torch.long)
    problems, where = 0, ""
    world = int(objective.get("world_size", len(split[0]["ranks"]) if split else 1))
    for m, mb in enumerate(split):
        sizes = {len(r) for r in mb["ranks"]}
        if len(mb["ranks"]) != world or len(sizes) != 1:
            problems += 1
            where = where or f"minibatch {m}: {len(mb['ranks'])} ranks, shard sizes {sorted(sizes)}"
        for rows in mb["ranks"]:
            for i in rows:
                if not 0 <= int(i) < n:
                    problems += 1
                    where = where or f"minibatch {m}: row {i} outside [0, {n})"
                else:
                    seen[int(i)] += 1
    bad_rows = torch.nonzero(seen != 1).flatten().tolist()
    if bad_rows:
        problems += len(bad_rows)
        where = where or f"row {bad_rows[0]} trained {int(seen[bad_rows[0]])} times"
    checks = [_judge("minibatch_split", float(problems), 0, where or f"{len(split)} minibatches x {world} ranks",
                     exact=True)]
    diff, where = 0.0, ""
    for m, mb in enumerate(split):
        rows = torch.tensor([int(i) for r in mb["ranks"] for i in r if 0 <= int(i) < n], dtype=torch.long)
        sub = mask[rows]
        seqs, toks = int(sub.any(-1).sum()), int(sub.sum())
        d = abs(seqs - int(mb["num_sequences"])) + abs(toks - int(mb["num_tokens"]))
        for key, own in (("num_sequences_per_rank", seqs), ("num_tokens_per_rank", toks)):
            for v in mb.get(key, []):
                d += abs(own - int(v))
        if d > diff:
            diff = float(d)
            where = (f"minibatch {m}: driver passed S={mb['num_sequences']} N={mb['num_tokens']}, audit counts "
                     f"S={seqs} N={toks}")
    checks.append(_judge("normalisers", diff, 0, where or "all minibatches match", exact=True))
    return checks


def pre_update_metric_checks(metrics: dict[str, Any] | None, batch: SavedBatch, audit_lp: Tensor, entropy: Tensor,
                             mask: Tensor, tolerance: float) -> list[Check]:
    """The metrics the learner logged from its pre-update pass over the whole batch: ``logprob_diff_metric``,
    ``entropy`` (token means over the audit's mask) and ``num_response_tokens``; skipped when not logged."""
    old = batch.old
    checks: list[Check] = []
    total_tokens = float(mask.sum())
    pre = [
        ("logprob_diff_metric", "actor/train_rollout_logprob_diff",
         float(torch.where(mask, (audit_lp - old).abs(), torch.zeros((), dtype=torch.float64)).sum() / max(total_tokens, 1.0))),
        ("entropy", "actor/entropy", float(torch.where(mask, entropy, torch.zeros((), dtype=torch.float64)).sum() / max(total_tokens, 1.0))),
    ]
    for name, key, own in pre:
        logged = _metric(metrics, key)
        if logged is None:
            checks.append(_skip(name, f"{key} not logged"))
        else:
            checks.append(_judge(name, abs(own - logged), tolerance, f"{key}: logged {logged:.6g}, audit {own:.6g}"))
    logged_tokens = _metric(metrics, "actor/num_response_tokens")
    if logged_tokens is not None:
        checks.append(_judge("num_response_tokens", abs(logged_tokens - total_tokens), 0,
                             f"logged {logged_tokens:.0f}, audit {total_tokens:.0f}", exact=True))
    return checks


def first_minibatch_objective(minibatch: dict[str, Any], objective: dict[str, Any], model, batch: SavedBatch,
                              mask: Tensor, temperature: float, *, with_grad: bool) -> tuple[Tensor, dict[str, Any]]:
    """The policy loss of the first minibatch (on-policy: the behaviour weights are the weights it trained from)
    over all its rows at once, with the minibatch's own normalisers. With ``with_grad`` the gradient is left in
    the model's ``.grad`` (zeroed first) for ``gradient_check``.

    Returns:
        ``policy_objective``'s ``(loss, stats)`` with ``stats["num_sequences"]`` and ``stats["num_tokens"]``
        (``S`` and ``N``) added.
    """
    input_ids, attn = batch.input_ids, batch.attention_mask
    rows = [int(i) for r in minibatch["ranks"] for i in r]
    sub_mask = mask[rows]
    seqs, toks = int(sub_mask.any(-1).sum()), int(sub_mask.sum())
    recompute = objective.get("old_logprob_source") == "recompute"
    model.zero_grad(set_to_none=True)
    lps = []
    with torch.set_grad_enabled(with_grad):
        for i in rows:
            total = int(attn[i].sum())
            lp_i = torch.zeros(mask.shape[1], dtype=torch.float64)
            if total >= 2:
                lp_row, _ = row_log_probs(model, input_ids[i, :total], temperature)
                lp_i = torch.cat([lp_row, torch.zeros(mask.shape[1] - (total - 1), dtype=torch.float64)])
            lps.append(lp_i)
        lp = torch.stack(lps)
        old_sub = lp.detach() if recompute else batch.old[rows]
        loss, stats = policy_objective(
            lp, old_sub, batch.advantages[rows], sub_mask, algorithm=objective["algorithm"],
            clip_low=float(objective["clip_low"]), clip_high=float(objective["clip_high"]),
            loss_agg=objective["loss_agg"], num_sequences=seqs, num_tokens=toks,
            norm_length=objective.get("norm_length"),
        )
        if with_grad:
            loss.backward()
    stats.update(num_sequences=seqs, num_tokens=toks)
    return loss, stats


def first_minibatch_checks(loss: Tensor, stats: dict[str, Any], metrics: dict[str, Any] | None,
                           tolerance: float) -> list[Check]:
    """``loss_first_minibatch`` against the first minibatch's logged loss (``PER_STEP_LOSS_KEY[0]``, or
    ``loss/policy`` when the step was one optimizer step); with one optimizer step also ``ratio_statistics`` and
    ``clip_fraction`` (otherwise the logged figures pool off-policy minibatches: skipped)."""
    seqs, toks = stats["num_sequences"], stats["num_tokens"]
    checks: list[Check] = []
    steps = _metric(metrics, "actor/num_optimizer_steps")
    per_step = (metrics or {}).get(PER_STEP_LOSS_KEY)
    logged_loss, source = None, ""
    if isinstance(per_step, list) and per_step and per_step[0] is not None:
        logged_loss, source = float(per_step[0]), f"{PER_STEP_LOSS_KEY}[0]"
    elif steps == 1.0 and _metric(metrics, "loss/policy") is not None:
        logged_loss, source = _metric(metrics, "loss/policy"), "loss/policy (one optimizer step)"
    if metrics is None:
        checks.append(_skip("loss_first_minibatch", "no metrics.json (save_outputs did not run)"))
    elif logged_loss is None:
        checks.append(_skip("loss_first_minibatch", f"{int(steps or 0)} optimizer steps and no {PER_STEP_LOSS_KEY} "
                            "key: the first minibatch's loss was not logged on its own"))
    else:
        checks.append(_judge("loss_first_minibatch", abs(float(loss) - logged_loss), tolerance,
                             f"{source}: logged {logged_loss:.8g}, audit {float(loss):.8g} (S={seqs}, N={toks})"))
    if steps == 1.0:
        # Every logged ratio statistic then comes from the first minibatch alone.
        worst, where = 0.0, "all match"
        for key in ("ratio_mean", "ratio_min", "ratio_max", "seq_ratio_mean", "seq_ratio_min", "seq_ratio_max"):
            logged = _metric(metrics, f"actor/{key}")
            if logged is not None and abs(logged - stats[key]) >= worst:
                worst, where = abs(logged - stats[key]), f"actor/{key}: logged {logged:.8g}, audit {stats[key]:.8g}"
        checks.append(_judge("ratio_statistics", worst, tolerance, where))
        logged_cf = _metric(metrics, "actor/clip_fraction")
        if logged_cf is not None:
            checks.append(_judge("clip_fraction", abs(logged_cf - stats["clip_fraction"]), tolerance,
                                 f"logged {logged_cf:.6g}, audit {stats['clip_fraction']:.6g} over "
                                 f"{stats['num_units']} units"))
    elif metrics is not None:
        checks.append(_skip("ratio_statistics", f"{int(steps or 0)} optimizer steps: the logged ratio statistics "
                            "pool off-policy minibatches"))
    return checks


def gradient_check(model, captured: dict[str, Tensor], tolerance: float) -> Check:
    """Per parameter tensor, max |audit grad - training grad| / max |audit grad|; the worst tensor."""
    params = dict(model.named_parameters())
    common = [k for k in captured if k in params]
    if not common:
        return _judge("gradient_first_minibatch", float("inf"), tolerance,
                      f"no parameter name in common ({len(captured)} captured, {len(params)} in the model)")
    worst, where = 0.0, ""
    total_a = total_t = 0.0
    for name in common:
        g_a = params[name].grad
        g_a = torch.zeros_like(params[name], dtype=torch.float64) if g_a is None else g_a.to(torch.float64)
        g_t = captured[name].to(torch.float64)
        if g_t.shape != g_a.shape:
            return _judge("gradient_first_minibatch", float("inf"), tolerance,
                          f"{name}: training shape {tuple(g_t.shape)}, model {tuple(g_a.shape)}")
        scale = float(g_a.abs().max())
        err = float((g_a - g_t).abs().max())
        rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
        total_a += float((g_a ** 2).sum())
        total_t += float((g_t ** 2).sum())
        if rel >= worst:
            worst, where = rel, f"{name}: max |diff| {err:.3e}, max |grad| {scale:.3e}"
    norm_a, norm_t = math.sqrt(total_a), math.sqrt(total_t)
    missing = len(captured) - len(common)
    note = f"grad norm audit {norm_a:.6g}, training {norm_t:.6g}" + (f"; {missing} names not in model" if missing else "")
    check = _judge("gradient_first_minibatch", worst, tolerance, where, note)
    check.values = {"audit_grad_norm": norm_a, "training_grad_norm": norm_t}
    return check




def largest_token_differences(batch: SavedBatch, audit_lp: Tensor, mask: Tensor, top: int) -> list[dict[str, Any]]:
    """The ``top`` target positions (in the saved or the audit's mask) where the audit's log-prob is furthest
    from the engine's or the learner's, largest first, one dict per position."""
    saved_mask, old, learner_lp, input_ids = batch.saved_mask, batch.old, batch.learner_lp, batch.input_ids
    width = saved_mask.shape[1]
    union = saved_mask | mask
    score = torch.where(union, torch.maximum((audit_lp - old).abs(), (audit_lp - learner_lp).abs()),
                        torch.full((), -1.0, dtype=torch.float64))
    tokens = []
    order = torch.argsort(score.flatten(), descending=True)[: max(0, top)]
    for flat in order.tolist():
        i, j = flat // width, flat % width
        if score[i, j] < 0:
            break
        tokens.append({
            "row": i, "target": j, "token": int(input_ids[i, j + 1]), "saved_mask": bool(saved_mask[i, j]),
            "expected_mask": bool(mask[i, j]), "audit": float(audit_lp[i, j]), "engine": float(old[i, j]),
            "learner": float(learner_lp[i, j]),
        })
    return tokens
