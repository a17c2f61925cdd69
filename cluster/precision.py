"""The run's numeric precision, one switch (``precision``, a top-level config key) over the keys it sets.

``precision: bf16`` runs the engines in bfloat16 (``rollout.dtype``) and the learner in DeepSpeed's bf16 mode
(``learner.dtype``: bf16 weights, activations and gradients, fp32 master weights, fp32 gradient accumulation and
Adam's moments in fp32, which needs ``learner.zero_stage >= 1``, ``learner/ds_config.py``), and takes the
behaviour log-probs from the learner's own forward before the update (``learner.old_logprob_source=recompute``):
a bf16 engine's log-probs as GSPO's behaviour policy put the engine/learner gap inside the sequence ratio, whose
clip range (3e-4 / 4e-4) is narrower than that gap, and widened the clip fraction from 0.39 to 0.48
(docs/results.md, "With a bf16 engine beside the fp32 learner"); recomputing brought it back, as the GPU recipes
of verl and OpenRLHF do. The pre-update pass that recomputes them also logs the gap every step
(``actor/train_rollout_logprob_diff``, ``mismatch/*``). ``learner.autocast`` is ``off`` (the weights are bf16
already). ``precision: fp32`` sets the three dtype keys to float32 / ``off``.

``precision: auto`` chooses bf16 where every compute role has bf16 units: a role on GPUs
(``learner.num_gpus_per_rank``, ``rollout.num_gpus_per_engine`` > 0; Ampere or later assumed), a role on the CPU
when this machine's ``/proc/cpuinfo`` flags name ``avx512_bf16`` or ``amx_bf16`` (the machine that loads the config:
the driver, under ``gspo-submit`` the job's; learner and engine nodes of another CPU type are not probed). fp32
elsewhere.

Keys the config sets itself win. With ``bf16`` or ``fp32`` a key set to the other precision's value is refused,
naming both (``precision=bf16`` with ``rollout.dtype=float32``; ``bf16`` with ``learner.zero_stage=0``, where
DeepSpeed's bf16 has no fp32 gradient accumulation); the other keys are only filled where the config leaves them
unset. ``learner.old_logprob_source`` left at its default ``auto`` becomes ``recompute`` under bf16: ``auto``
would measure the gap on its first monitored step and switch there anyway (a bf16 side is 10x or more above
``learner.max_rollout_logprob_gap``), so the switch fills in the known outcome, and a run with the monitor off
still recomputes. ``rollout`` or ``auto`` set by the config is kept, and said so in the report (the measured
case above is a ``rollout`` run), as is the default under ``learner.pre_update_pass=never``. With
``auto`` set keys steer the choice: when they contradict the hardware's precision (``learner.zero_stage=0``,
``rollout.dtype=float32``, ...) auto takes the other one if the set keys agree with it, and refuses keys that
contradict both. Unset (``null``, the default): no key is touched, the per-key settings as before.

The served models (the LLM judge, ``reward.judge``, and the distillation teacher, ``distill``) keep their own
``dtype`` key whatever the switch says: they are fixed models outside the policy's precision, and a teacher in
bf16 would put its rounding into the reverse KL that trains the student; set ``reward.judge.dtype`` /
``distill.dtype`` to ``bfloat16`` for their engines' speed.

The choice is in ``Config.precision_report`` (logged at the run's start, in ``devices.json`` and in
``--dry-run``'s output). Torch-free: the config loads without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: where the CPU's feature flags are read (Linux); a missing file reads as no bf16 units
CPUINFO_PATH = Path("/proc/cpuinfo")
#: /proc/cpuinfo flags of x86 CPUs with bf16 matrix or vector units: AVX512-BF16 (Cooper Lake, Sapphire Rapids,
#: AMD Zen 4) and AMX-BF16 (Sapphire Rapids and later)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")

#: per precision: the dtype keys it sets, (section, key) -> value
SETS: dict[str, dict[tuple[str, str], str]] = {
    "bf16": {("rollout", "dtype"): "bfloat16", ("learner", "dtype"): "bfloat16", ("learner", "autocast"): "off"},
    "fp32": {("rollout", "dtype"): "float32", ("learner", "dtype"): "float32", ("learner", "autocast"): "off"},
}


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The bf16 flags (``BF16_FLAGS``) the CPU reports: those in the first ``flags`` line of ``cpuinfo`` (the
    text of ``/proc/cpuinfo``; None reads ``CPUINFO_PATH``, and a machine without it has none)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO_PATH.read_text()
        except OSError:
            return []
    for line in cpuinfo.splitlines():
        if line.split(":", 1)[0].strip() == "flags":
            flags = set(line.split(":", 1)[1].split())
            return [f for f in BF16_FLAGS if f in flags]
    return []


def _explicit(section: Any, key: str) -> Any:
    """The value of ``section.key`` when the config set it (pydantic's ``model_fields_set``), else None."""
    return getattr(section, key) if key in section.model_fields_set else None


def _conflicts(cfg: Any, precision: str) -> list[str]:
    """The keys the config sets that ``precision`` cannot run with, as ``section.key=value``."""
    out = []
    for (sec, key), value in SETS[precision].items():
        set_value = _explicit(getattr(cfg, sec), key)
        # a learner already bf16 under autocast runs the same: precision=bf16 accepts learner.autocast=bfloat16
        if set_value is not None and set_value != value and not (precision == "bf16" and key == "autocast"):
            out.append(f"{sec}.{key}={set_value}")
    if precision == "bf16" and _explicit(cfg.learner, "zero_stage") == 0:
        out.append("learner.zero_stage=0")
    return out


def _why_bf16_units(cfg: Any, flags: list[str]) -> tuple[bool, str]:
    """Whether every compute role has bf16 units (GPU roles yes; CPU roles by ``flags``), and why in words."""
    cpu_roles = [r for r, gpus in (("learner", cfg.learner.num_gpus_per_rank),
                                   ("engines", cfg.rollout.num_gpus_per_engine)) if not gpus]
    if not cpu_roles:
        return True, "learner and engines on GPUs"
    where = " and ".join(cpu_roles) + " on the CPU"
    if flags:
        return True, f"{where}, which has {', '.join(flags)}"
    return False, f"{where}, which has none of {', '.join(BF16_FLAGS)}"


def resolve(cfg: Any, cpuinfo: str | None = None) -> dict[str, Any]:
    """Apply ``cfg.precision`` to ``cfg`` (a ``cluster.config.Config``; in place, by assignment to its sections)
    and return the report: ``requested`` (the switch as written), ``chosen`` (``bf16``, ``fp32``, or for an unset
    switch what the keys say: ``bf16``, ``fp32`` or ``mixed``), ``reason``, ``cpu_bf16_flags`` (this machine's),
    ``filled`` (``section.key`` -> value set by the switch), ``kept`` (keys the config set that the switch
    would have set otherwise, with why) and ``effective`` (the resulting rollout.dtype, learner.dtype,
    learner.autocast, learner.zero_stage, learner.old_logprob_source). Idempotent: a config resolved once and
    validated again (its keys now all set, agreeing) resolves to the same.

    Raises:
        ValueError: ``bf16``/``fp32`` with a key set to a value it cannot run with, or ``auto`` with set keys
            that contradict both precisions; the message names the switch and every such key.
    """
    flags = cpu_bf16_flags(cpuinfo)
    requested = cfg.precision
    report: dict[str, Any] = {"requested": requested, "cpu_bf16_flags": flags, "filled": {}, "kept": {}}
    if requested is None:
        report["chosen"] = _described(cfg)
        report["reason"] = "precision unset: the per-key settings as configured"
    elif requested == "auto":
        units, why = _why_bf16_units(cfg, flags)
        first = "bf16" if units else "fp32"
        other = "fp32" if units else "bf16"
        bad_first, bad_other = _conflicts(cfg, first), _conflicts(cfg, other)
        if not bad_first:
            chosen, reason = first, why
        elif not bad_other:
            chosen, reason = other, f"{why}, but the config sets {', '.join(bad_first)}"
        else:
            raise ValueError(f"precision=auto: the config sets {', '.join(bad_first)} (not {first}) and "
                             f"{', '.join(bad_other)} (not {other}); set precision=bf16 or fp32 and drop the keys "
                             "that contradict it, or leave precision unset to keep each key as set")
        report.update(chosen=chosen, reason=f"auto: {reason}")
        _apply(cfg, chosen, report)
    else:
        bad = _conflicts(cfg, requested)
        if bad:
            fixes = [f"drop {k.split('=')[0]} (precision sets it)" for k in bad if k != "learner.zero_stage=0"]
            if "learner.zero_stage=0" in bad:
                fixes.append("set learner.zero_stage >= 1 (DeepSpeed's bf16 accumulates gradients in fp32 only at "
                             "ZeRO stage 1, 2 or 3)")
            raise ValueError(f"precision={requested} contradicts {', '.join(bad)} set in the config: "
                             f"{'; '.join(fixes)}; or leave precision unset to keep each key as set")
        report.update(chosen=requested, reason="set in the config")
        _apply(cfg, requested, report)
    lc = cfg.learner
    report["effective"] = {"rollout.dtype": cfg.rollout.dtype, "learner.dtype": lc.dtype,
                           "learner.autocast": lc.autocast, "learner.zero_stage": lc.zero_stage,
                           "learner.old_logprob_source": lc.old_logprob_source}
    return report


def _apply(cfg: Any, chosen: str, report: dict[str, Any]) -> None:
    """Set ``chosen``'s keys that the config leaves unset (recording them in ``report['filled']``), and under
    bf16 the behaviour log-probs' source (or why the config's own is kept, in ``report['kept']``)."""
    for (sec, key), value in SETS[chosen].items():
        section = getattr(cfg, sec)
        if key not in section.model_fields_set:
            setattr(section, key, value)
            report["filled"][f"{sec}.{key}"] = value
    if chosen != "bf16":
        return
    lc = cfg.learner
    if "old_logprob_source" in lc.model_fields_set:
        if lc.old_logprob_source == "rollout":
            report["kept"]["learner.old_logprob_source"] = (
                "rollout, set in the config: a bf16 engine's log-probs widen GSPO's clip fraction (docs/results.md)")
        elif lc.old_logprob_source == "auto":
            report["kept"]["learner.old_logprob_source"] = (
                "auto, set in the config: the first monitored step measures the bf16 gap against "
                "learner.max_rollout_logprob_gap and switches to recompute when it is above (it was 0.033 nats per "
                "token, docs/results.md)")
    elif lc.pre_update_pass == "never":
        report["kept"]["learner.old_logprob_source"] = (
            "auto, read as rollout: learner.pre_update_pass=never runs no pass to check or recompute")
    else:
        lc.old_logprob_source = "recompute"
        report["filled"]["learner.old_logprob_source"] = "recompute"


def _described(cfg: Any) -> str:
    """What the dtype keys of a config without the switch amount to: ``bf16``, ``fp32`` or ``mixed``."""
    for name, keys in SETS.items():
        if all(getattr(getattr(cfg, sec), key) == value for (sec, key), value in keys.items()):
            return name
    return "mixed"


def summary(report: dict[str, Any]) -> str:
    """One line for the run's log: the choice, why, and what it set or kept."""
    eff = report["effective"]
    parts = [f"precision {report['chosen']} (requested {report['requested']}; {report['reason']})",
             f"rollout.dtype={eff['rollout.dtype']} learner.dtype={eff['learner.dtype']} "
             f"learner.autocast={eff['learner.autocast']} learner.zero_stage={eff['learner.zero_stage']} "
             f"learner.old_logprob_source={eff['learner.old_logprob_source']}"]
    if report["filled"]:
        parts.append("set by the switch: " + ", ".join(report["filled"]))
    parts += [f"kept {k}={v}" for k, v in report["kept"].items()]
    return "; ".join(parts)
