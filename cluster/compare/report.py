"""The report of an equal-budget comparison (``cluster/compare/runs.py``): the record of one (algorithm, seed) run,
its figures from its metrics records, their mean and spread over seeds, ``report.md`` and ``curves.png``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.common import mean as _mean
from cluster.compare.spread import FIGURES, spread_lines

DEFAULT_SPIKE_FACTOR = 5.0


@dataclass
class RunResult:
    """One (algorithm, seed) run."""

    algorithm: str
    seed_index: int
    run_dir: str
    status: str  # "ok", "skipped" or "failed"
    note: str = ""
    settings: str = ""
    wall_s: float = float("nan")  # trainer.run(): RL steps, evals, checkpoints (not start-up or warm start)
    warm_start: dict[str, float] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


def _values(history: list[dict[str, Any]], key: str, rl_only: bool = True) -> list[float]:
    out = []
    for r in history:
        if rl_only and int(r.get("step", 0)) < 1:
            continue
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out.append(float(v))
    return out


def summarise(history: list[dict[str, Any]], spike_factor: float = DEFAULT_SPIKE_FACTOR) -> dict[str, float]:
    """The report's figures for one run, from its metrics records (``metrics.jsonl`` lines).

    - ``start_accuracy``, ``final_accuracy``, ``best_accuracy``: held-out greedy accuracy at step 0, at the
      last evaluation, and the best over every evaluation (step 0 included);
    - ``reward``: mean of ``reward/mean`` over the last quarter of the RL steps (at least one step);
    - ``clip_fraction``: mean ``actor/clip_fraction`` over the RL steps (sequences for GSPO, tokens for GRPO);
    - ``routing_volatility`` / ``routing_volatility_router``: mean ``moe/routing_volatility`` (experts used)
      and ``moe/routing_volatility_unreplayed`` (the router's own choice) over the steps that measured it;
    - ``routing_volatility_per_update``: mean ``moe/routing_volatility_per_update`` (router's own changed share
      per optimizer step); ``train_rollout_logprob_diff``: mean ``actor/train_rollout_logprob_diff`` (learner
      pre-update vs engine log-probs, with R3 replay when on); ``masked_seq_share``: mean
      ``mismatch/masked_seq_share`` (sequences a mismatch correction dropped);
    - ``load_imbalance``: mean ``moe/load_imbalance`` over the RL steps (the busiest expert's share of routed
      tokens over the mean share, averaged over MoE layers; 1 = balanced);
    - ``grad_norm_spikes``: RL steps whose largest pre-clip gradient norm (``actor/grad_norm_max``) exceeds
      ``spike_factor`` x the median of the run's ``actor/grad_norm``;
    - ``rl_time_s``: sum of ``timing/step_s`` (rollout, reward, learner, weight sync; no evals);
      ``tokens_per_s``: response tokens trained on (``actor/num_response_tokens``) / ``rl_time_s``;
    - ``entropy_final``: ``actor/entropy`` of the last step; ``steps``: RL steps logged.

    Missing metrics give NaN.
    """
    evals = [(int(r.get("step", 0)), float(r["eval/accuracy"])) for r in history
             if isinstance(r.get("eval/accuracy"), (int, float))]
    steps = [r for r in history if int(r.get("step", 0)) >= 1]
    rewards = _values(history, "reward/mean")
    tail = rewards[-max(1, len(rewards) // 4):] if rewards else []
    norms = _values(history, "actor/grad_norm")
    peaks = _values(history, "actor/grad_norm_max") or norms
    median = statistics.median(norms) if norms else float("nan")
    spikes = sum(1 for p in peaks if p > spike_factor * median) if norms else float("nan")
    measured = [r for r in steps if float(r.get("moe/routing_volatility_passes") or 0) > 0]
    vol = _values(measured, "moe/routing_volatility")
    vol_router = _values(measured, "moe/routing_volatility_unreplayed")
    step_time = sum(_values(history, "timing/step_s"))
    tokens = _values(history, "actor/num_response_tokens")
    entropy = _values(history, "actor/entropy")
    return {
        "steps": float(len(steps)),
        "start_accuracy": evals[0][1] if evals and evals[0][0] == 0 else float("nan"),
        "final_accuracy": evals[-1][1] if evals else float("nan"),
        "best_accuracy": max(a for _, a in evals) if evals else float("nan"),
        "reward": _mean(tail),
        "clip_fraction": _mean(_values(history, "actor/clip_fraction")),
        "routing_volatility": _mean(vol),
        "routing_volatility_router": _mean(vol_router),
        "routing_volatility_per_update": _mean(_values(measured, "moe/routing_volatility_per_update")),
        "train_rollout_logprob_diff": _mean(_values(history, "actor/train_rollout_logprob_diff")),
        "masked_seq_share": _mean(_values(history, "mismatch/masked_seq_share")),
        "load_imbalance": _mean(_values(history, "moe/load_imbalance")),
        "grad_norm_spikes": float(spikes),
        "rl_time_s": step_time,
        "tokens_per_s": sum(tokens) / step_time if tokens and step_time > 0 else float("nan"),
        "entropy_final": entropy[-1] if entropy else float("nan"),
    }


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN with fewer than two values) of the finite values."""
    xs = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not xs:
        return float("nan"), float("nan")
    return _mean(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def _fmt(mean: float, spread: float, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "–"
    text = f"{mean:.{digits}f}"
    return text + (f" ± {spread:.{digits}f}" if math.isfinite(spread) else "")


COLUMNS = [  # (summary key, header, digits)
    ("start_accuracy", "start acc", 3),
    ("final_accuracy", "final acc", 3),
    ("best_accuracy", "best acc", 3),
    ("reward", "reward (last ¼)", 3),
    ("clip_fraction", "clip fraction", 4),
    ("routing_volatility", "routing vol. (used)", 3),
    ("routing_volatility_router", "routing vol. (router)", 3),
    ("routing_volatility_per_update", "routing vol./update", 3),
    ("train_rollout_logprob_diff", "train-rollout |Δlogp|", 6),
    ("masked_seq_share", "seqs dropped", 3),
    ("load_imbalance", "expert load max/mean", 2),
    ("grad_norm_spikes", "grad-norm spikes", 1),
    ("wall_s", "wall s", 1),
    ("tokens_per_s", "tokens/s", 0),
]


def _row_values(r: RunResult, spike_factor: float) -> dict[str, float]:
    s = summarise(r.history, spike_factor)
    s["wall_s"] = r.wall_s
    return s


def write_report(out_dir: Path, results: list[RunResult], *, config_path: str, overrides: list[str],
                 shared: dict[str, Any], spike_factor: float) -> Path:
    """``report.md``: the per-algorithm table (mean ± sample std over seeds), the per-run table, the shared
    settings, definitions, skipped and failed runs, and what the comparison does and does not show."""
    algos = list(dict.fromkeys(r.algorithm for r in results))
    lines = [f"# Equal-budget comparison: {out_dir.name}", ""]
    lines += [f"Config `{config_path}`" + (f" with `{' '.join(overrides)}`" if overrides else "") + ".", ""]
    lines += ["Held equal in every run of a seed: " + ", ".join(f"{k} {v}" for k, v in shared.items()) + ".", ""]
    lines += ["## Results (mean ± sample std over seeds)", ""]
    header = ["algorithm", "settings", "runs"] + [h for _, h, _ in COLUMNS]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    per_arm: dict[str, dict[str, list[float]]] = {}
    for a in algos:
        runs = [r for r in results if r.algorithm == a and r.status == "ok"]
        all_runs = [r for r in results if r.algorithm == a]
        settings = next((r.settings for r in all_runs if r.settings), "")
        if not runs:
            status = ", ".join(sorted({r.status for r in all_runs}))
            lines.append(f"| {a} | {settings} | 0 ({status}) |" + " – |" * len(COLUMNS))
            continue
        vals = [_row_values(r, spike_factor) for r in runs]
        per_arm[a] = {k: [v[k] for v in vals] for k, _ in FIGURES}
        cells = [_fmt(*mean_spread([v[k] for v in vals]), d) for k, _, d in COLUMNS]
        lines.append(f"| {a} | {settings} | {len(runs)} | " + " | ".join(cells) + " |")
    lines += [""] + spread_lines(per_arm, algos[0]) + ["## Runs", ""]
    header = ["run", "status", "steps"] + [h for _, h, _ in COLUMNS]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        v = _row_values(r, spike_factor)
        cells = [_fmt(v[k], float("nan"), d) for k, _, d in COLUMNS]
        lines.append(f"| {r.algorithm} seed {r.seed_index} | {r.status} | {v['steps']:.0f} | " + " | ".join(cells) + " |")
    lines += per_step_lines([r for r in results if r.status == "ok"])
    notes = [r for r in results if r.status != "ok"]
    if notes:
        lines += ["", "## Skipped and failed runs", ""]
        lines += [f"- {r.algorithm} seed {r.seed_index}: {r.status}: {r.note}" for r in notes]
    lines += [
        "", "## Definitions", "",
        "- Accuracy: held-out prompts, greedy decoding, judged by the verifier; start = step 0 (after the shared "
        "warm start; the same for every algorithm of a seed), final = last evaluation, best = best evaluation.",
        "- Reward: mean training-rollout reward over the last quarter of the RL steps.",
        "- Clip fraction: mean over RL steps of `actor/clip_fraction`. Its unit differs: sequences for GSPO, "
        "tokens for GRPO/DAPO, so the columns are not the same quantity across algorithms. Tokens for the other "
        "losses, where it means: CISPO a truncated IS weight, SAPO a soft gate passing under half the gradient, "
        "GMPO a token log-ratio outside its log-space range, Dr. GRPO as GRPO (learner/README.md).",
        "- Routing volatility: mean `moe/routing_volatility` (share of (token, MoE layer) top-k expert sets that "
        "differ from the behaviour policy's, for the experts used; 0 under Routing Replay by construction) and "
        "`moe/routing_volatility_unreplayed` (the router's own choice). – when not logged (dense model, or one "
        "minibatch and one epoch per step). Under R3 (`grpo_r3`) the used experts are the engine's, so the first "
        "column is the engine-vs-learner routing difference, not 0. Per update: `moe/routing_volatility_per_update`.",
        "- Train-rollout |Δlogp|: mean `actor/train_rollout_logprob_diff` (learner pre-update log-probs, with the "
        "engine's experts under R3, against the engine's). Seqs dropped: mean `mismatch/masked_seq_share`.",
        "- Expert load max/mean: mean over RL steps of `moe/load_imbalance` (per MoE layer the busiest expert's "
        "share of the routed response tokens over the mean share, averaged over layers; 1 = even, E/k = every "
        "token on the same experts).",
        f"- Grad-norm spikes: RL steps whose largest pre-clip gradient norm exceeds {spike_factor:g} x the median "
        "of the run's per-step mean gradient norm.",
        "- Wall s: `Trainer.run()` of the run (RL steps, evaluations, checkpoints; not service start-up or the "
        "warm start). Tokens/s: response tokens trained on / summed step time (rollout, reward, learner, sync). "
        "Timings are only comparable between runs on the same idle machine.",
        "", "## What this shows and what it does not", "",
        "It shows how the objectives behave on this config: the same warm-started model, the same prompts, "
        "sampling seeds, rollouts per step, reward and length limit, with only the objective changed. It does "
        "not reproduce the GSPO paper: a tiny model on a toy task with a handful of seeds is not a 30B MoE on "
        "competition mathematics, differences within the spread over seeds are noise, and a short run says "
        "nothing about the long-horizon stability the paper reports.",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


#: the per-step curves of the report, (metrics key, title); a key no run logged is left out
STEP_CURVES = (("eval/accuracy", "held-out accuracy"), ("reward/mean", "reward"),
               ("actor/clip_fraction", "clip fraction"),
               ("moe/routing_volatility_per_update", "routing volatility per update"),
               ("moe/load_imbalance", "expert load max/mean"))


def per_step_lines(runs: list[RunResult], max_columns: int = 20) -> list[str]:
    """Markdown lines: per metric of ``STEP_CURVES`` that some run logged, one table of arms x steps whose cell is
    the mean over the arm's seeds that logged it at that step (the number of seeds in brackets when fewer than
    the arm's runs). At most ``max_columns`` steps: every k-th step, the last one always kept."""
    algos = list(dict.fromkeys(r.algorithm for r in runs))
    lines: list[str] = []
    for key, title in STEP_CURVES:
        table = {a: {} for a in algos}
        for r in runs:
            for h in r.history:
                v = h.get(key)
                if isinstance(v, (int, float)) and math.isfinite(float(v)):
                    table[r.algorithm].setdefault(int(h.get("step", 0)), []).append(float(v))
        steps = sorted({st for cells in table.values() for st in cells})
        if not steps:
            continue
        every = -(-len(steps) // max_columns)
        shown = steps[::every] if steps[-1] in steps[::every] else steps[::every] + [steps[-1]]
        if not lines:
            lines = ["", "## Per step (mean over seeds)", ""]
        lines += [f"{title.capitalize()} (`{key}`):", "", "| arm | " + " | ".join(str(st) for st in shown) + " |",
                  "|" + "---|" * (len(shown) + 1)]
        for a in algos:
            n = sum(1 for r in runs if r.algorithm == a)
            cells = [(f"{_mean(table[a][st]):.3f}" + (f" ({len(table[a][st])})" if len(table[a][st]) < n else ""))
                     if st in table[a] else "–" for st in shown]
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def plot_runs(results: list[RunResult], out: Path) -> Path | None:
    """``curves.png``: held-out accuracy, reward, clip fraction and entropy against the step, every run
    overlaid (one colour per algorithm, one line style per seed)."""
    runs = [r for r in results if r.history]
    if not runs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [("eval/accuracy", "held-out accuracy (greedy)"), ("reward/mean", "reward (training rollouts)"),
              ("actor/clip_fraction", "clip fraction (GSPO: sequences, GRPO: tokens)"),
              ("actor/entropy", "entropy (nats/token)")]
    algos = list(dict.fromkeys(r.algorithm for r in runs))
    colours = {a: f"C{i}" for i, a in enumerate(algos)}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title) in zip(axes.flat, panels):
        for r in runs:
            pts = [(int(h["step"]), float(h[key])) for h in r.history
                   if isinstance(h.get(key), (int, float)) and math.isfinite(float(h[key]))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, color=colours[r.algorithm], linestyle=styles[r.seed_index % len(styles)],
                        marker="o" if len(pts) < 30 else None, markersize=3,
                        label=f"{r.algorithm} s{r.seed_index}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes.flat[1].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
