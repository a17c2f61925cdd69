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
from rollout.chat_delta import TurnEnd, chat_delta_ids, reply_ids
from rollout.contracts import PromptRow
from rollout.tool_calls import parse, stop_strings

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
        """Set 0-based RL ``step``'s learning rate when it differs from the last one set (so at least once per
        process, without a warmup too: a run resumed from a warm start's checkpoint with another ``learner.lr``,
        as gspo-compare's arms are, trains with its own lr, not the one the checkpoint's optimizer holds)."""
        lr = linear_warmup(self.lc.lr, step, self.lc.lr_warmup_steps)
        if lr != self.last:
            self.learners.call("set_lr", lr)
            self.last = lr

    def forget(self) -> None:
        """The ranks' lr changed behind this object's back (a checkpoint was loaded): set it at the next step."""
        self.last = None


def demonstration(row: PromptRow, tokenizer: Any, *, chat: bool = False, tools: list[dict] | None = None,
                  tool_format: str = "tag") -> tuple[list[int], list[int]]:
    """The ids a warm start trains on after ``row``'s prompt, and which of them carry loss (1) or are context (0).

    ``meta["solution"]``: its text and EOS, all with loss. ``meta["solution_turns"]`` (a multi-turn episode's
    demonstration): ``["assistant", text]`` turns with loss and ``["tool" | "user", content]`` replies without,
    laid out as the agent loop lays out an episode:

    * plain mode (``chat`` False: a tokenizer without a chat template): each reply rendered and tokenized as the
      loop renders it (``rollout.chat_delta.reply_ids``, plain), the last turn followed by EOS;
    * chat mode (``chat`` True; the prompt is ``episode_prompt_ids``): an assistant turn that ends with a closing
      tag of ``tool_format`` ends there (the engine stops on it), any other turn is followed by EOS (sampled,
      with loss); the replies after a turn are one delta of the chat template with ``tools``
      (``rollout.chat_delta.chat_delta_ids`` for the way the turn ended), each tool reply named after the turn's
      calls in order, as the environment names its replies.

    Raises:
        KeyError: a row with neither.
        ValueError: a turn of another role; (chat) a reply before the first assistant turn.
        rollout.chat_delta.ChatDeltaError: (chat) the template cannot render the replies.
    """
    eos = tokenizer.eos_token_id
    if "solution_turns" not in row.meta:
        ids = tokenizer(row.meta["solution"], add_special_tokens=False)["input_ids"] + [eos]
        return ids, [1] * len(ids)
    for role, _ in row.meta["solution_turns"]:
        if role not in ("assistant", "tool", "user"):
            raise ValueError(f"row {row.uid}: a demonstration turn's role must be assistant, tool or user, "
                             f"got {role!r}")
    if chat:
        return _chat_demonstration(row, tokenizer, tools, tool_format)
    ids, mask = [], []
    for role, text in row.meta["solution_turns"]:
        if role == "assistant":
            part = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            part = reply_ids(tokenizer, [{"role": role, "content": text}], TurnEnd("stop"), chat=False)
        ids += part
        mask += [1 if role == "assistant" else 0] * len(part)
    return ids + [eos], mask + [1]


def _chat_demonstration(row: PromptRow, tokenizer: Any, tools: list[dict] | None,
                        tool_format: str) -> tuple[list[int], list[int]]:
    """``demonstration`` in chat mode (see there)."""
    eos, stops = tokenizer.eos_token_id, stop_strings(tool_format)
    turns = row.meta["solution_turns"]
    ids: list[int] = []
    mask: list[int] = []
    i = 0
    while i < len(turns):
        role, text = turns[i]
        if role != "assistant":
            raise ValueError(f"row {row.uid}: a chat demonstration starts with an assistant turn, got {role!r}")
        part = tokenizer(text, add_special_tokens=False)["input_ids"]
        end = TurnEnd("stop") if any(text.endswith(s) for s in stops) else TurnEnd("eos", eos)
        if end.kind == "eos":
            part = part + [eos]
        ids += part
        mask += [1] * len(part)
        i += 1
        names = [c.name for c in parse(tool_format, text).calls]
        replies = []
        while i < len(turns) and turns[i][0] != "assistant":
            message = {"role": turns[i][0], "content": turns[i][1]}
            if message["role"] == "tool" and names:
                message["name"] = names.pop(0)
            replies.append(message)
            i += 1
        if replies:
            part = chat_delta_ids(tokenizer, tools, replies, end)
            ids += part
            mask += [0] * len(part)
    return ids, mask


def episode_prompt_ids(row: PromptRow, tokenizer: Any, tools: list[dict] | None) -> list[int]:
    """An episode's first ids in chat mode when its environment starts from the row's prompt (``env.tools``
    episodes do): the prompt as one user message through the chat template with the tools' schemas and the
    generation prompt, as the agent loop renders it."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": row.prompt}], tools=tools or None,
                                              add_generation_prompt=True, tokenize=True, return_dict=False))


def demo_layout(cfg: Config, tokenizer: Any) -> dict[str, Any] | None:
    """``demonstration``'s chat-mode keywords for this run (``chat``, ``tools``: the schemas of ``env.tools``,
    ``tool_format``), or None for plain mode (no env, or a tokenizer without a chat template).

    Raises:
        ValueError: a chat template with ``env.cls`` or ``env.openenv``: its first messages and tools come from the
            environment, which the warm start does not build (chat demonstrations are built for ``env.tools``
            episodes, which start from the row's prompt).
    """
    if not cfg.env.enabled or not getattr(tokenizer, "chat_template", None):
        return None
    if cfg.env.openenv.enabled:
        raise ValueError(f"warm_start.steps={cfg.warm_start.steps} with env.openenv and a chat template: the first "
                         "message and the tool come from the OpenEnv server, which the warm start does not reach; "
                         "set warm_start.steps=0")
    if cfg.env.cls is not None:
        raise ValueError(f"warm_start.steps={cfg.warm_start.steps} with env.cls={cfg.env.cls!r} and a chat template: "
                         "chat-template demonstrations are built for env.tools episodes only (their first message "
                         "is the row's prompt); set warm_start.steps=0 or use env.tools")
    from reward.environment import load_tools, tool_schemas

    return {"chat": True, "tools": tool_schemas(load_tools(cfg.env.tools)) or None,
            "tool_format": cfg.env.tool_format}


def warm_start(learners: LearnerGroup, cfg: Config, rows: list[PromptRow], tokenizer: Any, pad_id: int,
               rng: random.Random) -> dict[str, float]:
    """Supervised warm start: ``warm_start.steps`` cross-entropy steps on ``warm_start.batch_size`` rows drawn
    with ``rng`` (prompt, then the row's ``meta["solution"]`` and EOS as the target, or its multi-turn
    ``demonstration``; with env and a chat template, in the layout of its episode: ``demo_layout``), then the
    optimizer is reset and the RL learning rate set. The weights are not synced here (the caller does).

    Returns:
        ``warm_start/loss_final``, ``warm_start/steps``, ``timing/warm_start_s``.

    Raises:
        KeyError: a row without ``meta["solution"]`` or ``meta["solution_turns"]`` (``demonstration``).
        ValueError: as ``demo_layout`` or ``demonstration``.
    """
    ws, lc = cfg.warm_start, cfg.learner
    t = time.perf_counter()
    losses: list[float] = []
    current_lr = None
    layout = demo_layout(cfg, tokenizer) if ws.steps else None
    for s in range(ws.steps):
        batch_rows = [rng.choice(rows) for _ in range(ws.batch_size)]
        if layout is None:
            prompts = [r.prompt_token_ids for r in batch_rows]
            demos = [demonstration(r, tokenizer) for r in batch_rows]
        else:  # an episode's layout through the chat template, as the agent loop plays it
            prompts = [episode_prompt_ids(r, tokenizer, layout["tools"]) for r in batch_rows]
            demos = [demonstration(r, tokenizer, **layout) for r in batch_rows]
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
