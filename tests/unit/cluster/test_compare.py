"""The equal-budget comparison (cluster/compare/runs.py, its report cluster/compare/report.py): settings per algorithm,
the report's figures on hand-made histories, and (slow) two real 2-step runs that share one warm start and end in
a report and a plot."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from cluster.compare import report
from cluster.compare import runs as compare
from cluster.config import load_config
from tests.helpers import assert_png
from tests.helpers.compare import CONFIG


def _resolved(cfg):
    from learner.objectives import resolve_objective

    lc = cfg.learner
    obj = resolve_objective(lc.algorithm, lc.clip_low, lc.clip_high, lc.loss_agg)
    return (obj.algorithm, obj.clip_low, obj.clip_high, obj.loss_agg, cfg.trainer.dynamic_sampling)


def test_algorithm_settings(tmp_path):
    base = load_config(CONFIG, ["trainer.seed=7", "rollout.seed=3"])
    want = {
        "gspo": ("gspo", 3e-4, 4e-4, "seq_mean_token_mean", False),
        "grpo": ("grpo", 0.2, 0.27, "token_mean", False),
        "dapo": ("grpo", 0.2, 0.28, "token_mean", True),
    }
    for algo, expected in want.items():
        cfg = load_config(CONFIG, ["trainer.seed=7", "rollout.seed=3"] + compare.run_overrides(algo, 2, base, tmp_path))
        assert _resolved(cfg) == expected, algo
        assert cfg.trainer.seed == 9 and cfg.rollout.seed == 5  # the config's seeds + the seed index
        assert cfg.run_dir == tmp_path / f"{algo}_seed2"
        # everything else is held equal
        assert cfg.trainer.prompts_per_step == base.trainer.prompts_per_step
        assert cfg.rollout.max_response_tokens == base.rollout.max_response_tokens
        assert cfg.warm_start == base.warm_start and cfg.reward == base.reward
        # one warm start for every seed: the prompt order (trainer.seed) is the config's, only sampling moves
        shared = load_config(CONFIG, ["trainer.seed=7", "rollout.seed=3"]
                             + compare.run_overrides(algo, 2, base, tmp_path, shared_warm_start=True))
        assert shared.trainer.seed == 7 and shared.rollout.seed == 5
    supported, _ = compare.routing_replay_supported()
    if supported:
        cfg = load_config(CONFIG, compare.run_overrides("grpo_rr", 0, base, tmp_path))
        assert cfg.learner.routing_replay == "learner" and _resolved(cfg)[:3] == ("grpo", 0.2, 0.27)
        cfg = load_config(CONFIG, compare.run_overrides("grpo_r3", 0, base, tmp_path))
        assert cfg.learner.routing_replay == "rollout" and cfg.rollout.return_routed_experts
        assert _resolved(cfg)[:3] == ("grpo", 0.2, 0.27)
        cfg = load_config(CONFIG, compare.run_overrides("gspo_mc", 0, base, tmp_path))
        assert cfg.learner.rollout_correction == "seq_geo_rs" and _resolved(cfg)[:3] == ("gspo", 3e-4, 4e-4)
        cfg = load_config(CONFIG, compare.run_overrides("grpo", 0, base, tmp_path))
        assert cfg.learner.routing_replay == "off" and cfg.learner.rollout_correction == "off"
    # A GRPO base config gets GSPO's own clip range, not GRPO's.
    grpo_base = load_config(CONFIG, ["learner.algorithm=grpo", "learner.clip_low=0.1", "learner.clip_high=0.1"])
    cfg = load_config(CONFIG, ["learner.algorithm=grpo", "learner.clip_low=0.1", "learner.clip_high=0.1"]
                      + compare.algorithm_overrides("gspo", grpo_base))
    assert _resolved(cfg)[:3] == ("gspo", 3e-4, 4e-4)
    assert "learner.algorithm=ppo" in compare.algorithm_overrides("ppo", base)  # a registered loss is an arm
    with pytest.raises(ValueError, match="reinforce"):
        compare.algorithm_overrides("reinforce", base)


def _history():
    # step 0: eval only; 4 RL steps; evals at steps 2 and 4
    return [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "reward/mean": 0.1, "actor/clip_fraction": 0.1, "actor/grad_norm": 1.0, "actor/grad_norm_max": 1.5,
         "timing/step_s": 2.0, "actor/num_response_tokens": 100.0, "actor/entropy": 3.0,
         "moe/routing_volatility": 0.0, "moe/routing_volatility_unreplayed": 0.0, "moe/routing_volatility_passes": 0.0},
        {"step": 2, "reward/mean": 0.2, "actor/clip_fraction": 0.2, "actor/grad_norm": 2.0, "actor/grad_norm_max": 11.0,
         "timing/step_s": 2.0, "actor/num_response_tokens": 100.0, "actor/entropy": 2.5, "eval/accuracy": 0.5,
         "moe/load_imbalance": 1.5,
         "moe/routing_volatility": 0.1, "moe/routing_volatility_unreplayed": 0.2, "moe/routing_volatility_passes": 3.0},
        {"step": 3, "reward/mean": 0.3, "actor/clip_fraction": 0.3, "actor/grad_norm": 2.0, "actor/grad_norm_max": 2.0,
         "timing/step_s": 3.0, "actor/num_response_tokens": 100.0, "actor/entropy": 2.0, "moe/load_imbalance": 1.75,
         "moe/routing_volatility": 0.3, "moe/routing_volatility_unreplayed": 0.4, "moe/routing_volatility_passes": 3.0},
        {"step": 4, "reward/mean": 0.6, "actor/clip_fraction": 0.4, "actor/grad_norm": 3.0, "actor/grad_norm_max": 3.0,
         "timing/step_s": 3.0, "actor/num_response_tokens": 200.0, "actor/entropy": 1.5, "eval/accuracy": 0.375},
    ]


def test_summarise_hand_values():
    s = report.summarise(_history(), spike_factor=5.0)
    assert s["steps"] == 4
    assert (s["start_accuracy"], s["final_accuracy"], s["best_accuracy"]) == (0.25, 0.375, 0.5)
    assert s["reward"] == pytest.approx(0.6)  # last quarter of 4 steps = the last step
    assert s["clip_fraction"] == pytest.approx(0.25)
    # only steps that measured volatility (passes > 0) count: steps 2 and 3
    assert s["routing_volatility"] == pytest.approx(0.2) and s["routing_volatility_router"] == pytest.approx(0.3)
    # median grad norm 2.0 -> threshold 10: step 2's peak 11 is the one spike
    assert s["grad_norm_spikes"] == 1
    assert report.summarise(_history(), spike_factor=6.0)["grad_norm_spikes"] == 0
    assert s["rl_time_s"] == pytest.approx(10.0) and s["tokens_per_s"] == pytest.approx(50.0)
    assert s["entropy_final"] == 1.5
    assert s["load_imbalance"] == pytest.approx(1.625)  # steps 2 and 3 logged it
    empty = report.summarise([{"step": 0}])
    assert math.isnan(empty["final_accuracy"]) and math.isnan(empty["reward"]) and empty["steps"] == 0


def test_mean_spread():
    assert report.mean_spread([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))
    m, s = report.mean_spread([0.5, float("nan")])
    assert m == 0.5 and math.isnan(s)
    assert all(math.isnan(x) for x in report.mean_spread([]))


def test_report_and_plot_from_results(tmp_path):
    runs = [
        report.RunResult("gspo", 0, "", "ok", settings="gspo, clip [1-0.0003, 1+0.0004]", wall_s=10.0,
                                 history=_history()),
        report.RunResult("gspo", 1, "", "ok", settings="gspo, clip [1-0.0003, 1+0.0004]", wall_s=14.0,
                                 history=_history()),
        report.RunResult("grpo_rr", 0, "", "skipped", note="not supported"),
    ]
    path = report.write_report(tmp_path, runs, config_path="configs/x.yaml", overrides=["a.b=1"],
                                       shared={"RL steps": 4}, spike_factor=5.0)
    text = path.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| gspo | "))
    assert "| 2 |" in row and "12.0 ± 2.8" in row  # wall s over the 2 seeds: mean 12, sample std 2.83
    assert "0.375 ± 0.000" in row  # final accuracy
    assert any(line.startswith("| grpo_rr | ") and "0 (skipped)" in line for line in text.splitlines())
    assert "grpo_rr seed 0: skipped: not supported" in text
    assert_png(report.plot_runs(runs, tmp_path / "curves.png"), 1100, 750)


def test_cli_refuses_bad_arguments(tmp_path, capsys):
    assert compare.main([CONFIG, "--algorithms", "gspo,reinforce", "--output-dir", str(tmp_path)]) == 2
    assert "reinforce" in capsys.readouterr().err
    assert compare.main([CONFIG, "--seeds", "0", "--output-dir", str(tmp_path)]) == 2
    assert compare.main([CONFIG, "trainer.prompts_per_step=3", "--output-dir", str(tmp_path)]) == 2
    assert not (tmp_path / "tiny_moe").exists()


def test_registry_losses_run_with_their_own_defaults(tmp_path):
    """Every registered loss without an arm of its own runs as learner.algorithm=<name> with that loss's own
    clip range, aggregation, options and advantage normalisation, whatever the base config set."""
    from learner.objectives import resolve_objective

    overrides = ["learner.algorithm=grpo", "learner.clip_low=0.1", "learner.loss_agg=seq_mean_token_sum",
                 "learner.normalize_adv_std=true"]
    base = load_config(CONFIG, overrides)
    want = {"cispo": (1.0, 4.0, "token_mean", True), "gmpo": (0.4, 0.4, "seq_mean_token_mean", True),
            "dr_grpo": (0.2, 0.2, "seq_mean_token_sum", False), "gspo_token": (3e-4, 4e-4, "seq_mean_token_mean", True)}
    for algo, (low, high, agg, std) in want.items():
        assert compare.registry_arm(algo)
        cfg = load_config(CONFIG, overrides + compare.run_overrides(algo, 0, base, tmp_path))
        lc = cfg.learner
        obj = resolve_objective(lc.algorithm, lc.clip_low, lc.clip_high, lc.loss_agg, lc.loss_options)
        got = (obj.algorithm, obj.clip_low, obj.clip_high, obj.loss_agg, lc.advantage_std())
        assert got == (algo, low, high, agg, std)
    cfg = load_config(CONFIG, overrides + compare.run_overrides("sapo", 0, base, tmp_path))
    assert cfg.learner.algorithm == "sapo" and cfg.learner.clip_low is None
    assert compare._settings(cfg) == "sapo, tau_pos=1, tau_neg=1.05, loss_agg=seq_mean_token_mean"
    assert not compare.registry_arm("gspo") and not compare.registry_arm("nope")
    assert compare.registry_arm("mylosses:fn")  # a user's loss, by module:function


def test_arms_are_the_config_plus_their_overrides(tmp_path, capsys):
    assert compare.parse_arm("lr3: learner.lr=3e-4  learner.grad_clip=0.5") == (
        "lr3", ["learner.lr=3e-4", "learner.grad_clip=0.5"])
    for bad in ("learner.lr=3e-4", "a b: learner.lr=1", "x:", "x: learner.lr"):
        with pytest.raises(ValueError, match="--arm"):
            compare.parse_arm(bad)
    base = load_config(CONFIG, [])
    arms = {"lr3": ["learner.lr=3e-4"]}
    cfg = load_config(CONFIG, compare.run_overrides("lr3", 1, base, tmp_path, arms=arms))
    assert cfg.learner.lr == 3e-4 and cfg.learner.algorithm == base.learner.algorithm
    assert cfg.run_dir == tmp_path / "lr3_seed1" and cfg.rollout.seed == base.rollout.seed + 1
    # refused before anything runs: a bad arm, a name twice, an arm whose overrides do not load
    assert compare.main([CONFIG, "--arm", "nope", "--output-dir", str(tmp_path)]) == 2
    assert compare.main([CONFIG, "--algorithms", "gspo", "--arm", "gspo: learner.lr=1e-3",
                         "--output-dir", str(tmp_path)]) == 2
    assert compare.main([CONFIG, "--algorithms", "", "--arm", "bad: learner.no_such_key=1",
                         "--output-dir", str(tmp_path)]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert not (tmp_path / "tiny_moe").exists()


def test_differences_beyond_the_spread():
    from cluster.compare.spread import chance_disjoint, spread_lines

    # 3 seeds each: disjoint ranges by chance with probability 2 / C(6, 3) = 0.1
    assert chance_disjoint(3, 3) == pytest.approx(0.1) and chance_disjoint(4, 4) == pytest.approx(2 / 70)
    per_arm = {
        "gspo": {"final_accuracy": [0.80, 0.82, 0.84], "best_accuracy": [0.85, 0.86, 0.87], "reward": [0.5] * 3},
        "cispo": {"final_accuracy": [0.85, 0.86, 0.90], "best_accuracy": [0.84, 0.88, 0.90],
                  "reward": [0.5, 0.6, math.nan]},
        "one_seed": {"final_accuracy": [0.99]},
    }
    text = "\n".join(spread_lines(per_arm, "gspo"))
    assert "final acc +0.050 (**beyond**: 0.850–0.900 vs 0.800–0.840)" in text  # 0.85 > 0.84
    assert "best acc +0.013 (within: 0.840–0.900 vs 0.850–0.870)" in text
    assert "reward +0.050 (**beyond**: 0.500–0.600 vs 0.500–0.500)" not in text  # 0.5 touches 0.5: overlap
    assert "reward (last ¼) +0.050 (within" in text
    assert "one_seed" not in text  # fewer than two seeds: no spread
    assert "3 pairs were looked at, so about 0.4 would be expected" in text  # 0.1 + 0.1 + 2 / C(5, 2)
    assert "Beyond the spread: cispo final acc." in text
    assert "no spread to compare" in "\n".join(spread_lines({"a": {"reward": [1.0]}, "b": {}}, "a"))


def _save_run(runs_dir, arm, k, overrides, accuracy):
    run_dir = runs_dir / f"{arm}_seed{k}"
    run_dir.mkdir(parents=True)
    history = [dict(r) for r in _history()]
    history[-1]["eval/accuracy"] = accuracy
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    r = report.RunResult(arm, k, str(run_dir), "ok", settings=arm, wall_s=5.0, history=history)
    return compare.save_result(r, CONFIG, overrides)


def test_one_run_per_command_then_report_from_saved_runs(tmp_path, capsys):
    """A study run one (arm, seed) per command: the report reads every saved run back (history from its
    metrics.jsonl), lists a run never made as not run, and refuses a run saved under other overrides."""
    out = tmp_path / "study"
    runs_dir = out / "runs"
    ov = ["trainer.total_steps=4"]
    for arm, k, acc in [("gspo", 0, 0.5), ("gspo", 1, 0.25), ("grpo", 0, 0.125)]:
        _save_run(runs_dir, arm, k, ov, acc)
    saved = compare.saved_results(runs_dir, ["gspo", "grpo"], 2, CONFIG, ov)
    assert sorted(saved) == [("grpo", 0), ("gspo", 0), ("gspo", 1)]
    assert saved[("gspo", 1)].history[-1]["eval/accuracy"] == 0.25 and saved[("gspo", 1)].wall_s == 5.0
    with pytest.raises(ValueError, match="total_steps=5"):
        compare.saved_results(runs_dir, ["gspo"], 1, CONFIG, ["trainer.total_steps=5"])
    rc = compare.main([CONFIG, "trainer.total_steps=5", "--report-only", "--algorithms", "gspo", "--name", "study",
                       "--output-dir", str(tmp_path)])
    assert rc == 2 and "total_steps=5" in capsys.readouterr().err and not (out / "report.md").exists()

    rc = compare.main([CONFIG, *ov, "--report-only", "--algorithms", "gspo,grpo", "--seeds", "2",
                       "--name", "study", "--output-dir", str(tmp_path)])
    assert rc == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["algorithm"], r["seed_index"], r["status"]) for r in runs] == [
        ("gspo", 0, "ok"), ("grpo", 0, "ok"), ("gspo", 1, "ok"), ("grpo", 1, "skipped")]
    assert [r["figures"]["final_accuracy"] for r in runs[:3]] == [0.5, 0.125, 0.25]
    text = (out / "report.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| gspo | "))
    assert "0.375 ± 0.177" in row  # final accuracy over the two saved gspo seeds
    assert "grpo seed 1: skipped: not run (no saved result)" in text
    # --seed-index outside the seeds, or with --report-only, is refused
    assert compare.main([CONFIG, "--seed-index", "2", "--seeds", "2", "--output-dir", str(tmp_path)]) == 2
    assert compare.main([CONFIG, "--seed-index", "0", "--report-only", "--output-dir", str(tmp_path)]) == 2


def test_per_step_tables_average_the_seeds_that_logged_a_step():
    a0 = report.RunResult("gspo", 0, "", "ok", history=_history())
    h1 = [dict(r) for r in _history()]
    h1[1]["reward/mean"] = 0.3  # step 1: (0.1 + 0.3) / 2
    del h1[4]["eval/accuracy"]  # step 4 evaluated by seed 0 only
    a1 = report.RunResult("gspo", 1, "", "ok", history=h1)
    lines = report.per_step_lines([a0, a1])
    text = "\n".join(lines)
    assert "| gspo | 0.250 | 0.500 | 0.375 (1) |" in text  # eval at steps 0, 2, 4
    assert "| gspo | 0.200 | 0.200 | 0.300 | 0.600 |" in text  # reward at steps 1-4
    assert "Expert load max/mean (`moe/load_imbalance`):" in text and "| gspo | – | 1.500 | 1.750 | – |" not in text
    assert "| gspo | 1.500 | 1.750 |" in text  # only the steps that logged it are columns
    wide = report.per_step_lines([report.RunResult(
        "grpo", 0, "", "ok", history=[{"step": s, "reward/mean": float(s)} for s in range(1, 46)])], max_columns=20)
    header = next(line for line in wide if line.startswith("| arm |"))
    assert header == "| arm | " + " | ".join(str(s) for s in list(range(1, 46, 3)) + [45]) + " |"
    assert report.per_step_lines([]) == []
