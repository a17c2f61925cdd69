"""The learner alone on one GPU, as a ZeRO-3 run starts it (``make gpu-learner-check``; no vLLM, no Ray).

Fits a bare GPU machine with torch, transformers and accelerate, plus DeepSpeed, pydantic and hjson carried as
wheels (``bench/gpu_check_bundle.sh``). It:

1. builds a Qwen3-MoE of about 1 B parameters locally (``cluster.models.tiny_model``, random init; ``--size toy``: the
   tiny default shape, for the CPU test);
2. for each optimizer placement (``--offload``: ``none``, ``cpu`` or ``both``), in a fresh child process, starts
   one learner rank exactly as a ZeRO-3 GPU run does: ``learner.service.LearnerRank`` with the model built
   partitioned (``HfDeepSpeedConfig``, ``deepspeed.zero.Init``), bfloat16, gradient checkpointing, the device
   taken from the config (``learner.num_gpus_per_rank=1``);
3. runs ``--steps`` GSPO optimizer steps on synthetic rollouts (random token sequences, the behaviour log-probs
   recomputed by the learner so the ratios start at 1, group z-scored random advantages);
4. prints ONE JSON line: the device and where the state lives (``LearnerRank.devices``), peak GPU memory
   (``torch.cuda.max_memory_reserved``) against the plan's learner figure for the same settings
   (``cluster.planning.plan``), peak host RSS against the plan's ZeRO-3 load figure (``memory_model.zero3_load_host_gib``),
   seconds per step, whether every grad norm is finite and whether the weights moved. Exit status 0 when every
   check passes, 1 when one fails, 2 when there is no CUDA device (``--cpu`` runs it on the CPU: gloo, the CPU
   accelerator; what the CPU test does).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster.common import REPO_ROOT

#: the model shapes: about 1.07 B parameters (16 layers of 40 experts of 3 x 1024 x 512), and the CPU test's toy
SHAPES = {
    "1b": {"hidden_size": 1024, "num_layers": 16, "num_experts": 40, "num_experts_per_tok": 4,
           "moe_intermediate_size": 512, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64},
    "toy": {"hidden_size": 64, "num_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32},
}
#: synthetic rollout batch per size: (sequences, prompt tokens, longest response, micro-batch size)
BATCHES = {"1b": (32, 128, 384, 8), "toy": (8, 6, 10, 4)}
GROUP = 4  # completions per prompt (advantages are z-scored within each group)


def check_overrides(size: str, offload: str, on_gpu: bool) -> list[str]:
    """``configs/tiny_moe_zero2.yaml`` overrides for the check's run: the model shape, one learner rank of ZeRO-3 in
    bfloat16 with gradient checkpointing, the optimizer placement, and the device (one whole GPU)."""
    n, prompt, response, micro = BATCHES[size]
    return ([f"model.{k}={v}" for k, v in SHAPES[size].items()] + [
        "learner.world_size=1", "learner.zero_stage=3", "learner.dtype=bfloat16", "learner.gradient_checkpointing=true",
        f"learner.offload_optimizer={offload}", f"learner.micro_batch_size={micro}", "learner.num_minibatches=1",
        "learner.lr=1.0e-5", "learner.num_cpus_per_rank=1", f"learner.num_gpus_per_rank={1 if on_gpu else 0}",
        f"learner.threads_per_rank={4 if on_gpu else 1}", "learner.zero3_param_persistence_threshold=0",
        f"learner.max_tokens_per_micro_batch={micro * (prompt + response)}", "learner.kl_coef=0.0",
        f"data.max_prompt_tokens={prompt}", f"rollout.max_response_tokens={response}",
        f"rollout.max_model_len={prompt + response}", "cluster.gpus_per_node=1", "health.enabled=false",
        "trainer.run_name=gpu_learner_check", "wandb.mode=disabled"])


def check_config(size: str, offload: str, on_gpu: bool):
    """The run config of the check (``cluster.config.Config``): ``configs/tiny_moe_zero2.yaml`` with
    ``check_overrides``."""
    from cluster.config import load_config

    return load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml",
                       check_overrides(size, offload, on_gpu))


def plan_figures(cfg, gpu_memory_gib: float) -> dict[str, float]:
    """The plan's figures for ``cfg``: the learner rank's GPU claim (GiB; static state + one micro-batch) and the
    host RAM of its ZeRO-3 load for the check's float32 checkpoint (GiB), and the parameter count."""
    from cluster.planning import memory_model
    from cluster.planning.memory_budget import model_shape, num_params
    from cluster.planning.plan import plan

    mem = plan(cfg, gpu_memory_gib=gpu_memory_gib, gpus_per_node=1)["memory"]
    p = num_params(cfg)
    return {"num_params_b": round(p / 1e9, 4), "learner_gpu_gib": mem["learner_per_rank_gib"]["total"],
            "load_host_gib": round(memory_model.zero3_load_host_gib(model_shape(cfg), p, dtype="float32"), 2)}


def synthetic_batch(size: str, vocab: int, seed: int):
    """A rollout batch of random tokens (``learner.contracts.TrainBatch``): groups of ``GROUP`` completions of
    one prompt each, response lengths between a quarter of and the full maximum, z-scored random advantages
    per group; ``old_log_probs`` zero (the caller recomputes them)."""
    import torch

    from learner.contracts import TrainBatch

    n, prompt, response, _ = BATCHES[size]
    g = torch.Generator().manual_seed(seed)
    length = prompt + response
    ids = torch.randint(4, vocab, (n, length), generator=g)
    ids[:, :prompt] = ids[:: GROUP, :prompt].repeat_interleave(GROUP, 0)[:n]
    lens = torch.randint(max(1, response // 4), response + 1, (n,), generator=g)
    am = (torch.arange(length)[None] < (prompt + lens)[:, None]).long()
    ids = ids * am
    pos = torch.arange(length - 1)[None]
    resp = (pos >= prompt - 1) & (pos < (prompt + lens - 1)[:, None])
    adv = torch.randn(n, generator=g).view(-1, GROUP)
    adv = ((adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-6)).view(-1)
    return TrainBatch(ids, am, resp, torch.zeros(resp.shape), adv, torch.zeros(n),
                      [f"p{i // GROUP}" for i in range(n)], torch.zeros(n, dtype=torch.long))


def _peak_gpu_gib() -> float | None:
    import torch

    return round(torch.cuda.max_memory_reserved() / 2**30, 3) if torch.cuda.is_available() else None


def _host_peak_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)  # Linux: KiB


def run_variant(size: str, offload: str, model_path: str, steps: int, on_gpu: bool) -> dict[str, Any]:
    """One child's run: start the learner rank (partitioned ZeRO-3 build), ``steps`` GSPO optimizer steps on
    ``synthetic_batch``, and the figures of the JSON line for this optimizer placement."""
    import torch

    from learner.objectives import loss_normalisers
    from learner.service import LearnerRank

    cfg = check_config(size, offload, on_gpu)
    t0 = time.perf_counter()
    learner = LearnerRank(model_path, cfg.learner, rank=0, world_size=1, master_addr="127.0.0.1",
                          master_port=0, seed=0, temperature=cfg.rollout.temperature, partitioned_build=True)
    start_s = time.perf_counter() - t0
    host_after_load = _host_peak_gib()
    before = learner.state_digest()
    vocab = int(learner.engine.module.config.vocab_size)
    seconds, norms = [], []
    for step in range(steps):
        batch = synthetic_batch(size, vocab, seed=step)
        batch.old_log_probs = learner.compute_log_probs(batch)  # on-policy: the ratios start at 1
        s, t = loss_normalisers(batch.response_mask)
        if on_gpu:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        result = learner.train_rollout_batch([batch], [s], [t])
        if on_gpu:
            torch.cuda.synchronize()
        seconds.append(round(time.perf_counter() - t1, 3))
        norms.append(result.grad_norm)
    out = {"offload_optimizer": offload, "start_s": round(start_s, 1), "seconds_per_step": seconds,
           "grad_norms": norms, "grad_norm_finite": all(math.isfinite(x) for x in norms),
           "weights_moved": learner.state_digest() != before, "optimizer_steps": learner.optimizer_steps,
           "devices": learner.devices(), "peak_gpu_gib": _peak_gpu_gib(),
           "host_peak_after_load_gib": host_after_load, "host_peak_gib": _host_peak_gib()}
    learner.shutdown()
    return out


def variant_checks(result: dict[str, Any], plan: dict[str, float], steps: int, on_gpu: bool) -> dict[str, bool]:
    """The pass/fail checks of one variant's result: state on the expected devices (``cluster.runtime.devices``'
    rule: parameters on the GPU, optimizer state on the host when offloaded), finite grad norms, weights moved,
    every step applied, and (on a GPU) peak memory within the plan's learner figure."""
    want = "cuda" if on_gpu else "cpu"
    opt_want = "cpu" if result["offload_optimizer"] == "cpu" else want
    d = result["devices"]
    checks = {
        "built partitioned (zero.Init)": d["partitioned_build"],
        f"params on {want}": d["params"] == [want],
        f"optimizer state on {opt_want}": d["master"] == [opt_want] and d["optimizer_state"] == [opt_want],
        f"process group {'nccl' if on_gpu else 'gloo'}": d["backend"] == ("nccl" if on_gpu else "gloo"),
        "grad norm finite": result["grad_norm_finite"],
        "weights moved": result["weights_moved"],
        f"{steps} optimizer steps": result["optimizer_steps"] == steps,
    }
    if on_gpu:
        checks["peak GPU memory <= plan"] = result["peak_gpu_gib"] <= plan["learner_gpu_gib"]
    return checks


def _child(args: argparse.Namespace) -> int:
    on_gpu = not args.cpu
    result = run_variant(args.size, args.variant, args.model, args.steps, on_gpu)
    Path(args.result).write_text(json.dumps(result))
    return 0


def _spawn(args: argparse.Namespace, variant: str, model: Path, folder: Path) -> dict[str, Any]:
    """Run one variant in a fresh Python process (its own CUDA context, peak counters and DeepSpeed state)."""
    result = folder / f"{variant}.json"
    cmd = [sys.executable, "-m", "cluster.tools.gpu_learner_check", "--child", "--variant", variant, "--model", str(model),
           "--result", str(result), "--size", args.size, "--steps", str(args.steps)] + (["--cpu"] if args.cpu else [])
    env = dict(os.environ)
    if args.cpu:
        env["DS_ACCELERATOR"] = "cpu"
    else:
        env.pop("DS_ACCELERATOR", None)  # the learner sets it from the config
    proc = subprocess.run(cmd, env=env, timeout=args.timeout_s)
    if proc.returncode or not result.is_file():
        return {"offload_optimizer": variant, "error": f"child exited with status {proc.returncode}"}
    return json.loads(result.read_text())


def _device_info(cpu: bool) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"device": "cpu" if cpu else "cuda", "torch": torch.__version__}
    for name in ("deepspeed", "transformers", "accelerate"):
        try:
            from importlib.metadata import version

            info[name] = version(name)
        except Exception:  # noqa: BLE001 - reported as missing
            info[name] = None
    if not cpu:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.mem_get_info(0)[1] / 2**30, 1)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--offload", choices=["none", "cpu", "both"], default="both")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo, CPU accelerator): the CPU test")
    parser.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per variant (child process), seconds")
    parser.add_argument("--workdir", default=None, help="model folder's parent (default: a temporary folder)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu-learner-check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU "
              "machine, or with --cpu", file=sys.stderr)
        return 2
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Build the model, run the variants in child processes, print (and write) the JSON line."""
    from cluster.models.tiny_model import build_tiny_moe

    t0 = time.perf_counter()
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_learner_check_"))
    model = build_tiny_moe(folder / f"moe_{args.size}", seed=0, **SHAPES[args.size])
    build_s = time.perf_counter() - t0
    info = _device_info(args.cpu)
    variants = ["none", "cpu"] if args.offload == "both" else [args.offload]
    out: dict[str, Any] = {**info, "size": args.size, "model_build_s": round(build_s, 1), "variants": {}}
    ok = True
    for variant in variants:
        cfg = check_config(args.size, variant, not args.cpu)
        plan = plan_figures(cfg, info.get("gpu_memory_gib", 140.0))
        out["num_params_b"] = plan["num_params_b"]
        result = _spawn(args, variant, model, folder)
        if "error" in result:
            checks = {"ran": False}
        else:
            checks = variant_checks(result, plan, args.steps, not args.cpu)
        result.update(plan_learner_gpu_gib=plan["learner_gpu_gib"], plan_load_host_gib=plan["load_host_gib"],
                      checks=checks)
        out["variants"][variant] = result
        ok = ok and all(checks.values())
    out["ok"], out["total_s"] = ok, round(time.perf_counter() - t0, 1)
    line = json.dumps(out)
    print(line, flush=True)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
