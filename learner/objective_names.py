"""The names of the policy objectives and the one rule between them, without torch.

The algorithm names, the loss aggregations, the KL estimators and the rule that GSPO takes only its own
aggregation (GSPO = Zheng et al., arXiv 2507.18071, Eq. 5). ``learner/objectives.py`` computes with them and
re-exports them; the config schema (``learner/config.py``) takes them from here, so that loading a config
(``--dry-run``, ``cluster.submit``) does not import torch. Imports nothing.
"""

from __future__ import annotations

# The names the config schema accepts: the built-in entries of the policy-loss registry (learner/loss_registry.py;
# their settings in learner/loss_settings.py). A user's loss is named "module.path:function" instead.
ALGORITHMS = ("gspo", "gspo_token", "grpo", "cispo", "sapo", "gmpo", "dr_grpo", "ppo")
# ppo: grpo's token-level clipped loss on the critic's GAE advantages [B, T] (learner/critic.py)
LOSS_AGGS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")

# GSPO's objective (Eq. 5) is a mean over sequences of a length-normalised ratio: the sequence-level
# algorithms accept only this aggregation (see check_loss_agg).
SEQUENCE_LEVEL_ALGORITHMS = ("gspo", "gspo_token")
GSPO_LOSS_AGG = "seq_mean_token_mean"


def check_loss_agg(algorithm: str, loss_agg: str | None, prefix: str = "") -> None:
    """Refuse a loss aggregation that the algorithm's objective does not allow (the one home of this rule:
    ``learner.objectives.resolve_objective`` and the config schema call it).

    Args:
        algorithm: one of ``ALGORITHMS``.
        loss_agg: one of ``LOSS_AGGS``, or None (the algorithm's default, always accepted).
        prefix: put before the key names in the message, e.g. ``"learner."`` for the config section.

    Raises:
        ValueError: GSPO or GSPO-token (``SEQUENCE_LEVEL_ALGORITHMS``) with a ``loss_agg`` other than
            ``"seq_mean_token_mean"``: any other aggregation weights a sequence by its length, which is not
            GSPO's objective (Eq. 5). The message names both keys and values.
    """
    if loss_agg is not None and algorithm in SEQUENCE_LEVEL_ALGORITHMS and loss_agg != GSPO_LOSS_AGG:
        raise ValueError(
            f"{prefix}loss_agg={loss_agg!r} is refused with {prefix}algorithm={algorithm!r}: GSPO's objective "
            f"(Eq. 5) is a mean over sequences of a length-normalised ratio, i.e. loss_agg={GSPO_LOSS_AGG!r}"
        )

# Training-vs-inference mismatch corrections (learner/rollout_correction.py); the token-level ones change how a
# sequence's tokens enter GSPO's s_i and are refused with the sequence-level algorithms.
CORRECTIONS = ("off", "token_tis", "token_mis", "seq_mis", "seq_geo_rs")
TOKEN_CORRECTIONS = ("token_tis", "token_mis")
