"""GPU smoke test (``make gpu-smoke``; not part of ``make test``): the GPU path of a real run, with no hub.

Builds a small Qwen3-MoE locally (``builtin:tiny_moe`` with 64 experts, random init, trained and sampled in
bfloat16), runs 3 RL steps with 1 vLLM engine and 1 learner rank (ZeRO-3, built partitioned) sharing one GPU,
then checks, from the run's ``metrics.jsonl`` and from the device:

- engine vs learner log-probs after each weight sync (``actor/train_rollout_logprob_diff``: the learner's
  recomputed log-probs of the sampled tokens against the engine's, at the same weights), below
  ``--max-logprob-diff``;
- the KV tokens vLLM gave the engine (a fresh engine on the same config) against the plan's
  ``kv_tokens_per_engine`` (at least ``--min-kv-share`` of it);
- the peak GPU memory in use during the run (NVML, sampled every 0.5 s) against the plan's claim for the GPU;
- the bytes of each weight sync against the model's parameter count x 2 (bfloat16);
- where the run trained and sampled (``<run_dir>/devices.json``, ``cluster.runtime.devices``): the learner's
  parameters, master weights and optimizer state on CUDA with an NCCL process group, the engine's weights on
  CUDA; a learner that fell back to the CPU fails the smoke.

``--dry-run`` prints the smoke config's plan and starts nothing (works on the CPU). Without a CUDA device the
script refuses, saying so. Exit status 0 when every check passes, 1 otherwise (the failed checks printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from cluster.config import apply_overrides, load_config
from cluster.planning.memory_budget import num_params
from cluster.planning.plan import plan
from cluster.runtime.devices import DEVICES_FILE, device_problems

#: the smoke run's overrides of configs/tiny_moe_zero2.yaml (one GPU: the learner and the engine share it).
SMOKE_OVERRIDES = [
    "model.num_experts=64", "model.num_experts_per_tok=4", "model.hidden_size=256", "model.num_layers=4",
    "model.moe_intermediate_size=256", "model.num_attention_heads=8", "model.num_key_value_heads=4",
    "model.head_dim=64",
    "learner.world_size=1", "learner.num_gpus_per_rank=0.4", "learner.zero_stage=3", "learner.dtype=bfloat16",
    "learner.old_logprob_source=recompute", "learner.gradient_checkpointing=true",
    "learner.max_tokens_per_micro_batch=2048",
    "rollout.num_gpus_per_engine=0.5", "rollout.dtype=bfloat16", "rollout.gpu_memory_utilization=0.4",
    "rollout.in_process=false",
    "warm_start.steps=0", "trainer.total_steps=3", "trainer.eval_every=100", "trainer.save_every=100",
    "trainer.run_name=gpu_smoke", "wandb.mode=disabled", "health.enabled=false",
]


def smoke_yaml(gpu_memory_gib: float, folder: Path) -> Path:
    """Write the smoke run's config file into ``folder``: configs/tiny_moe_zero2.yaml without its CPU-only
    ``rollout.kv_cache_gb`` (refused on a GPU), with ``SMOKE_OVERRIDES`` and one GPU of ``gpu_memory_gib``."""
    raw = yaml.safe_load(Path("configs/tiny_moe_zero2.yaml").read_text())
    raw["rollout"].pop("kv_cache_gb", None)
    raw = apply_overrides(raw, SMOKE_OVERRIDES + [f"cluster.gpu_memory_gib={gpu_memory_gib}", "cluster.gpus_per_node=1"])
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "gpu_smoke.yaml"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


class _PeakMemory:
    """Peak memory in use on GPU 0 (NVML through torch), sampled every ``period_s`` in a thread, GiB."""

    def __init__(self, period_s: float = 0.5):
        import torch

        self._torch, self.period_s, self.peak = torch, period_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = self._torch.cuda.mem_get_info(0)
            self.peak = max(self.peak, (total - free) / 2**30)
            self._stop.wait(self.period_s)

    def __enter__(self) -> "_PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _engine_kv_tokens(cfg) -> int:
    """KV tokens vLLM gives one engine of ``cfg`` (a fresh engine actor on the run's model)."""
    import ray

    from rollout.engine import RolloutEngine
    from cluster.models.resolve import ensure_model

    m = cfg.model
    build = m.build_kwargs()
    path = ensure_model(m.path, cfg.run_dir / "model", seed=m.build_seed, **build)  # the run's folder, already built
    ray.init(ignore_reinit_error=True, include_dashboard=False)
    try:
        engine = ray.remote(RolloutEngine).options(num_gpus=cfg.rollout.num_gpus_per_engine).remote(str(path), cfg.rollout)
        return int(ray.get(engine.kv_cache_tokens.remote()))
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the smoke config's plan; start nothing")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="default: the device's (140 on --dry-run)")
    parser.add_argument("--max-logprob-diff", type=float, default=0.05)
    parser.add_argument("--min-kv-share", type=float, default=0.5)
    args = parser.parse_args(argv)
    if args.dry_run:
        cfg = load_config(smoke_yaml(args.gpu_memory_gib or 140.0, Path(tempfile.mkdtemp(prefix="gpu_smoke_"))))
        print(yaml.safe_dump({"overrides": SMOKE_OVERRIDES, "plan": plan(cfg, gpu_memory_gib=cfg.cluster.gpu_memory_gib,
                                                                          gpus_per_node=1)}, sort_keys=False))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu-smoke: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, or "
              "use --dry-run to print the plan", file=sys.stderr)
        return 2
    total_gib = torch.cuda.mem_get_info(0)[1] / 2**30
    config_file = smoke_yaml(args.gpu_memory_gib or total_gib, Path("outputs/gpu_smoke_config"))
    cfg = load_config(config_file)
    p = plan(cfg, gpu_memory_gib=cfg.cluster.gpu_memory_gib, gpus_per_node=1)
    from cluster.train import main as train_main

    t0 = time.time()
    with _PeakMemory() as peak:
        rc = train_main([str(config_file)])
    if rc:
        print(f"gpu-smoke: the training run failed (exit status {rc})", file=sys.stderr)
        return 1
    records = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in records if "actor/train_rollout_logprob_diff" in r]
    devices_file = Path(cfg.run_dir) / DEVICES_FILE
    device_report = json.loads(devices_file.read_text()) if devices_file.is_file() else {}
    wrong_device = device_problems(device_report, cfg) if device_report else [f"no {devices_file}"]
    kv_engine = _engine_kv_tokens(cfg)
    mem = p["memory"]
    expected_sync = 2 * num_params(cfg)
    checks = {
        "3 steps logged": len(steps) >= 3,
        f"logprob diff < {args.max_logprob_diff}": all(r["actor/train_rollout_logprob_diff"] < args.max_logprob_diff
                                                      for r in steps),
        f"kv tokens >= {args.min_kv_share} x plan": kv_engine >= args.min_kv_share * mem["rollout_kv"]["kv_tokens_per_engine"],
        "peak GPU memory <= plan": peak.peak <= mem["fullest_gpu"]["claimed_gib"],
        "sync bytes = 2 x params": all(abs(r["sync/bytes"] - expected_sync) <= 0.01 * expected_sync
                                       for r in records if r.get("sync/bytes")),
        "learner and engine on CUDA": not wrong_device,
    }
    print(yaml.safe_dump({
        "seconds": round(time.time() - t0, 1),
        "logprob_diff_per_step": [r["actor/train_rollout_logprob_diff"] for r in steps],
        "kv_tokens": {"engine": kv_engine, "plan": mem["rollout_kv"]["kv_tokens_per_engine"]},
        "peak_gpu_gib": round(peak.peak, 2), "plan_gpu_claim_gib": mem["fullest_gpu"]["claimed_gib"],
        "sync_bytes": sorted({r["sync/bytes"] for r in records if r.get("sync/bytes")}), "expected_sync_bytes": expected_sync,
        "devices": device_report, "device_problems": wrong_device,
        "checks": checks}, sort_keys=False))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
