"""Policy objectives of GSPO, GSPO-token, GRPO/DAPO and Dr. GRPO as entries of the policy-loss registry
(``learner/loss_registry.py``; CISPO, SAPO and GMPO in ``learner/policy_losses.py``), with the masks, normalisers
and aggregations they share. Their training metrics are in ``learner/policy_metrics.py``, the KL penalty (which
aggregates like the policy loss) in ``learner/kl.py``.

Pure torch (no Ray, vLLM, DeepSpeed or config imports): tensors and plain arguments in, a loss tensor and a
dict of Python floats out. The math, the defaults and how the algorithms differ: ``learner/README.md``.
References: GSPO = Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071 (equations numbered
as in the paper); DAPO = Yu et al., arXiv 2503.14476.

Conventions for every ``[B, T]`` input: position ``t`` of row ``b`` is one target token; ``response_mask``
(bool or 0/1) is True on the response tokens that count. Values at masked positions (padding, prompt) never
reach a result or a gradient, even when they are NaN or inf: they are replaced with ``torch.where`` before any
arithmetic. A row with no response token is an empty response: its log-ratio is 0 and it is not counted in
any normaliser or metric.

Micro-batching: pass ``num_sequences`` / ``num_tokens`` (the minibatch's totals, summed over micro-batches
and data-parallel ranks with :func:`loss_normalisers`); then the sum of the micro-batch losses and gradients
equals the loss and gradient of the whole minibatch computed at once. Combine the micro-batch metrics with
:func:`learner.policy_metrics.combine_policy_metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from learner.logprobs import entropy_from_logits  # noqa: F401  (public here as well, see the issue's contract)
# The names and the GSPO aggregation rule, torch-free so that the config schema loads without torch; public
# here as well.
from learner.objective_names import (  # noqa: F401
    ALGORITHMS,
    GSPO_LOSS_AGG,
    KL_ESTIMATORS,
    LOSS_AGGS,
    SEQUENCE_LEVEL_ALGORITHMS,
    check_loss_agg,
)
# The registry (one signature for every loss; LOG_RATIO_CLAMP is the |log ratio| band applied before exp:
# to the sequence mean for GSPO / GSPO-token, to each token for GRPO; for GSPO the clip range (3e-4) is far
# inside it, so the clamp only acts on broken inputs) and the losses' typed settings with their defaults.
from learner import policy_losses  # noqa: F401  (registers cispo, sapo, gmpo)
from learner.loss_registry import (
    LOG_RATIO_CLAMP,
    LossInputs,
    LossTerms,
    RatioUnits,
    get_policy_loss,
    register_policy_loss,
)
from learner.loss_settings import build_settings
from learner.policy_metrics import _ratio_metrics


@dataclass(frozen=True)
class Objective:
    """The policy loss's settings, resolved and checked by :func:`resolve_objective`: ``algorithm`` (a
    registered loss, ``learner/loss_registry.py``), the clip range ``[1 - clip_low, 1 + clip_high]`` (NaN for a
    loss without one, e.g. ``sapo``), the loss aggregation ``loss_agg`` (one of ``LOSS_AGGS``; the KL penalty
    uses it too) and ``settings``, the loss's own typed settings (``learner/loss_settings.py``)."""

    algorithm: str
    clip_low: float
    clip_high: float
    loss_agg: str
    settings: Any = field(default=None, compare=False)

    @property
    def low(self) -> float:
        """The lower clip bound of the importance ratio, ``1 - clip_low``."""
        return 1.0 - self.clip_low

    @property
    def high(self) -> float:
        """The upper clip bound of the importance ratio, ``1 + clip_high``."""
        return 1.0 + self.clip_high

    @property
    def sequence_level(self) -> bool:
        """True for GSPO and GSPO-token (one ratio per sequence, ``SEQUENCE_LEVEL_ALGORITHMS``)."""
        return self.algorithm in SEQUENCE_LEVEL_ALGORITHMS

    def describe(self) -> str:
        """One line for reports: the algorithm and its resolved settings."""
        if self.settings is None:
            return f"{self.algorithm}, clip [1-{self.clip_low:g}, 1+{self.clip_high:g}], {self.loss_agg}"
        parts = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in vars(self.settings).items()]
        return f"{self.algorithm}, " + ", ".join(parts)


def resolve_objective(
    algorithm: str,
    clip_low: float | None = None,
    clip_high: float | None = None,
    loss_agg: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Objective:
    """Fill in the loss's defaults (its settings dataclass) and refuse invalid combinations.

    Defaults: ``gspo`` and ``gspo_token``: ``clip_low=3e-4``, ``clip_high=4e-4`` (GSPO paper, section 5.1),
    ``loss_agg="seq_mean_token_mean"``; ``grpo``: 0.2 / 0.2, ``loss_agg="token_mean"``; the others' in
    ``learner/loss_settings.py`` (``cispo``, ``sapo``, ``gmpo``, ``dr_grpo``).

    Args:
        algorithm: a registered name or ``"module.path:function"`` (:func:`learner.loss_registry.get_policy_loss`).
        clip_low, clip_high, loss_agg: the generic settings; None = the loss's default.
        options: the loss's other settings by name (``learner.loss_options``).

    Raises:
        ValueError: unknown ``algorithm`` or ``loss_agg``; a negative or non-finite clip value; GSPO or
            GSPO-token with a ``loss_agg`` other than ``"seq_mean_token_mean"`` (any other aggregation weights
            a sequence by its length, which is not GSPO's objective, Eq. 5); a setting the loss does not have;
            ``dr_grpo`` without ``norm_length``.
    """
    spec = get_policy_loss(algorithm)
    generic = {"clip_low": clip_low, "clip_high": clip_high, "loss_agg": loss_agg}
    settings = build_settings(algorithm, spec.info, generic, dict(options or {}))
    if getattr(settings, "norm_length", 0) is None:
        raise ValueError(f"algorithm={algorithm!r} needs loss_options.norm_length, Dr. GRPO's constant "
                         "normaliser (a run config sets it from rollout.max_response_tokens)")
    nan = float("nan")
    return Objective(algorithm, float(getattr(settings, "clip_low", nan)), float(getattr(settings, "clip_high", nan)),
                     getattr(settings, "loss_agg", GSPO_LOSS_AGG), settings)


def loss_normalisers(response_mask: Tensor) -> tuple[int, int]:
    """This batch's contribution to the global normalisers of :func:`policy_loss` and :func:`learner.kl.kl_penalty`.

    Args:
        response_mask: bool or 0/1 ``[B, T]``.

    Returns:
        ``(num_sequences, num_tokens)``: rows with at least one response token, and response tokens. Sum them
        over the micro-batches and data-parallel ranks of a minibatch and pass the totals to every part.
    """
    mask = response_mask != 0
    return int(mask.any(-1).sum()), int(mask.sum())


# ---------------------------------------------------------------------------------------------------------
# helpers


def _mask_and_dtype(a: Tensor, b: Tensor, response_mask: Tensor, names: tuple[str, str]) -> tuple[Tensor, torch.dtype]:
    if a.dim() != 2:
        raise ValueError(f"{names[0]} must be [B, T], got shape {tuple(a.shape)}")
    if b.shape != a.shape:
        raise ValueError(f"{names[1]} shape {tuple(b.shape)} does not match {names[0]} shape {tuple(a.shape)}")
    if response_mask.shape != a.shape:
        raise ValueError(f"response_mask shape {tuple(response_mask.shape)} does not match {names[0]} {tuple(a.shape)}")
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return response_mask != 0, dtype


def _normaliser(value: float | None, local: int, name: str) -> float:
    """The divisor: ``value`` (a global total) or this call's own count; never below 1."""
    if value is None:
        return float(max(local, 1))
    value = float(value)
    if not (math.isfinite(value) and value >= local):
        raise ValueError(
            f"{name}={value!r} is smaller than this call's own count ({local}); pass the minibatch total "
            "(see loss_normalisers)"
        )
    return max(value, 1.0)


def _aggregate(values: Tensor, mask: Tensor, loss_agg: str, seq_den: float, tok_den: float) -> Tensor:
    """Aggregate ``[B, T]`` per-token values (0 outside ``mask``) into a scalar.

    token_mean: ``sum_{b,t} v / tok_den``; seq_mean_token_mean: ``sum_b (sum_t v / |y_b|) / seq_den``;
    seq_mean_token_sum: ``sum_b sum_t v / seq_den``.
    """
    if loss_agg == "token_mean":
        return values.sum() / tok_den
    per_seq = values.sum(-1)
    if loss_agg == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1).to(values.dtype)
    return per_seq.sum() / seq_den


def _advantages(advantages: Tensor, mask: Tensor, algorithm: str, dtype: torch.dtype) -> Tensor:
    """``[B]`` for gspo, ``[B, T]`` otherwise; 0 outside the mask."""
    b, t = mask.shape
    if advantages.shape == (b,):
        adv = advantages.to(dtype)
        return adv if algorithm == "gspo" else torch.where(mask, adv[:, None].expand(b, t), 0.0)
    if advantages.shape == (b, t):
        if algorithm == "gspo":
            raise ValueError(
                f"algorithm='gspo' needs one advantage per sequence, shape ({b},), got {tuple(advantages.shape)}; "
                "use algorithm='gspo_token' for token-level advantages"
            )
        return torch.where(mask, advantages.to(dtype), 0.0)
    raise ValueError(f"advantages shape {tuple(advantages.shape)} must be [B]=({b},) or [B, T]=({b}, {t})")


def _clipped_surrogate(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    """``min(ratio * A, clip(ratio, low, high) * A)`` (PPO form, GSPO Eq. 5) and where each clip side binds.

    The min selects the clipped term, and that term differs from the unclipped one, exactly when
    ``A > 0 and ratio > high`` (clipped high) or ``A < 0 and ratio < low`` (clipped low); the term is then a
    constant, so its gradient is 0. Written with ``torch.where`` so that this holds bit-for-bit.
    """
    clipped_high = (adv > 0) & (ratio > high)
    clipped_low = (adv < 0) & (ratio < low)
    surrogate = torch.where(clipped_high | clipped_low, ratio.clamp(low, high) * adv, ratio * adv)
    return surrogate, clipped_low, clipped_high


# ---------------------------------------------------------------------------------------------------------
# public


def sequence_log_ratio(log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence log importance ratio (paper Eq. 7, in log space).

    ``log s_i = (1/|y_i|) * sum_{t in y_i} (log pi_theta(y_i,t | x, y_i,<t) - log pi_old(y_i,t | x, y_i,<t))``.

    Args:
        log_probs: float ``[B, T]``, current-policy log-probs of the target tokens (differentiable).
        old_log_probs: float ``[B, T]``, behaviour-policy log-probs.
        response_mask: bool or 0/1 ``[B, T]``.

    Returns:
        ``[B]`` float32 (float64 when an input is float64). An empty response gives 0. Not clamped.

    Raises:
        ValueError: shapes that are not ``[B, T]`` or do not match.
    """
    mask, dtype = _mask_and_dtype(log_probs, old_log_probs, response_mask, ("log_probs", "old_log_probs"))
    diff = torch.where(mask, log_probs.to(dtype) - old_log_probs.to(dtype), 0.0)
    return diff.sum(-1) / mask.sum(-1).clamp(min=1).to(dtype)


class SequenceCounts(NamedTuple):
    """Per-row counts of :func:`policy_loss` (no gradient): response tokens, units and clipped units."""

    length: Tensor  # int64 [B]: response tokens of the row
    units: Tensor  # float [B]: units of the row (1 or 0 per sequence for GSPO; its response tokens for GRPO)
    clipped: Tensor  # float [B]: clipped units of the row


@dataclass
class PolicyLoss:
    """What :func:`policy_loss` returns: the loss (0-dim, gradients flow), its metrics, per-row counts."""

    loss: Tensor
    metrics: dict[str, float]
    per_sequence: SequenceCounts


# Sanitised loss inputs and the units the metrics are taken over: the registry's types (one signature for
# every loss, learner/loss_registry.py).
_Inputs, _Units = LossInputs, RatioUnits


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    objective: Objective,
    *,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    token_weights: Tensor | None = None,
) -> PolicyLoss:
    """Clipped policy-gradient loss (negative surrogate objective, to minimise) and its metrics.

    Sanitises the inputs, runs the registered loss ``objective.algorithm`` (``learner/loss_registry.py``; the
    ones below, ``dr_grpo`` here, ``cispo``, ``sapo`` and ``gmpo`` in ``learner/policy_losses.py``, or a user's)
    with ``objective.settings`` and turns its ratio units into the metrics below.
    With ``lo = 1 - clip_low``, ``hi = 1 + clip_high``, ``A`` the advantage and ``B`` the number of sequences:

    - ``"gspo"`` (GSPO Eq. 5): ``loss = -(1/B) sum_i min(s_i A_i, clip(s_i, lo, hi) A_i)`` with
      ``s_i = exp(clamp(log s_i, +-LOG_RATIO_CLAMP))``, ``log s_i`` from :func:`sequence_log_ratio` (Eq. 7).
      Gradient w.r.t. each response token's log-prob: ``-A_i s_i / (|y_i| B)`` unclipped, 0 clipped.
    - ``"gspo_token"`` (GSPO section 4.3): token ratio ``s_i,t = sg[s_i] * pi_t / sg[pi_t]`` (value
      ``s_i``), ``loss = -(1/B) sum_i (1/|y_i|) sum_t min(s_i,t A_i,t, clip(s_i,t, lo, hi) A_i,t)``; with one
      advantage per sequence it equals ``"gspo"`` in value and gradient.
    - ``"grpo"``: token ratio ``r_i,t = pi_t / pi_old,t`` (log-ratio clamped per token), per-token loss
      ``-min(r A, clip(r, lo, hi) A)``, aggregated by ``loss_agg``; ``clip_high > clip_low`` is DAPO's
      clip-higher and ``loss_agg="token_mean"`` DAPO's token-level loss.

    Aggregations (``S`` = ``num_sequences``, ``N`` = ``num_tokens``, ``l`` = per-token loss):
    ``seq_mean_token_mean``: ``sum_i (1/|y_i|) sum_t l_i,t / S``; ``token_mean``: ``sum_i,t l_i,t / N``;
    ``seq_mean_token_sum``: ``sum_i,t l_i,t / S``. ``S`` counts rows with at least one response token.

    Args:
        log_probs: float ``[B, T]``, current-policy log-probs (the tensor gradients flow to).
        old_log_probs: float ``[B, T]``, behaviour-policy log-probs (no gradient used).
        advantages: float ``[B]`` (one per sequence) or ``[B, T]`` (``gspo_token`` and ``grpo`` only); must
            be finite on response positions.
        response_mask: bool or 0/1 ``[B, T]``.
        objective: the algorithm (a registered loss), clip range, aggregation and settings, from
            :func:`resolve_objective`.
        num_sequences, num_tokens: global normalisers (minibatch totals across micro-batches and ranks, see
            :func:`loss_normalisers`); None: this call's own counts.
        token_weights: None, or float ``[B, T]`` detached per-token weights multiplying each token's clipped
            surrogate (``"grpo"`` only: the truncated-IS mismatch correction, ``learner.rollout_correction``).

    Returns:
        A :class:`PolicyLoss`: ``loss`` a 0-dim tensor (float32, float64 for float64 inputs). ``metrics``
        (Python floats; a "unit" is a sequence for GSPO / GSPO-token and a token for GRPO; only sequences
        with response tokens count): ``clip_fraction``, ``clip_fraction_low``, ``clip_fraction_high`` (share
        of units clipped; for GSPO-token each sequence counts the share of its tokens clipped), ``ratio_mean``,
        ``ratio_min``, ``ratio_max`` (of the importance ratios used, after the clamp), ``log_ratio_abs_max``
        (largest |log-ratio| before the clamp), and the sums in ``COUNT_METRICS``: ``num_sequences``,
        ``num_tokens``, ``num_ratios`` (units), ``num_clipped``, ``num_clipped_low``, ``num_clipped_high``,
        ``ratio_sum``. With no unit, fractions are 0, ratio statistics 1 and ``log_ratio_abs_max`` 0.
        ``per_sequence`` (:class:`SequenceCounts`, no gradient, for metrics sliced by length): int64 ``[B]``
        response tokens, float ``[B]`` units and clipped units of each row; their sums over rows are
        ``num_tokens``, ``num_ratios`` and ``num_clipped``.

    Raises:
        ValueError: shapes
            that do not match, ``[B, T]`` advantages with ``"gspo"``, a normaliser smaller than this call's
            own count, ``token_weights`` with a loss that takes none (gspo, gspo_token, gmpo: it would change their
            sequence-level aggregation), an unknown algorithm or a setting the loss does not have.
    """
    spec = get_policy_loss(objective.algorithm)
    if token_weights is not None and not spec.info.token_weights:
        raise ValueError(f"token_weights with algorithm={objective.algorithm!r}: per-token weights change its "
                         "sequence-level aggregation (GSPO's, GMPO's)")
    settings = objective.settings if objective.settings is not None else build_settings(
        objective.algorithm, spec.info, {"clip_low": objective.clip_low, "clip_high": objective.clip_high,
                                         "loss_agg": objective.loss_agg})
    mask, dtype = _mask_and_dtype(log_probs, old_log_probs, response_mask, ("log_probs", "old_log_probs"))
    adv = _advantages(advantages, mask, objective.algorithm, dtype)
    lengths = mask.sum(-1)
    n_seq, n_tok = int((lengths > 0).sum()), int(lengths.sum())
    # Sanitise first: nothing at a masked position (NaN, inf) takes part in any later op or gradient.
    weights = None if token_weights is None else torch.where(mask, token_weights.detach().to(dtype), 0.0)
    x = _Inputs(torch.where(mask, log_probs.to(dtype), 0.0), torch.where(mask, old_log_probs.to(dtype), 0.0), adv,
                mask, lengths, _normaliser(num_sequences, n_seq, "num_sequences"),
                _normaliser(num_tokens, n_tok, "num_tokens"), weights)
    loss, units = spec(x, settings)

    metrics = _ratio_metrics(units.mask, units.ratio.detach(), units.abs_log_ratio.detach(), units.clip_low,
                             units.clip_high)
    metrics["num_sequences"] = float(n_seq)
    metrics["num_tokens"] = float(n_tok)
    with torch.no_grad():
        row_units, row_clipped = units.mask.to(dtype), (units.clip_low + units.clip_high).detach()
        if row_units.dim() == 2:  # token units (GRPO): count them per row
            row_units, row_clipped = row_units.sum(-1), torch.where(units.mask, row_clipped, 0.0).sum(-1)
    return PolicyLoss(loss, metrics, SequenceCounts(lengths.to(torch.int64), row_units, row_clipped))


@register_policy_loss("gspo")
def _gspo(x: _Inputs, settings: Any) -> LossTerms:
    """GSPO (Eq. 5-7), as documented in :func:`policy_loss`; ``settings``: ``loss_settings.GspoSettings``."""
    return LossTerms(*_sequence_level_loss(Objective("gspo", settings.clip_low, settings.clip_high,
                                                     settings.loss_agg), x))


@register_policy_loss("gspo_token")
def _gspo_token(x: _Inputs, settings: Any) -> LossTerms:
    """GSPO-token (section 4.3), as documented in :func:`policy_loss`."""
    return LossTerms(*_sequence_level_loss(Objective("gspo_token", settings.clip_low, settings.clip_high,
                                                     settings.loss_agg), x))


@register_policy_loss("grpo")
def _grpo(x: _Inputs, settings: Any) -> LossTerms:
    """GRPO / DAPO (token ratios, token clipping), as documented in :func:`policy_loss`."""
    return LossTerms(*_token_level_loss(Objective("grpo", settings.clip_low, settings.clip_high, settings.loss_agg),
                                        x, x.weights))


@register_policy_loss("ppo")
def _ppo(x: _Inputs, settings: Any) -> LossTerms:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv 1707.06347, Eq. 7) with a critic: GRPO's token-level
    loss (clip 0.2 / 0.2, ``token_mean``) on the critic's per-token GAE advantages ``[B, T]``
    (``learner/critic.py``, ``learner/gae.py``)."""
    return LossTerms(*_token_level_loss(Objective("ppo", settings.clip_low, settings.clip_high, settings.loss_agg),
                                        x, x.weights))


@register_policy_loss("dr_grpo")
def _dr_grpo(x: _Inputs, settings: Any) -> LossTerms:
    """Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783: the Dr. GRPO objective):

        loss = -(1/S) sum_i (1/L) sum_t min(r_i,t A_i, clip(r_i,t, 1 - eps_low, 1 + eps_high) A_i)

    GRPO's token ratios and clipping (``_token_level_loss``) with the ``1/|y_i|`` of each sequence replaced by
    one constant ``L = settings.norm_length`` (the paper's generation budget ``MAX_TOKENS``; TRL's
    ``loss_type="dr_grpo"`` divides by ``B * max_completion_length`` the same way, verl's
    ``seq-mean-token-sum-norm`` by a constant ``loss_scale_factor``); its advantages are ``r_i - mean(r)``
    without the std (``LossInfo.normalize_adv_std=False``). Defaults: clip 0.2 / 0.2, ``loss_agg =
    "seq_mean_token_sum"`` (then divided by ``L``); ``token_mean`` or ``seq_mean_token_mean`` are accepted but
    are not Dr. GRPO. Gradient w.r.t. an unclipped token's log-prob: ``-A r / (S L)``.
    """
    loss, units = _token_level_loss(Objective("grpo", settings.clip_low, settings.clip_high, settings.loss_agg),
                                    x, x.weights)
    return LossTerms(loss / float(settings.norm_length), units)


def _sequence_level_loss(objective: Objective, x: _Inputs) -> tuple[Tensor, _Units]:
    """GSPO (Eq. 5) or GSPO-token (section 4.3) on sanitised inputs, as documented in :func:`policy_loss`."""
    lp, old, adv, mask, lengths = x.lp, x.old, x.adv, x.mask, x.lengths
    dtype, c, low, high = lp.dtype, LOG_RATIO_CLAMP, objective.low, objective.high
    has_tokens = lengths > 0
    seq_lr = (lp - old).sum(-1) / lengths.clamp(min=1).to(dtype)  # Eq. 7, log space
    seq_lr_c = seq_lr.clamp(-c, c)
    if objective.algorithm == "gspo":
        ratio = torch.exp(seq_lr_c)  # s_i
        surrogate, clip_lo, clip_hi = _clipped_surrogate(ratio, adv, low, high)
        loss = -torch.where(has_tokens, surrogate, 0.0).sum() / x.seq_den
        unit_clip_lo = (clip_lo & has_tokens).to(dtype)
        unit_clip_hi = (clip_hi & has_tokens).to(dtype)
    else:
        # s_i,t = sg[s_i] * pi_t / sg[pi_t]: value s_i, gradient s_i * d log pi_t. Outside the clamp band
        # the token gets no gradient, as the clamped s_i of "gspo" has none.
        inside = (seq_lr.abs() <= c)[:, None]
        tok_lr = torch.where(inside, lp - lp.detach(), 0.0) + seq_lr_c.detach()[:, None]
        ratio_t = torch.exp(tok_lr)
        surrogate, clip_lo, clip_hi = _clipped_surrogate(ratio_t, adv, low, high)
        loss = -_aggregate(torch.where(mask, surrogate, 0.0), mask, objective.loss_agg, x.seq_den, x.tok_den)
        len_f = lengths.clamp(min=1).to(dtype)
        unit_clip_lo = (clip_lo & mask).sum(-1) / len_f
        unit_clip_hi = (clip_hi & mask).sum(-1) / len_f
        ratio = torch.exp(seq_lr_c)
    return loss, _Units(has_tokens, ratio, seq_lr.abs(), unit_clip_lo, unit_clip_hi)


def _token_level_loss(objective: Objective, x: _Inputs, weights: Tensor | None = None) -> tuple[Tensor, _Units]:
    """GRPO / DAPO on sanitised inputs, as documented in :func:`policy_loss`: per-token clipped ratios (times
    ``weights`` when given) aggregated by ``objective.loss_agg``."""
    token_log_ratio = x.lp - x.old
    ratio = torch.exp(token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # r_i,t
    surrogate, clip_lo, clip_hi = _clipped_surrogate(ratio, x.adv, objective.low, objective.high)
    if weights is not None:
        surrogate = surrogate * weights
    loss = -_aggregate(torch.where(x.mask, surrogate, 0.0), x.mask, objective.loss_agg, x.seq_den, x.tok_den)
    unit_clip_lo, unit_clip_hi = (clip_lo & x.mask).to(x.lp.dtype), (clip_hi & x.mask).to(x.lp.dtype)
    return loss, _Units(x.mask, ratio, token_log_ratio.abs(), unit_clip_lo, unit_clip_hi)
