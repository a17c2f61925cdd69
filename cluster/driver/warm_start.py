"""The supervised warm start and the learning-rate schedules of a run.

``warm_start`` runs ``warm_start.steps`` cross-entropy steps on worked examples (``row.meta["solution"]``) under
a linear warm-up of the SFT learning rate, then resets the optimizer and sets the RL learning rate.
``RLLearningRate`` applies ``learner.lr_warmup_steps``, the linear RL warm-up verl's and OpenRLHF's recipes use.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from cluster.config import Config
from cluster.driver.batching import build_sft_batch
from cluster.runtime.learner_group import LearnerGroup
from rollout.chat_delta import TurnEnd, reply_ids
from rollout.contracts import PromptRow

log = logging.getLogger("cluster.train")


def linear_warmup(lr: float, step: int, warmup_steps: int) -> float:
    """The learning rate of 0-based ``step`` under a linear warm-up: ``lr x min(1, (step + 1) / warmup_steps)``;
    ``lr`` itself when ``warmup_steps`` is 0."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else lr


class RLLearningRate:
    """The RL learning rate of each step (``learner.lr_warmup_steps``), set on the ranks only when it changes.

    The first ``apply`` of a process always sets it: after a resume or a rollback the optimizer's restored lr
    is the checkpointed step's, not this one's (``forget`` marks that)."""

    def __init__(self, learners: LearnerGroup, cfg: Config):
        self.learners = learners
        self.lc = cfg.learner
        self.last: float | None = None  # the lr last set here (None: not yet, or forgotten)

    def apply(self, step: int) -> None:
        """Set 0-based RL ``step``'s learning rate when it differs from the last one set."""
        if not self.lc.lr_warmup_steps:
            return
        lr = linear_warmup(self.lc.lr, step, self.lc.lr_warmup_steps)
        if lr != self.last:
            self.learners.call("set_lr", lr)
            self.last = lr

    def forget(self) -> None:
        """The ranks' lr changed behind this object's back (a checkpoint was loaded): set it at the next step."""
        self.last = None


def demonstration(row: PromptRow, tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids a warm start trains on after ``row``'s prompt, and which of them carry loss (1) or are context (0).

    ``meta["solution"]``: its text and EOS, all with loss. ``meta["solution_turns"]`` (a multi-turn episode's
    demonstration, plain mode): ``["assistant", text]`` turns with loss and ``["tool" | "user", content]`` replies
    without, each reply rendered and tokenized as the agent loop renders it (``rollout.chat_delta.reply_ids``),
    the last turn followed by EOS.

    Raises:
        KeyError: a row with neither.
        ValueError: a turn of another role.
    """
    eos = tokenizer.eos_token_id
    if "solution_turns" not in row.meta:
        ids = tokenizer(row.meta["solution"], add_special_tokens=False)["input_ids"] + [eos]
        return ids, [1] * len(ids)
    ids, mask = [], []
    for role, text in row.meta["solution_turns"]:
        if role == "assistant":
            part = tokenizer(text, add_special_tokens=False)["input_ids"]
        elif role in ("tool", "user"):
            part = reply_ids(tokenizer, [{"role": role, "content": text}], TurnEnd("stop"), chat=False)
        else:
            raise ValueError(f"row {row.uid}: a demonstration turn's role must be assistant, tool or user, "
                             f"got {role!r}")
        ids += part
        mask += [1 if role == "assistant" else 0] * len(part)
    return ids + [eos], mask + [1]


def warm_start(learners: LearnerGroup, cfg: Config, rows: list[PromptRow], tokenizer: Any, pad_id: int,
               rng: random.Random) -> dict[str, float]:
    """Supervised warm start: ``warm_start.steps`` cross-entropy steps on ``warm_start.batch_size`` rows drawn
    with ``rng`` (prompt, then the row's ``meta["solution"]`` and EOS as the target), then the optimizer is
    reset and the RL learning rate set. The weights are not synced here (the caller does).

    Returns:
        ``warm_start/loss_final``, ``warm_start/steps``, ``timing/warm_start_s``.

    Raises:
        KeyError: a row without ``meta["solution"]`` or ``meta["solution_turns"]`` (``demonstration``).
    """
    ws, lc = cfg.warm_start, cfg.learner
    t = time.perf_counter()
    losses: list[float] = []
    current_lr = None
    for s in range(ws.steps):
        batch_rows = [rng.choice(rows) for _ in range(ws.batch_size)]
        prompts = [r.prompt_token_ids for r in batch_rows]
        demos = [demonstration(r, tokenizer) for r in batch_rows]
        masks = [m for _, m in demos] if any("solution_turns" in r.meta for r in batch_rows) else None
        batch = build_sft_batch(prompts, [ids for ids, _ in demos], pad_id, masks)
        lr = linear_warmup(ws.lr, s, ws.warmup_steps)
        if lr != current_lr:  # one round trip to the ranks only when the schedule changes the lr
            learners.call("set_lr", lr, False)  # router_lr_scale acts in RL only
            current_lr = lr
        losses.append(learners.sft_step(batch, int(batch.loss_mask.sum())).loss)
        if (s + 1) % max(1, ws.steps // 10) == 0 or s + 1 == ws.steps:
            log.info("warm start %d/%d: loss %.4f", s + 1, ws.steps, losses[-1])
    learners.call("reset_optimizer_state")
    learners.call("set_lr", lc.lr)
    return {"warm_start/loss_final": losses[-1] if losses else float("nan"),
            "warm_start/steps": float(ws.steps), "timing/warm_start_s": time.perf_counter() - t}
