"""Checkpoint folders written atomically: everything goes into ``step_NNNNNNNN.tmp``, a ``COMPLETE`` marker is
written last, then the folder is renamed. A folder without the marker (a crash mid-write) is never picked as
the latest and is removed on the next save."""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cluster.config import Config, ConfigError
from learner.loss_settings import BUILTIN_LOSSES, GENERIC_KEYS, build_settings

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def temp_dir_for(run_dir: Path, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of ``step`` (any leftover of a crash is removed)."""
    tmp = checkpoint_root(run_dir) / f"step_{step:08d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finalize(run_dir: Path, tmp: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write the trainer state and the marker into ``tmp``, fsync, rename it to ``step_NNNNNNNN`` and prune
    old checkpoints down to ``keep``. Returns the final folder."""
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / MARKER, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    final = checkpoint_root(run_dir) / f"step_{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first (a folder counts only with its ``COMPLETE`` marker)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MARKER).is_file() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def read_state(ckpt: Path) -> dict[str, Any]:
    """The trainer state saved with a checkpoint.

    Raises:
        ValueError: the state file is unreadable (names the file).
    """
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint state {str(ckpt / STATE_FILE)!r} is unreadable: {e}") from e


# ------------------------------------------------------------------------------------------ resume checks

# Keys a resumed run may change: how much hardware runs the services, where and how often it logs, evaluates
# and saves, how far it goes, the health guard's thresholds (the way out of a health stop), and the warm start
# (it runs only before the first checkpoint). A dotted key, or a section prefix ending in ".". Changes are logged.
RESUME_FREE = (
    "rollout.num_engines", "rollout.num_cpus_per_engine", "rollout.num_gpus_per_engine",
    "rollout.tensor_parallel_size", "rollout.threads_per_engine", "rollout.gpu_memory_utilization",
    "rollout.kv_cache_gb", "rollout.enforce_eager", "rollout.in_process", "rollout.pieces_per_engine",
    "reward.num_workers", "reward.num_cpus_per_worker", "reward.parallel_calls", "reward.calls_per_child",
    "reward.isolated_verifiers", "reward.inline_verifiers", "reward.preload", "reward.sandbox.backend",
    "reward.sandbox.tmp_root",
    "learner.num_cpus_per_rank", "learner.num_gpus_per_rank", "learner.threads_per_rank", "learner.cpu_shm_allreduce",
    "learner.dist_timeout_s", "learner.moe_diagnostics", "learner.pre_update_pass", "learner.gradient_checkpointing",
    "rollout.node_resources", "reward.node_resources", "learner.node_resources",
    "trainer.total_steps", "trainer.eval_every", "trainer.save_every", "trainer.keep_checkpoints",
    "trainer.audit_steps", "trainer.output_dir", "trainer.run_name", "trainer.resume", "trainer.ray_address",
    "trainer.bind_host", "trainer.plots",
    "model.num_params_b", "model.shape", "warm_start.", "sync.", "health.", "cluster.", "wandb.",
    "precision",  # the switch itself: the keys it sets (rollout.dtype, learner.dtype, ...) are compared
    "distill.num_engines", "distill.num_cpus_per_engine", "distill.node_resources", "distill.threads_per_engine",
    "distill.kv_cache_gb", "distill.timeout_s",  # the teacher's engines (its model and signal: RL only, below)
)
# Keys that act only from the first RL step on (the objective, the rollout batch and its sampling, the reward):
# free to change on a checkpoint written before any RL step (a warm start: cluster/compare/runs.py resumes every
# algorithm from one), refused on a later one.
RESUME_RL_ONLY = (
    "learner.algorithm", "learner.clip_low", "learner.clip_high", "learner.loss_agg", "learner.loss_options",
    "learner.num_minibatches", "learner.ppo_epochs", "learner.lr", "learner.kl_coef", "learner.kl_estimator",
    "learner.normalize_adv_std",
    "learner.old_logprob_source", "learner.max_rollout_logprob_gap", "learner.routing_replay", "learner.rollout_correction",
    "learner.rollout_correction_low", "learner.rollout_correction_high", "rollout.return_routed_experts",
    "trainer.prompts_per_step", "trainer.group_size", "trainer.dynamic_sampling", "trainer.max_sampling_rounds",
    "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.max_response_tokens", "rollout.max_model_len",
    "rollout.dtype", "rollout.seed", "reward.", "distill.",
)
# Every other key is refused when it differs: the model, the learner's partitioning, dtype, batch split and
# optimizer (the restored state was built with them), trainer.seed (the restored stream position indexes the
# old seed's prompt order) and the data, which is compared by its fingerprint (data_fingerprint).


class ResumeMismatch(ConfigError):
    """The new config differs from the checkpoint's where resuming could not continue the same run; the
    message names every such key with both values."""


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def mapping_fields(model: type[BaseModel] = Config, prefix: str = "") -> frozenset[str]:
    """Dotted paths of the config's free-form mapping fields (``dict[...]``, ``Mapping[...]``, e.g.
    ``learner.loss_options``), which the resume check compares as whole values: an entry added to or removed
    from one is a change, not a key that one side lacks."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        members = typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union \
            else (ann,)
        for member in members:
            origin = typing.get_origin(member) or member
            if isinstance(origin, type) and issubclass(origin, collections.abc.Mapping):
                out.add(f"{prefix}{name}")
            elif isinstance(member, type) and issubclass(member, BaseModel):
                out |= mapping_fields(member, f"{prefix}{name}.")
    return frozenset(out)


def _flatten(tree: dict[str, Any], prefix: str = "", whole: frozenset[str] | None = None) -> dict[str, Any]:
    """``tree``'s leaves by dotted key; the paths in ``whole`` (default ``mapping_fields()``) stay one value."""
    whole = mapping_fields() if whole is None else whole
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in whole:
            out.update(_flatten(v, f"{prefix}{k}.", whole))
        else:
            out[f"{prefix}{k}"] = v
    return out


def effective_loss_settings(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` (a flattened config) with a built-in loss's settings as the loss will use them: ``learner.clip_low``,
    ``clip_high`` and ``loss_agg`` with null replaced by the loss's default, and ``learner.loss_options`` holding
    every other field of its settings (``learner.loss_settings.build_settings``). So a setting written out at its
    default is the same setting as one left out. A user's loss (``module:function``), or settings that do not
    build (a checkpoint from older code), stay as written."""
    algorithm = flat.get("learner.algorithm")
    if algorithm not in BUILTIN_LOSSES:
        return flat
    generic = {k: flat.get(f"learner.{k}") for k in GENERIC_KEYS}
    try:
        built = dataclasses.asdict(build_settings(algorithm, BUILTIN_LOSSES[algorithm], generic,
                                                  flat.get("learner.loss_options") or {}))
    except (ValueError, TypeError):
        return flat
    out = dict(flat)
    out.update({f"learner.{k}": built[k] for k in GENERIC_KEYS if k in built})
    out["learner.loss_options"] = {k: v for k, v in built.items() if k not in GENERIC_KEYS}
    return out


def data_fingerprint(rows: list[Any]) -> dict[str, Any]:
    """A fingerprint of the training rows in order: their count and the SHA-256 of each row's uid, prompt,
    prompt token ids, answer, verifier and meta.

    The rows' content rather than the files' paths, sizes and mtimes: it catches what changes the prompt stream
    (an edited or other file, ``data.num_train``, ``data.max_prompt_tokens``, the tokenizer, the arithmetic
    seed) and ignores what does not (a file copied or moved, a touched mtime). Uids alone would not do: GSM8K
    rows are numbered by line.

    Args:
        rows: the training ``PromptRow`` list the run's ``PromptStream`` is built from.
    """
    h = hashlib.sha256()
    for r in rows:
        rec = [r.uid, r.prompt, list(r.prompt_token_ids), r.answer, r.verifier, r.meta]
        h.update(json.dumps(rec, sort_keys=True, default=str).encode())
        h.update(b"\n")
    return {"rows": len(rows), "sha256": h.hexdigest()}


def read_learner_state(ckpt: Path) -> dict[str, Any] | None:
    """``learner/learner_state.json`` of a checkpoint (world size, ZeRO stage, optimizer steps), or None."""
    from learner.checkpoint import STATE_FILE as LEARNER_STATE

    try:
        return json.loads((ckpt / "learner" / LEARNER_STATE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def check_resume(saved: dict[str, Any], cfg: Config, fingerprint: dict[str, Any] | None,
                 learner_state: dict[str, Any] | None = None) -> list[str]:
    """Compare a checkpoint's driver state with the config of the run that resumes from it.

    Refused: a different learner world size or ZeRO stage (``learner_state.json``, else the saved config),
    trainer.seed, training data (``data_fingerprint``; the ``data.*`` keys themselves only when the checkpoint
    has no fingerprint), model, learner dtype, micro-batch size or optimizer settings (a checkpoint from before
    ``learner.offload_optimizer`` counts as 'none'); after the first RL step
    also the algorithm and its objective, the rollout batch, sampling and reward (``RESUME_RL_ONLY``). Free,
    with a log line: resources, logging, schedule length, health guard (``RESUME_FREE``). Mapping fields
    (``learner.loss_options``, ``*.node_resources``: ``mapping_fields``) are compared as whole values, and a
    built-in loss's settings as the loss uses them (``effective_loss_settings``: a default written out is no
    change).

    Args:
        saved: ``read_state`` of the checkpoint (``step``, ``config``, ``data_fingerprint``).
        cfg: the new run's config.
        fingerprint: ``data_fingerprint`` of the new run's training rows (None: not compared).
        learner_state: ``read_learner_state`` of the checkpoint, or None.

    Returns:
        One line per allowed change (also logged), for example ``"rollout.num_engines: 1 -> 2 (free)"``.

    Raises:
        ResumeMismatch: names every refused key with the checkpoint's and the config's value.
    """
    step = int(saved.get("step", 0))
    old = effective_loss_settings(_flatten(saved.get("config") or {}))
    new = effective_loss_settings(_flatten(cfg.model_dump(mode="json")))
    if old.get("reward.max_response_tokens") is None and "rollout.max_response_tokens" in old:
        old["reward.max_response_tokens"] = old["rollout.max_response_tokens"]  # unset meant the rollout's
    if old and "learner.offload_optimizer" not in old:
        old["learner.offload_optimizer"] = "none"  # before the key: torch's AdamW state, which CPU Adam cannot load
    refused: dict[str, str] = {}
    notes: list[str] = []
    if not old:
        notes.append("checkpoint holds no config: settings not compared")
    for key, why in (("world_size", "the ranks' optimizer partitions and minibatch split"),
                     ("zero_stage", "the layout of the saved optimizer state")):
        if learner_state and key in learner_state and learner_state[key] != getattr(cfg.learner, key):
            refused[f"learner.{key}"] = (f"checkpoint {learner_state[key]!r} (learner_state.json), config "
                                         f"{getattr(cfg.learner, key)!r}: {why}")
    same_data = None
    saved_fp = saved.get("data_fingerprint")
    if saved_fp and fingerprint:
        same_data = saved_fp == fingerprint
        if not same_data:
            changed = [f"data.{k.split('.', 1)[1]}={new[k]!r} (checkpoint {old[k]!r})" for k in sorted(new)
                       if k.startswith("data.") and k in old and old[k] != new[k]]
            refused["data"] = (f"checkpoint {saved_fp['rows']} training rows sha256 {saved_fp['sha256'][:12]}, "
                               f"config {fingerprint['rows']} rows sha256 {fingerprint['sha256'][:12]}"
                               + (f" ({', '.join(changed)})" if changed else " (same data keys: the files changed)"))
    elif old:
        notes.append(f"{'checkpoint' if not saved_fp else 'config'} has no data fingerprint: data compared by its "
                     "data.* keys only")
    for key in sorted(set(old) | set(new)):
        if key not in old or key not in new:
            notes.append(f"{key}: only in the {'config' if key in new else 'checkpoint'}, not compared")
            continue
        if old[key] == new[key] or key in refused:
            continue
        change = f"{key}: {old[key]!r} -> {new[key]!r}"
        if _matches(key, RESUME_FREE) or (key.startswith("data.") and same_data):
            notes.append(f"{change} (free to change on resume)")
        elif _matches(key, RESUME_RL_ONLY) and step == 0:
            notes.append(f"{change} (the checkpoint is from before the first RL step)")
        elif not key.startswith("data.") or same_data is None:
            refused[key] = f"checkpoint {old[key]!r}, config {new[key]!r}"
    for line in notes:
        log.info("resume: %s", line)
    if refused:
        lines = "\n".join(f"  {k}: {v}" for k, v in refused.items())
        raise ResumeMismatch(
            f"cannot resume from the step-{step} checkpoint: the config differs where the resumed run could not "
            f"continue the same run:\n{lines}\nUse the checkpoint's values, or start a new run (another "
            "trainer.run_name, or trainer.resume=false)."
        )
    return notes
