"""The policy losses' own typed settings and the one rule that builds them from the config, without torch.

Each loss of the registry (``learner/loss_registry.py``) has a frozen dataclass of settings with its paper's
defaults. The config's generic keys (``learner.clip_low``, ``clip_high``, ``loss_agg``) fill the fields of the
same name, ``learner.loss_options`` the loss's other fields (``sapo``'s temperatures, ``dr_grpo``'s constant
length); :func:`build_settings` refuses a key the loss does not have, naming it. The built-in losses are
described here (``BUILTIN_LOSSES``) so that loading a config checks their settings without importing torch; a
user's loss brings its own :class:`LossInfo` and is checked on the driver when its module is imported.
Imports nothing but the names module.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from learner.objective_names import GSPO_LOSS_AGG, LOSS_AGGS, check_loss_agg

GENERIC_KEYS = ("clip_low", "clip_high", "loss_agg")  # filled from learner.<key>, not from loss_options


def _check_clip(obj: Any) -> None:
    for name in ("clip_low", "clip_high"):
        value = getattr(obj, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")


@dataclass(frozen=True)
class ClipSettings:
    """A clipped importance ratio: ratio range ``[1 - clip_low, 1 + clip_high]``, the aggregation ``loss_agg``
    (one of ``LOSS_AGGS``). Defaults: GRPO's (PPO's symmetric 0.2, DAPO's token-level loss)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg: str = "token_mean"

    def __post_init__(self) -> None:
        _check_clip(self)


@dataclass(frozen=True)
class GspoSettings(ClipSettings):
    """GSPO and GSPO-token: the paper's clip range (section 5.1) on the sequence ratio, sequence-mean loss."""

    clip_low: float = 3e-4
    clip_high: float = 4e-4
    loss_agg: str = GSPO_LOSS_AGG


@dataclass(frozen=True)
class CispoSettings(ClipSettings):
    """CISPO: the IS weight is clipped to ``[1 - clip_low, 1 + clip_high]``. MiniMax-M1 sets no
    lower bound (``clip_low = 1``: the weight is never below 0 anyway) and tunes only the upper one; 4.0 (a
    weight cap of 5) is ScaleRL's value (arXiv 2510.13786), TRL's recommended ``epsilon_high=5.0``. Token-mean
    loss over all the batch's tokens (MiniMax-M1's normaliser ``sum_i |o_i|``)."""

    clip_low: float = 1.0
    clip_high: float = 4.0
    loss_agg: str = "token_mean"


@dataclass(frozen=True)
class GmpoSettings(ClipSettings):
    """GMPO: the token log-ratio is clipped to ``[-clip_low, clip_high]`` (log space; the paper's default
    ``(e^-0.4, e^0.4)`` on the ratio); one geometric-mean ratio per sequence, so a sequence-mean loss only."""

    clip_low: float = 0.4
    clip_high: float = 0.4
    loss_agg: str = GSPO_LOSS_AGG


@dataclass(frozen=True)
class DrGrpoSettings(ClipSettings):
    """Dr. GRPO: GRPO's token clipping, the token sum of each sequence divided by one constant ``norm_length``
    (the generation budget; a run config sets it from ``rollout.max_response_tokens``) and the mean over
    sequences: no length normalisation (Dr. GRPO, arXiv 2503.20783)."""

    loss_agg: str = "seq_mean_token_sum"
    norm_length: int | None = None

    def __post_init__(self) -> None:
        _check_clip(self)
        if self.norm_length is not None and not (isinstance(self.norm_length, int) and self.norm_length >= 1):
            raise ValueError(f"norm_length={self.norm_length!r} must be an integer >= 1")


@dataclass(frozen=True)
class SapoSettings:
    """SAPO: the soft gate's temperatures for tokens with positive and with non-positive advantages (the
    paper's 1.0 and 1.05: negative tokens' gates decay faster), sequence-mean loss."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05
    loss_agg: str = GSPO_LOSS_AGG

    def __post_init__(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a finite number > 0")


@dataclass(frozen=True)
class LossInfo:
    """What the learner and the config need to know of a loss besides its function.

    Attributes:
        settings: its frozen settings dataclass (every field has a default, or the loss refuses to resolve
            without it).
        loss_aggs: the aggregations it accepts in ``settings.loss_agg``.
        token_weights: whether it accepts per-token weights (the token-level mismatch corrections).
        normalize_adv_std: the group advantage's default (True: z-score; False: mean-only, Dr. GRPO).
        unit: what its ratio metrics count, ``"sequence"`` or ``"token"``.
    """

    settings: type
    loss_aggs: tuple[str, ...] = LOSS_AGGS
    token_weights: bool = True
    normalize_adv_std: bool = True
    unit: str = "token"


_SEQ = (GSPO_LOSS_AGG,)
#: the algorithms the offline ratio audit (learner/audit_checks.py, ``policy_objective``) recomputes; the config
#: refuses ``trainer.audit_steps`` with another (PPO's per-token GAE advantages are not in the saved batch)
AUDITED_ALGORITHMS = ("gspo", "gspo_token", "grpo", "dr_grpo")

BUILTIN_LOSSES: dict[str, LossInfo] = {
    "gspo": LossInfo(GspoSettings, _SEQ, token_weights=False, unit="sequence"),
    "gspo_token": LossInfo(GspoSettings, _SEQ, token_weights=False, unit="sequence"),
    "grpo": LossInfo(ClipSettings),
    "cispo": LossInfo(CispoSettings),
    "sapo": LossInfo(SapoSettings),
    "gmpo": LossInfo(GmpoSettings, _SEQ, token_weights=False),
    "dr_grpo": LossInfo(DrGrpoSettings, normalize_adv_std=False),
    "ppo": LossInfo(ClipSettings),  # grpo's loss on the critic's GAE advantages (learner/critic.py)
}


def is_user_loss(name: str) -> bool:
    """True for a ``"module.path:function"`` loss (imported on the driver and the learner ranks)."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr and all(part.isidentifier() for part in module.split("."))
                and attr.isidentifier())


def _coerce(name: str, value: Any, annotation: str, prefix: str) -> Any:
    """``value`` for a field annotated ``annotation`` (the dataclass's string annotation)."""
    if "float" in annotation and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if "int" in annotation and isinstance(value, int) and not isinstance(value, bool):
        return value
    if "str" in annotation and isinstance(value, str):
        return value
    if "bool" in annotation and isinstance(value, bool):
        return value
    if "None" in annotation and value is None:
        return None
    raise ValueError(f"{prefix}{name}={value!r} is not a {annotation}")


def build_settings(
    algorithm: str,
    info: LossInfo,
    generic: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    prefix: str = "",
) -> Any:
    """The loss's settings: its dataclass's defaults, the generic keys that are not None, then ``options``.

    Args:
        algorithm: the loss's name (for messages and GSPO's aggregation rule).
        info: its :class:`LossInfo`.
        generic: ``{"clip_low": ..., "clip_high": ..., "loss_agg": ...}`` from the config (None = default).
        options: the loss's other settings by field name (``learner.loss_options``).
        prefix: put before the key names in messages, e.g. ``"learner."``.

    Returns:
        An instance of ``info.settings``.

    Raises:
        ValueError: a generic key set that the loss has no field for, an option that is not one of its
            fields (or is a generic key), a value of the wrong type or range, an aggregation the loss does not
            accept; the message names the key, the value and the algorithm.
    """
    fields = {f.name: str(f.type) for f in dataclasses.fields(info.settings)}
    values: dict[str, Any] = {}
    for key, value in (generic or {}).items():
        if value is None:
            continue
        if key not in fields:
            raise ValueError(f"{prefix}{key}={value!r} is not a setting of {prefix}algorithm={algorithm!r} "
                             f"(its settings: {', '.join(fields)}); leave it null")
        values[key] = value
    for key, value in (options or {}).items():
        if key in GENERIC_KEYS:
            raise ValueError(f"{prefix}loss_options.{key}: set {prefix}{key} instead")
        if key not in fields:
            raise ValueError(f"{prefix}loss_options.{key}={value!r} is not a setting of {prefix}algorithm="
                             f"{algorithm!r} (its settings: {', '.join(k for k in fields if k not in GENERIC_KEYS)})")
        values[key] = value
    check_loss_agg(algorithm, values.get("loss_agg"), prefix)
    values = {k: _coerce(k, v, fields[k], prefix) for k, v in values.items()}
    try:
        settings = info.settings(**values)
    except ValueError as err:
        raise ValueError(f"{prefix}algorithm={algorithm!r}: {prefix}{err}") from None
    agg = getattr(settings, "loss_agg", None)
    if agg is not None and agg not in info.loss_aggs:
        raise ValueError(f"{prefix}loss_agg={agg!r} is refused with {prefix}algorithm={algorithm!r}: it takes "
                         f"{', '.join(info.loss_aggs)}")
    return settings


def accepts_token_weights(algorithm: str) -> bool:
    """Whether ``algorithm`` takes per-token weights (True for a user loss: checked when it is imported)."""
    info = BUILTIN_LOSSES.get(algorithm)
    return info is None or info.token_weights


def default_normalize_adv_std(algorithm: str) -> bool:
    """The group advantage's std normalisation that ``algorithm`` is defined with (True for a user loss)."""
    info = BUILTIN_LOSSES.get(algorithm)
    return True if info is None else info.normalize_adv_std
