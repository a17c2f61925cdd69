"""Saving RL steps for the offline ratio audit (``python -m learner.audit RUN_DIR --step N``).

Called by the driver for every step in ``trainer.audit_steps``: ``save_inputs`` before the learner trains on
the step's rollout batch (the behaviour weights are still loaded), ``save_outputs`` after.

Layout of ``RUN_DIR/audit/step_NNNNNNNN/`` (read by ``learner.audit``):

- ``batch.safetensors``: the ``TrainBatch`` tensors as the learner receives them (``input_ids``,
  ``attention_mask``, ``response_mask``, ``old_log_probs`` = the engines' behaviour log-probs, ``advantages``,
  ``rewards``, ``weight_versions``), ``learner_log_probs`` (float32 ``[N, L-1]``: the learner's own token
  log-probs at the behaviour weights, ``compute_log_probs`` on every rank, rank 0's result; 0 outside the
  response mask) and ``prompt_lengths`` (int64 ``[N]``, from the dataset rows, not from the batch; for a
  multi-turn episode, whose prompt is the environment's first messages as the engines were given them, the
  episode's own prompt). A step with episodes (docs/agents.md) also holds ``episode_response_mask`` (int8
  ``[N, R]``, ``R`` the longest response: per response token, 1 sampled by an engine, 0 the environment's, as
  the rollout reported it in ``Completion.response_mask``; -1 past the response and on rows that are single
  answers); a step of single answers does not.
- ``split.json``: per minibatch, the batch row indices each rank trained on and the global normalisers the
  driver passed (``num_sequences``, ``num_tokens``). The indices are the rank plans' own
  (``RankPlan.row_indices``).
- ``meta.json``: step, weight version, prompt uids and prompt token ids, and the objective's settings
  (algorithm, resolved clip range and loss aggregation, temperature, micro-batch size, world size, ...); with
  episodes also ``episode_prompt_token_ids`` (``{row index: ids}`` for the episodes whose prompt is not their
  dataset row's).
- ``model/``: the behaviour weights in Hugging Face format (``model.safetensors`` plus the config and tokenizer
  files of the run's model folder), loadable with ``AutoModelForCausalLM.from_pretrained``.
- ``metrics.json`` (``save_outputs``): what the learner returned for the step (``RolloutTrainResult.record``: the
  logged metrics and the per-length sums).
- ``gradient_first_step.safetensors`` (``save_outputs``): the full pre-clip gradient of the step's first
  optimizer step (the first minibatch, summed over ranks and micro-batches), recorded by the learner's
  ``capture_gradients`` hook, which ``save_inputs`` turns on and ``save_outputs`` off again.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from safetensors.torch import save_file

from cluster.config import Config
# The folder's file names are the audit tool's (one definition of the format).
from learner.audit import (
    BATCH_FILE,
    EPISODE_MASK_KEY,
    GRADIENT_FILE,
    META_FILE,
    METRICS_FILE,
    MODEL_SUBDIR,
    SPLIT_FILE,
    step_dir_for,
)
from learner.objectives import resolve_objective

if TYPE_CHECKING:
    from cluster.runtime.learner_group import LearnerGroup
    from rollout.contracts import Completion, PromptRow

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

# Files of the model folder that are weights (not copied: the behaviour weights are written instead).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".msgpack", ".h5")


def split_indices(batch: Any, plans: list[Any]) -> list[dict[str, Any]]:
    """The rows of ``batch`` that every rank receives for every minibatch, with the driver's normalisers.

    Args:
        batch: the step's ``TrainBatch`` (N rows).
        plans: ``cluster.driver.batching.RankPlan`` per rank (``row_indices[m]`` are the rows of its shard of
            minibatch ``m``).

    Returns:
        One dict per minibatch: ``{"ranks": [[row indices of rank 0], ...], "num_sequences": S, "num_tokens":
        T}`` (``S`` and ``T`` as passed to every rank; ``num_sequences_per_rank`` / ``num_tokens_per_rank``
        hold each rank's value when they differ).

    Raises:
        ValueError: ranks with different numbers of minibatches, or a row index outside ``batch``.
    """
    counts = {len(p.row_indices) for p in plans}
    if len(counts) != 1:
        raise ValueError(f"ranks have different numbers of minibatches: {sorted(counts)}")
    out = []
    for m in range(counts.pop()):
        ranks = [[int(i) for i in plan.row_indices[m]] for plan in plans]
        if any(not 0 <= i < len(batch) for rows in ranks for i in rows):
            raise ValueError(f"minibatch {m}: a row index outside the step's {len(batch)} rows")
        entry: dict[str, Any] = {
            "ranks": ranks,
            "num_sequences": int(plans[0].num_sequences[m]),
            "num_tokens": int(plans[0].num_tokens[m]),
        }
        per_seq = [int(p.num_sequences[m]) for p in plans]
        per_tok = [int(p.num_tokens[m]) for p in plans]
        if len(set(per_seq)) > 1 or len(set(per_tok)) > 1:
            entry["num_sequences_per_rank"], entry["num_tokens_per_rank"] = per_seq, per_tok
        out.append(entry)
    return out


def episode_response_masks(completions: Sequence[Completion]) -> torch.Tensor | None:
    """The episodes' sampled-token masks as the rollout reported them (``Completion.response_mask``).

    Returns:
        int8 ``[N, R]`` (``R``: the longest response, at least 1): row ``i``'s response token ``j`` is 1 when an
        engine sampled it, 0 when the environment's reply put it there; -1 past the response and on the rows of
        single answers (``response_mask`` None). None when no completion is an episode.
    """
    if all(c.response_mask is None for c in completions):
        return None
    width = max([max(len(c.response_token_ids), len(c.response_mask or ())) for c in completions] + [1])
    out = torch.full((len(completions), width), -1, dtype=torch.int8)
    for i, c in enumerate(completions):
        if c.response_mask is not None and len(c.response_mask):
            out[i, : len(c.response_mask)] = torch.tensor([1 if v else 0 for v in c.response_mask], dtype=torch.int8)
    return out


def prompt_ids_by_row(prompt_uids: Sequence[str], train_rows: Sequence[PromptRow],
                      completions: Sequence[Completion] | None) -> tuple[list[int], dict[str, list[int]],
                                                                         dict[str, list[int]]]:
    """The prompts the audit rebuilds the response mask from.

    A row's prompt is its dataset row's (by uid); an episode's (``response_mask`` set) is its own
    ``prompt_token_ids``, the environment's first messages as the engines were given them (the dataset row's for
    a tokenizer without a chat template that starts from the row's prompt).

    Args:
        prompt_uids: the batch's N uids; train_rows: the dataset's rows; completions: the N completions in
            batch order, or None.

    Returns:
        ``(lengths, by_uid, episode_prompts)``: prompt length per row (-1: unknown), the dataset rows' prompt
        ids by uid, and ``{str(row): ids}`` for episodes whose prompt is not their dataset row's.
    """
    rows = {r.uid: r for r in train_rows}
    by_uid = {uid: list(rows[uid].prompt_token_ids) for uid in prompt_uids if uid in rows}
    lengths: list[int] = []
    episode_prompts: dict[str, list[int]] = {}
    for i, uid in enumerate(prompt_uids):
        c = completions[i] if completions is not None else None
        if c is not None and c.response_mask is not None:
            ids = list(c.prompt_token_ids)
            if ids != by_uid.get(uid):
                episode_prompts[str(i)] = ids
            lengths.append(len(ids))
        else:
            lengths.append(len(by_uid[uid]) if uid in by_uid else -1)  # unknown: mask alignment not checkable
    return lengths, by_uid, episode_prompts


def _check_completions(batch: Any, completions: Sequence[Completion]) -> None:
    """Raises ValueError unless ``completions`` are the batch's rows in order (same count and uids)."""
    if [c.prompt_uid for c in completions] != list(batch.prompt_uids):
        raise ValueError(f"{len(completions)} completions are not the batch's {len(batch)} rows in order")


def _objective_settings(cfg: Config) -> dict[str, Any]:
    lc = cfg.learner
    obj = resolve_objective(lc.algorithm, lc.clip_low, lc.clip_high, lc.loss_agg, lc.loss_options)
    return {
        "algorithm": lc.algorithm,
        "clip_low": obj.clip_low,
        "clip_high": obj.clip_high,
        "loss_agg": obj.loss_agg,
        "norm_length": lc.loss_options.get("norm_length"),  # Dr. GRPO's constant (the config sets it)
        "temperature": float(cfg.rollout.temperature),
        "micro_batch_size": int(lc.micro_batch_size),
        "world_size": int(lc.world_size),
        "num_minibatches": int(lc.num_minibatches),
        "ppo_epochs": int(lc.ppo_epochs),
        "old_logprob_source": lc.old_logprob_source,
        "kl_coef": float(lc.kl_coef),
        "zero_stage": int(lc.zero_stage),
        "learner_dtype": lc.dtype,
        "rollout_dtype": cfg.rollout.dtype,
        "routing_replay": getattr(lc, "routing_replay", "off") != "off",  # off / learner / rollout
        "config_clip_low": lc.clip_low,
        "config_clip_high": lc.clip_high,
        "config_loss_agg": lc.loss_agg,
    }


def _save_behaviour_weights(learners: LearnerGroup, model_path: str | Path, out: Path) -> None:
    """Full weights from the learner ranks (collective: every rank exports, rank 0 returns them) in Hugging
    Face checkpoint format, plus the config and tokenizer files of the run's model folder ``model_path``."""
    state = learners.call("checkpoint_state_dict")[0]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    src = Path(model_path)
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, out / f.name)


def save_inputs(cfg: Config, run_dir: Path, learners: LearnerGroup, step: int, batch: Any, plans: list[Any], *,
                model_path: str | Path, train_rows: Sequence[PromptRow], weight_version: int,
                completions: Sequence[Completion] | None = None) -> Path:
    """Save what step ``step`` trains on and the weights that generated it; returns the step's audit folder.

    Must run before the learner trains on ``batch`` (its weights are then the behaviour weights the rollout
    engines sampled with). Collective on the learner ranks (``compute_log_probs`` and ``checkpoint_state_dict`` are
    called on all of them).

    Args:
        cfg: the run config (the objective's settings, ``trainer.seed`` and ``trainer.group_size``).
        run_dir: the run folder; the step's audit folder goes under its ``audit/``.
        learners: the learner ranks (``compute_log_probs``, ``checkpoint_state_dict``, ``capture_gradients``).
        step: the 1-based RL step.
        batch: the step's ``TrainBatch``.
        plans: the ``RankPlan`` list the learner ranks receive.
        model_path: the run's model folder (its config and tokenizer files are copied beside the weights).
        train_rows: the training prompts (their prompt token ids by uid: ``prompt_lengths``, ``meta.json``).
        weight_version: the weight version the engines sampled the step's rollout with.
        completions: the N completions ``batch`` was built from, in its row order (their episodes' sampled-token
            masks and prompts are saved: ``episode_response_masks``, ``prompt_ids_by_row``); None: single answers.

    Raises:
        ValueError: the plans do not hold rows of ``batch``, or ``completions`` are not its rows in order.
    """
    if completions is not None:
        _check_completions(batch, completions)
    out = step_dir_for(run_dir, step)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    split = split_indices(batch, plans)

    # The learner's own log-probs at the behaviour weights (all ranks take part; rank 0's result).
    lps = learners.call("compute_log_probs", batch)
    learner_lp = lps[0].to(torch.float32)

    lengths, prompts, episode_prompts = prompt_ids_by_row(batch.prompt_uids, train_rows, completions)
    tensors = {
        "input_ids": batch.input_ids.to(torch.int64),
        "attention_mask": batch.attention_mask.to(torch.int64),
        "response_mask": batch.response_mask.to(torch.bool),
        "old_log_probs": batch.old_log_probs.to(torch.float32),
        "advantages": batch.advantages.to(torch.float32),
        "rewards": batch.rewards.to(torch.float32),
        "weight_versions": batch.weight_versions.to(torch.int64),
        "learner_log_probs": learner_lp,
        "prompt_lengths": torch.tensor(lengths, dtype=torch.int64),
    }
    episodes = episode_response_masks(completions) if completions is not None else None
    if episodes is not None:
        tensors[EPISODE_MASK_KEY] = episodes
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / BATCH_FILE))
    (out / SPLIT_FILE).write_text(json.dumps({"minibatches": split, "seed": int(cfg.trainer.seed + step - 1)},
                                             indent=1) + "\n")
    meta = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "weight_version": int(weight_version),
        "model_path": str(model_path),
        "objective": _objective_settings(cfg),
        "prompt_uids": list(batch.prompt_uids),
        "prompt_token_ids": prompts,
        "group_size": int(cfg.trainer.group_size),
    }
    if episodes is not None:
        meta["episode_prompt_token_ids"] = episode_prompts
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    _save_behaviour_weights(learners, model_path, out / MODEL_SUBDIR)
    # Record the gradient of every optimizer step of this call (read and switched off by save_outputs).
    learners.call("capture_gradients", True)
    log.info("audit: step %d saved to %s (%d sequences)", step, out, len(batch))
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if hasattr(v, "item") and callable(v.item):
        try:
            return _jsonable(v.item())
        except (ValueError, RuntimeError):
            return str(v)
    return v


def save_outputs(learners: LearnerGroup | None, audit_dir: Path, metrics: Mapping[str, Any]) -> None:
    """Save what the learner returned for the step (``metrics``: ``RolloutTrainResult.record()``) as
    ``metrics.json``, and the gradient of the step's first optimizer step (captured on the ``learners`` ranks
    since ``save_inputs``; the capture is switched off again on every rank). ``learners`` None: the metrics
    alone. Under ``learner.old_logprob_source=auto`` the objective in ``meta.json`` gets the source the step
    used (``actor/old_logprob_recomputed``: ``recompute`` or ``rollout``), which the audit recomputes with."""
    audit_dir = Path(audit_dir)
    audit_dir.mkdir(parents=True, exist_ok=True)
    (audit_dir / METRICS_FILE).write_text(json.dumps(_jsonable(dict(metrics)), indent=1) + "\n")
    meta_file = audit_dir / META_FILE
    if "actor/old_logprob_recomputed" in metrics and meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if meta["objective"].get("old_logprob_source") == "auto":
            meta["objective"]["old_logprob_source"] = ("recompute" if metrics["actor/old_logprob_recomputed"]
                                                       else "rollout")
            meta_file.write_text(json.dumps(meta, indent=1) + "\n")
    if not learners:
        return
    steps = learners.call("captured_gradients")[0]
    learners.call("capture_gradients", False)
    if steps:
        grads = {k: v.contiguous() for k, v in steps[0].items() if v is not None}
        save_file(grads, str(audit_dir / GRADIENT_FILE))
