"""Where metrics go: ``metrics.jsonl`` (one JSON object per step), wandb (offline unless a key is set),
a live progress line, and ``curves.png`` at the end."""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WANDB_ID_FILE = "wandb_run_id"  # in the run folder: the wandb run a resumed run continues


def wandb_run_id(run_dir: Path, resuming: bool) -> tuple[str, bool]:
    """The wandb run id of this run folder and whether it continues an earlier one.

    A resumed run reuses the id stored in ``run_dir/wandb_run_id``; a fresh run (or a resumed one whose folder
    holds no id, e.g. one logged with wandb disabled) gets a new id, which is stored there.

    Returns:
        ``(id, continued)``.
    """
    path = run_dir / WANDB_ID_FILE
    if resuming and path.is_file():
        stored = path.read_text().strip()
        if stored:
            return stored, True
        log.warning("%s is empty: the resumed run opens a new wandb run", path)
    elif resuming:
        log.info("no %s in the run folder: the resumed run opens a new wandb run", WANDB_ID_FILE)
    new = uuid.uuid4().hex[:16]  # wandb ids: letters and digits, unique within the project
    path.write_text(new + "\n")
    return new, False


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class MetricsLogger:
    """Appends step metrics to ``run_dir/metrics.jsonl`` and mirrors them to wandb under the same names.

    Args:
        run_dir: the run folder.
        config: the resolved config as a dict (stored with the wandb run).
        wandb_mode: ``offline``, ``online``, ``disabled`` or ``auto`` (online if WANDB_API_KEY is set).
        project: wandb project name.
        resume_from_step: when resuming, lines for steps after this one (written after the checkpoint) are
            dropped so the file again holds one line per step, and the wandb run of the run folder is continued
            (same id, ``resume="allow"``: online it appends to that run, or creates it when it never reached
            the server; offline it writes another folder of the same id, which ``wandb sync`` uploads to it).
    """

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        *,
        wandb_mode: str = "auto",
        project: str = "gspo-rl",
        resume_from_step: int | None = None,
    ):
        self.path = run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        if resume_from_step is not None and self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("step", 0) <= resume_from_step:
                    kept.append(rec)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self.history = kept
        elif self.path.exists():
            self.path.unlink()
        self._wandb = None
        mode = wandb_mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if mode != "disabled":
            try:
                import wandb

                os.environ.setdefault("WANDB_SILENT", "true")
                run_id, continued = wandb_run_id(run_dir, resuming=resume_from_step is not None)
                self._wandb = wandb.init(
                    project=project,
                    name=run_dir.name,
                    dir=str(run_dir),
                    mode=mode,
                    config=config,
                    id=run_id,
                    resume="allow" if continued else None,
                    reinit="finish_previous",
                )
                if continued:
                    log.info("wandb: continuing run %s after step %d", run_id, resume_from_step)
            except Exception as e:  # wandb is a mirror: never let it stop training
                log.warning("wandb disabled: %s", e)
                self._wandb = None

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one step's metrics (must hold ``step``)."""
        rec = {k: _clean(v) for k, v in metrics.items()}
        self.history.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._wandb is not None:
            scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}
            self._wandb.log(scalars, step=int(rec["step"]))

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def plot_curves(history: list[dict[str, Any]], out: Path) -> Path | None:
    """Reward, held-out accuracy, clip fraction and entropy against the step, as a 2x2 figure."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward/mean", "reward (train rollouts)"),
        ("eval/accuracy", "held-out accuracy (greedy)"),
        ("actor/clip_fraction", "clip fraction"),
        ("actor/entropy", "entropy (nats/token)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        pts = [(r["step"], r[key]) for r in history if r.get(key) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    plot_expert_load(history, out.with_name("expert_load.png"))
    return out


def plot_expert_load(history: list[dict[str, Any]], out: Path) -> Path | None:
    """Heat map of the share of routed tokens per layer (rows) and expert (columns), averaged over the steps
    that logged ``moe/expert_load`` (MoE models only)."""
    import numpy as np

    loads = [np.asarray(r["moe/expert_load"], dtype=float) for r in history if r.get("moe/expert_load") is not None]
    if not loads:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mean = np.mean(np.stack(loads), axis=0)
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * mean.shape[1] + 2), max(2.5, 0.5 * mean.shape[0] + 1.5)))
    im = ax.imshow(mean, aspect="auto", cmap="viridis")
    ax.set_xticks(range(mean.shape[1]))
    ax.set_yticks(range(mean.shape[0]))
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"expert load (share of routed tokens), mean over {len(loads)} steps")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def progress_line(m: dict[str, Any]) -> str:
    """One line for the live progress display."""

    def f(key: str, fmt: str) -> str:
        v = m.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    parts = [
        f"reward {f('reward/mean', '.3f')}",
        f"acc {f('reward/accuracy', '.3f')}",
        f"clip {f('actor/clip_fraction', '.3f')}",
        f"{f('timing/step_s', '.1f')} s/step",
    ]
    if m.get("agent/turns_mean") is not None:  # multi-turn episodes
        parts.insert(2, f"turns {f('agent/turns_mean', '.2f')}")
    if m.get("eval/accuracy") is not None:
        parts.append(f"eval {m['eval/accuracy']:.3f}")
    return " | ".join(parts)
