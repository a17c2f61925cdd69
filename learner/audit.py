"""Offline ratio audit: ``python -m learner.audit RUN_DIR --step N [--tolerance X] [--json PATH]``.

Loads a step saved by the driver (``trainer.audit_steps``, see ``cluster/driver/audit_dump.py`` for the folder
layout), recomputes the token log-probs at the behaviour weights with a plain transformers forward in float64
(one sequence at a time, no padding), and checks, with its own masking and normalisation code (nothing from
``learner.objectives``, ``learner.logprobs`` or ``cluster.driver.batching``):

- ``mask_alignment``: the saved response mask against the one rebuilt from the prompt lengths of the dataset
  rows and the attention mask (target ``t`` predicts token ``t + 1``); also the prompt tokens themselves. For a
  multi-turn episode (docs/agents.md) the rebuilt mask keeps only the tokens the engines sampled, from the
  episode's own sampled-token mask as saved from the rollout (``episode_response_mask``): the environment's
  reply tokens are context, not response; ``episode_mask_length``: that mask covers exactly the response.
- ``length_normalisation``: per sequence, response tokens in the saved mask vs the rebuilt response length
  (the ``|y_i|`` of GSPO's Eq. 7; an episode's sampled tokens).
- ``behaviour_log_probs`` / ``learner_log_probs``: float64 token log-probs vs the engine's behaviour log-probs
  and vs the learner's own pre-update log-probs, on the saved response mask (an episode's environment tokens,
  which carry log-prob 0.0 from the engines, are outside it; a saved mask that takes them in fails here too).
- ``sequence_log_ratio``: GSPO's ``log s_i = (1/|y_i|) sum_t (log pi - log pi_old)`` (Eq. 7) from the audit's
  log-probs and lengths vs from the learner's log-probs and the saved mask.
- ``minibatch_split`` and ``normalisers``: every row trained once per epoch, equal shards, and the global
  normalisers (sequences with a response token, response tokens) of every minibatch.
- ``logprob_diff_metric``, ``entropy``, ``num_response_tokens``: the learner's logged pre-update metrics over
  the whole batch.
- ``loss_first_minibatch``, ``gradient_first_minibatch``, ``ratio_statistics``, ``clip_fraction``: the first
  minibatch is on-policy (the learner still holds the behaviour weights), so its loss and gradient, summed
  over ranks and micro-batches by training, are computable here over the whole minibatch at once.

Differences above ``--tolerance`` (absolute, in nats for log-probs and in loss units; relative for gradients;
counts must match exactly) fail the audit: it prints a table of the largest differences and exits 1. Exit 2:
the step folder is missing or incomplete.

This module loads the step folder, runs the phases in order and reports; the audit's own math and each phase's
checks are in ``learner/audit_checks.py`` and, for the response mask, ``learner/audit_masks.py`` (the math is
re-exported here).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# The audit's own math and its checks (the mask phase: learner.audit_masks); the math is re-exported
# (learner.audit.policy_objective, learner.audit.expected_response_mask etc.).
from learner.audit_checks import (
    EPISODE_MASK_KEY,
    LOG_RATIO_BAND,
    PER_STEP_LOSS_KEY,
    Check,
    SavedBatch,
    _skip,
    first_minibatch_checks,
    first_minibatch_objective,
    gradient_check,
    largest_token_differences,
    log_prob_checks,
    policy_objective,
    pre_update_metric_checks,
    recompute_log_probs,
    row_log_probs,
    sequence_log_ratios,
    split_checks,
)
from learner.audit_masks import episode_lengths, expected_response_mask, mask_checks, sampled_target_mask

DEFAULT_TOLERANCE = 1e-4

# The step folder's layout (written by cluster/driver/audit_dump.py).
BATCH_FILE = "batch.safetensors"
SPLIT_FILE = "split.json"
META_FILE = "meta.json"
METRICS_FILE = "metrics.json"
GRADIENT_FILE = "gradient_first_step.safetensors"
MODEL_SUBDIR = "model"


class AuditInputError(ValueError):
    """The step folder is missing or incomplete (the message names the path)."""


# ---------------------------------------------------------------------------------------------------------
# loading


@dataclass
class StepData:
    """A saved step (see ``cluster/driver/audit_dump.py``)."""

    step_dir: Path
    tensors: dict[str, Tensor]
    split: list[dict[str, Any]]
    meta: dict[str, Any]
    metrics: dict[str, Any] | None
    gradient: dict[str, Tensor] | None = None

    @property
    def objective(self) -> dict[str, Any]:
        return self.meta["objective"]


def step_dir_for(run_dir: Path, step: int) -> Path:
    """``run_dir/audit/step_NNNNNNNN`` (``step`` 1-based, as logged): where the driver saves an audit step."""
    return Path(run_dir) / "audit" / f"step_{int(step):08d}"


def load_step(step_dir: Path) -> StepData:
    """Read a saved step.

    Raises:
        AuditInputError: a missing file or folder (named), or a batch without the expected tensors.
    """
    from safetensors.torch import load_file

    step_dir = Path(step_dir)
    for name in (BATCH_FILE, SPLIT_FILE, META_FILE, MODEL_SUBDIR):
        if not (step_dir / name).exists():
            raise AuditInputError(f"{str(step_dir / name)!r} does not exist: not a complete audit step folder")
    tensors = load_file(str(step_dir / BATCH_FILE))
    needed = ("input_ids", "attention_mask", "response_mask", "old_log_probs", "advantages", "learner_log_probs",
              "prompt_lengths")
    missing = [k for k in needed if k not in tensors]
    if missing:
        raise AuditInputError(f"{str(step_dir / BATCH_FILE)!r} lacks tensors {missing}")
    split = json.loads((step_dir / SPLIT_FILE).read_text())["minibatches"]
    meta = json.loads((step_dir / META_FILE).read_text())
    metrics = json.loads((step_dir / METRICS_FILE).read_text()) if (step_dir / METRICS_FILE).is_file() else None
    gradient = load_file(str(step_dir / GRADIENT_FILE)) if (step_dir / GRADIENT_FILE).is_file() else None
    return StepData(step_dir, tensors, split, meta, metrics, gradient)


def load_model(model_dir: Path, dtype: torch.dtype = torch.float64):
    """The behaviour policy as a plain transformers model in ``dtype``, eval mode. MoE experts use the eager
    (per-expert loop) implementation: the grouped kernels do not take float64."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, experts_implementation="eager")
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.config.use_cache = False
    return model.eval()


# ---------------------------------------------------------------------------------------------------------
# the audit: its phases in order (each in learner/audit_masks.py or learner/audit_checks.py)


@dataclass
class AuditResult:
    checks: list[Check]
    tokens: list[dict[str, Any]] = field(default_factory=list)  # largest token-level differences
    header: str = ""

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.failed]


def run_audit(step_dir: Path, tolerance: float = DEFAULT_TOLERANCE, *, top: int = 10, model=None) -> AuditResult:
    """Recompute a saved step and compare it with what training used and logged.

    Args:
        step_dir: ``RUN_DIR/audit/step_NNNNNNNN``.
        tolerance: absolute tolerance of the continuous checks (nats, loss units); relative for gradients.
        top: token-level differences listed.
        model: the behaviour model (default: loaded from ``step_dir/model`` in float64).

    Returns:
        The checks (failed, ok and skipped ones) and the largest token-level differences.

    Raises:
        AuditInputError: an incomplete step folder.
    """
    data = load_step(step_dir)
    obj = data.objective
    temperature = float(obj["temperature"])
    batch = SavedBatch.from_tensors(data.tensors)

    # masks rebuilt from the dataset's prompt lengths and the attention mask
    mask, lengths, checks = mask_checks(batch, data.meta)
    # float64 recompute at the behaviour weights: token log-probs and GSPO sequence log-ratios
    if model is None:
        model = load_model(data.step_dir / MODEL_SUBDIR)
    audit_lp, entropy = recompute_log_probs(model, batch, temperature)
    checks += log_prob_checks(batch, audit_lp, mask, lengths, tolerance)
    # the driver's minibatch x rank split and normalisers
    checks += split_checks(data.split, obj, mask)
    # metrics the learner logged from its pre-update pass (whole batch)
    checks += pre_update_metric_checks(data.metrics, batch, audit_lp, entropy, mask, tolerance)
    # the first minibatch: on-policy, so its loss and gradient are computable here
    if data.split:
        with_grad = data.gradient is not None
        loss, stats = first_minibatch_objective(data.split[0], obj, model, batch, mask, temperature,
                                                with_grad=with_grad)
        checks += first_minibatch_checks(loss, stats, data.metrics, tolerance)
        checks.append(gradient_check(model, data.gradient, tolerance) if with_grad
                      else _skip("gradient_first_minibatch", f"no {GRADIENT_FILE} (gradient capture off)"))
        model.zero_grad(set_to_none=True)
    else:
        checks.append(_skip("loss_first_minibatch", "no minibatch in split.json"))

    tokens = largest_token_differences(batch, audit_lp, mask, top)
    n = mask.shape[0]
    header = (f"audit of step {data.meta.get('step')} ({data.step_dir}): {obj['algorithm']}, clip "
              f"[1-{obj['clip_low']}, 1+{obj['clip_high']}], loss_agg {obj['loss_agg']}, temperature {temperature}, "
              f"{obj['world_size']} rank(s), {len(data.split)} minibatch(es), micro-batch {obj['micro_batch_size']}, "
              f"{n} sequences, {int(mask.sum())} response tokens" + _episodes_note(batch))
    return AuditResult(checks, tokens, header)


def _episodes_note(batch: SavedBatch) -> str:
    """The header's note on multi-turn episodes (empty for single answers)."""
    if batch.sampled is None:
        return ""
    k = int((episode_lengths(batch.sampled) >= 0).sum())
    return f" ({k} multi-turn episodes: the engines' sampled tokens only)"


# ---------------------------------------------------------------------------------------------------------
# report


def format_report(result: AuditResult, tolerance: float) -> str:
    """The checks (failed first, then by difference relative to the tolerance) and the token table."""

    def rank(c: Check) -> tuple:
        order = {"FAIL": 0, "ok": 1, "skipped": 2}[c.status]
        rel = c.diff / c.tolerance if c.tolerance > 0 and math.isfinite(c.diff) else (c.diff if math.isfinite(c.diff) else 0)
        return (order, -rel)

    lines = [result.header, ""]
    lines.append(f"{'check':<26} {'status':<8} {'max diff':>11} {'tolerance':>10}  where")
    lines.append("-" * 100)
    for c in sorted(result.checks, key=rank):
        diff = "-" if c.status == "skipped" else (f"{c.diff:.0f}" if c.exact and math.isfinite(c.diff) else f"{c.diff:.3e}")
        tol = "-" if c.status == "skipped" else ("exact" if c.exact else f"{c.tolerance:.1e}")
        text = c.where if c.status != "skipped" else c.note
        if c.note and c.status != "skipped":
            text = f"{text} [{c.note}]"
        lines.append(f"{c.name:<26} {c.status:<8} {diff:>11} {tol:>10}  {text}")
    if result.tokens:
        lines += ["", "largest token-level differences (log-probs, nats):",
                  f"{'row':>4} {'target':>6} {'token':>6} {'saved':>5} {'expect':>6} {'audit':>12} {'engine':>12} "
                  f"{'learner':>12} {'|a-e|':>9} {'|a-l|':>9}"]
        for r in result.tokens:
            lines.append(
                f"{r['row']:>4} {r['target']:>6} {r['token']:>6} {int(r['saved_mask']):>5} {int(r['expected_mask']):>6} "
                f"{r['audit']:>12.6f} {r['engine']:>12.6f} {r['learner']:>12.6f} "
                f"{abs(r['audit'] - r['engine']):>9.2e} {abs(r['audit'] - r['learner']):>9.2e}"
            )
    failed = result.failed
    lines.append("")
    if failed:
        lines.append(f"audit FAILED: {len(failed)} check(s) above tolerance {tolerance:g}: "
                     + ", ".join(c.name for c in failed))
    else:
        skipped = [c.name for c in result.checks if c.status == "skipped"]
        lines.append(f"audit clean: {len(result.checks) - len(skipped)} checks within tolerance {tolerance:g}"
                     + (f" ({len(skipped)} skipped: {', '.join(skipped)})" if skipped else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The ``gspo-audit`` command (``python -m learner.audit``); ``run_dir`` is from the working directory.
    Returns the exit code."""
    parser = argparse.ArgumentParser(prog="gspo-audit", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run folder (holds audit/step_NNNNNNNN/)")
    parser.add_argument("--step", type=int, required=True, help="the RL step to audit (as in trainer.audit_steps)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"absolute tolerance in nats / loss units, relative for gradients (default {DEFAULT_TOLERANCE})")
    parser.add_argument("--top", type=int, default=10, help="token-level differences to list")
    parser.add_argument("--json", type=Path, default=None, help="also write the checks as JSON to this file")
    args = parser.parse_args(argv)
    if not (args.tolerance >= 0 and math.isfinite(args.tolerance)):
        print(f"error: --tolerance={args.tolerance!r} must be a finite number >= 0", file=sys.stderr)
        return 2
    step_dir = step_dir_for(Path(args.run_dir), args.step)
    if not step_dir.is_dir():
        saved = sorted(p.name for p in (Path(args.run_dir) / "audit").glob("step_*")) if (Path(args.run_dir) / "audit").is_dir() else []
        print(f"error: {str(step_dir)!r} does not exist (saved steps: {', '.join(saved) or 'none'}; set "
              "trainer.audit_steps in the run's config)", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    try:
        result = run_audit(step_dir, args.tolerance, top=args.top)
    except AuditInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(result, args.tolerance))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "step_dir": str(step_dir), "tolerance": args.tolerance, "failed": [c.name for c in result.failed],
            "checks": [asdict(c) for c in result.checks], "tokens": result.tokens,
        }, indent=1, default=str) + "\n")
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
