"""Config section ``learner.critic``: PPO's value model (``learner.algorithm: ppo`` only; ignored otherwise).

Defaults follow verl (``verl/trainer/config``: ``algorithm.gamma = algorithm.lam = 1.0``,
``critic.cliprange_value = 0.5``, advantages whitened over the batch) and OpenRLHF (gamma 1, lambda 1 for LLM
RL). Pure pydantic, no torch: loading a config imports none.
"""

from pydantic import BaseModel, ConfigDict, Field


class CriticConfig(BaseModel):
    """The value model of ``learner.algorithm: ppo`` (``learner/critic.py``) and its GAE (``learner/gae.py``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=False)

    model_path: str | None = Field(
        None,
        description="None: the policy's architecture and weights (as they are at the first RL step, i.e. after "
        "the warm start) with a scalar value head; a Hugging Face folder: that (e.g. smaller) model's backbone "
        "with a scalar head, which must use the policy's tokenizer (same vocabulary size)",
    )
    lr: float | None = Field(None, gt=0, description="the critic's AdamW learning rate; None = learner.lr")
    lr_warmup_steps: int = Field(
        0, ge=0, description="critic optimizer steps of linear lr warm-up: step s (from 1) trains at lr x min(1, "
        "s / lr_warmup_steps); 0 = constant")
    warmup_steps: int = Field(
        0, ge=0, description="first RL steps that train the critic only, the policy left as it is (verl's "
        "trainer.critic_warmup); 0 = both from the first step")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount over response tokens (verl, OpenRLHF: 1.0)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (verl, OpenRLHF: 1.0)")
    cliprange_value: float | None = Field(
        0.5, gt=0, description="value clip: V_clip = V_old + clamp(V - V_old, +-cliprange_value) (verl's default "
        "0.5); None = the unclipped squared error")
    whiten_advantages: bool = Field(
        True, description="whiten the GAE advantages over the whole rollout batch, every rank's tokens "
        "(verl's masked_whiten: mean and unbiased variance); false keeps them raw")
