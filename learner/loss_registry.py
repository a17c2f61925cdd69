"""The registry of policy losses: one signature for every loss, the built-in ones and a user's own.

A policy loss is a function ``fn(x: LossInputs, settings) -> LossTerms``: sanitised per-token log-probs,
behaviour log-probs, advantages and response mask (with the minibatch's global normalisers) and the loss's own
typed settings (a frozen dataclass, ``learner/loss_settings.py``) in; the loss to minimise and the importance
ratios it used, per unit, out. :func:`learner.objectives.policy_loss` sanitises the inputs, calls the loss and
turns its :class:`RatioUnits` into the usual metrics (``clip_fraction``, ``ratio_mean``, ... and their exact
counts), so that every loss reports the same keys and combines across micro-batches and ranks the same way.

Built-in entries: ``gspo``, ``gspo_token``, ``grpo``, ``dr_grpo`` (``learner/objectives.py``), ``cispo``,
``sapo``, ``gmpo`` (``learner/policy_losses.py``). A user's loss lives in their own module::

    from dataclasses import dataclass
    from learner.loss_registry import LossInputs, LossTerms, RatioUnits, register_policy_loss

    @dataclass(frozen=True)
    class MySettings:
        beta: float = 0.1
        loss_agg: str = "token_mean"

    @register_policy_loss(settings=MySettings)
    def my_loss(x: LossInputs, s: MySettings) -> LossTerms:
        ...

and the config names it as a verifier is named: ``learner.algorithm: mylosses:my_loss`` with
``learner.loss_options: {beta: 0.2}``. The driver imports it before any actor starts (a missing module or a
wrong option is a config error naming the key) and ships the module to the learner ranks
(``cluster/runtime/user_code.py``). Pure torch; imports nothing from Ray, vLLM, DeepSpeed or the config.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from learner.loss_settings import BUILTIN_LOSSES, LossInfo, is_user_loss

# |log ratio| band applied before exp (to the sequence mean for GSPO, to each token otherwise): exp(20) ~ 4.9e8
# is finite in float32 and bfloat16; beyond it the ratio stops growing and gets no gradient.
LOG_RATIO_CLAMP = 20.0


class LossInputs(NamedTuple):
    """A loss's inputs, sanitised: every ``[B, T]`` tensor is 0 outside ``mask`` (NaN or inf there never
    reach the loss or its gradient), float32 or float64.

    Attributes:
        lp: current-policy log-probs ``[B, T]`` (gradients flow to it).
        old: behaviour-policy log-probs ``[B, T]``.
        adv: advantages, ``[B, T]`` (``[B]`` for ``gspo`` only).
        mask: bool ``[B, T]``, the response tokens that count.
        lengths: int ``[B]``, ``|y_i|``.
        seq_den: ``S``, the minibatch's number of sequences with a response token (global, >= 1).
        tok_den: ``N``, the minibatch's number of response tokens (global, >= 1).
        weights: None, or detached per-token weights ``[B, T]`` (the mismatch correction), for losses whose
            :class:`LossInfo` has ``token_weights=True``; multiply each token's term by them.
    """

    lp: Tensor
    old: Tensor
    adv: Tensor
    mask: Tensor
    lengths: Tensor
    seq_den: float
    tok_den: float
    weights: Tensor | None = None

    def aggregate(self, values: Tensor, loss_agg: str) -> Tensor:
        """Aggregate per-token ``values`` ``[B, T]`` into a scalar with the global normalisers.

        ``token_mean``: ``sum_{b,t} v / N``; ``seq_mean_token_mean``: ``sum_b (sum_t v / |y_b|) / S``;
        ``seq_mean_token_sum``: ``sum_b sum_t v / S``. Positions outside ``mask`` count as 0.

        Raises:
            ValueError: an unknown ``loss_agg``.
        """
        values = values.masked_fill(~self.mask, 0.0)
        if loss_agg == "token_mean":
            return values.sum() / self.tok_den
        per_seq = values.sum(-1)
        if loss_agg == "seq_mean_token_mean":
            per_seq = per_seq / self.lengths.clamp(min=1).to(values.dtype)
        elif loss_agg != "seq_mean_token_sum":
            raise ValueError(f"loss_agg={loss_agg!r} is not an aggregation")
        return per_seq.sum() / self.seq_den


class RatioUnits(NamedTuple):
    """What a loss's metrics are taken over: a unit is a sequence (``[B]``) or a token (``[B, T]``).

    Attributes:
        mask: bool, the units that count (sequences with a response token, or response tokens).
        ratio: the importance ratio the loss used (after any clamp), detached or not.
        abs_log_ratio: ``|log ratio|`` before the clamp.
        clip_low: float, 1 where the unit's low side is clipped (or its analogue; a share in [0, 1] is allowed,
            e.g. GSPO-token's share of a sequence's clipped tokens).
        clip_high: float, likewise for the high side.
    """

    mask: Tensor
    ratio: Tensor
    abs_log_ratio: Tensor
    clip_low: Tensor
    clip_high: Tensor


class LossTerms(NamedTuple):
    """What a loss returns: ``loss`` (0-dim, to minimise, gradients flow) and its :class:`RatioUnits`."""

    loss: Tensor
    units: RatioUnits


LossFn = Callable[[LossInputs, Any], LossTerms]


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its name, function and :class:`~learner.loss_settings.LossInfo` (settings class,
    accepted aggregations, whether it takes token weights, its advantage normalisation, its metric unit)."""

    name: str
    fn: LossFn
    info: LossInfo

    def __call__(self, x: LossInputs, settings: Any) -> LossTerms:
        """Run the loss (see the module docstring)."""
        return self.fn(x, settings)


_REGISTRY: dict[str, LossSpec] = {}


def register_policy_loss(
    name: str | None = None,
    *,
    settings: type | None = None,
    info: LossInfo | None = None,
) -> Callable[[LossFn], LossSpec]:
    """Decorator: make ``fn`` a policy loss and, with ``name``, register it under that name.

    Args:
        name: the ``learner.algorithm`` name; None for a user loss named by ``"module:function"`` only.
        settings: its frozen settings dataclass (every field with a default); None = no settings.
        info: the full :class:`LossInfo` instead of ``settings`` (built-in names take theirs from
            ``loss_settings.BUILTIN_LOSSES``).

    Returns:
        The decorator; it returns the :class:`LossSpec` (callable like the function).

    Raises:
        ValueError: ``name`` already registered, or both ``settings`` and ``info`` given.
    """
    if settings is not None and info is not None:
        raise ValueError("give settings or info, not both")

    def wrap(fn: LossFn) -> LossSpec:
        resolved = info or (BUILTIN_LOSSES.get(name) if name and settings is None else None)
        spec = LossSpec(name or f"{fn.__module__}:{fn.__name__}", fn, resolved or LossInfo(settings or _NoSettings))
        if name is not None:
            if name in _REGISTRY:
                raise ValueError(f"policy loss {name!r} is already registered ({_REGISTRY[name].fn.__module__})")
            _REGISTRY[name] = spec
        return spec

    return wrap


@dataclass(frozen=True)
class _NoSettings:
    """The settings of a loss that has none."""


def registered_losses() -> tuple[str, ...]:
    """The names registered so far (the built-ins once ``learner.objectives`` is imported)."""
    return tuple(_REGISTRY)


def get_policy_loss(name: str) -> LossSpec:
    """The loss called ``name``: a registered name, or ``"module.path:function"`` naming a :class:`LossSpec`
    (what :func:`register_policy_loss` returns) or a plain function of the signature (no settings).

    Raises:
        ValueError: an unknown name, a module that cannot be imported, an attribute that is neither; the
            message names the loss.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    if not is_user_loss(name):
        raise ValueError(f"algorithm={name!r} is not one of {registered_losses()} or 'module.path:function'")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"policy loss {name!r}: cannot import module {module_name!r} ({err})") from None
    obj = getattr(module, attr, None)
    if isinstance(obj, LossSpec):
        return obj
    if callable(obj):
        return LossSpec(name, obj, LossInfo(_NoSettings))
    raise ValueError(f"policy loss {name!r}: {module_name!r} has no callable {attr!r}")
