"""Weight-sync time and bytes against a plain in-memory copy of the same bytes, for MoE models of three sizes.

    python bench/sync.py [--sizes 1m,50m,200m] [--syncs 3] [--engines 1]

For each size it builds a random Qwen3-MoE (hidden 512 / 16 experts top-2 / moe_intermediate 512 / heads 8/4 /
head_dim 64 for 50 M (4 layers) and 200 M (15 layers); the embedded tiny model for 1 M), starts one learner rank
(DeepSpeed ZeRO-2, CPU) and ``--engines`` in-process vLLM engines as Ray actors, and times
``LearnerRank.sync_weights`` (the production path: layer buckets through the object store, vLLM's layer-wise
reload) over ``--syncs`` syncs after one warm-up. In the same invocation it times ``clone()`` of tensors of the
same sizes (the physical limit of moving those bytes once here) and prints the ratio. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = {  # name: build_tiny_moe arguments
    "1m": {},
    "50m": dict(hidden_size=512, num_layers=4, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "200m": dict(hidden_size=512, num_layers=15, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64),
}


def clone_seconds(shapes: list[tuple[int, ...]], repeats: int = 3) -> float:
    """Best of ``repeats`` clones of float32 tensors of ``shapes`` (one copy of every byte)."""
    import torch

    src = [torch.randn(s) for s in shapes]
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = [x.clone() for x in src]
        best = min(best, time.perf_counter() - t)
        del out
    return best


def bench_size(ray, name: str, args, root: Path) -> dict:
    import torch
    from safetensors import safe_open

    from cluster.common import free_port
    from cluster.tiny_model import build_tiny_moe
    from learner.config import LearnerConfig
    from learner.contracts import SFTBatch
    from learner.service import LearnerRank
    from rollout.config import RolloutConfig
    from rollout.engine import RolloutEngine

    path = str(build_tiny_moe(root / name, seed=0, **SIZES[name]))
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        shapes = [tuple(f.get_slice(k).get_shape()) for k in f.keys()]
    nbytes = sum(4 * int(torch.Size(s).numel()) for s in shapes)
    learner = ray.remote(LearnerRank).options(num_cpus=1).remote(
        path, LearnerConfig(zero_stage=2, micro_batch_size=4, lr=1e-3), rank=0, world_size=1,
        master_addr="127.0.0.1", master_port=free_port(), seed=0, temperature=1.0)
    env = {"env_vars": {"TORCH_COMPILE_DISABLE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}}
    engines = [ray.remote(RolloutEngine).options(num_cpus=0.5, runtime_env=env).remote(
        path, RolloutConfig(max_model_len=64, max_response_tokens=4, kv_cache_gb=0.25), engine_index=i,
        cache_dir=str(root / f"cache{i}")) for i in range(args.engines)]
    try:
        ray.get([learner.pid.remote()] + [e.pid.remote() for e in engines])
        ids = torch.randint(4, 60, (4, 16))
        batch = SFTBatch(ids, torch.ones_like(ids), torch.ones((4, 15), dtype=torch.bool))
        reports = []
        for v in range(1, args.syncs + 2):
            ray.get(learner.sft_step.remote(batch, 60))  # new weights each time
            t = time.perf_counter()
            rep = ray.get(learner.sync_weights.remote(engines, v, args.bucket_mb, 2))
            rep["wall_s"] = time.perf_counter() - t
            if rep["failed_engines"]:
                raise RuntimeError(f"engines failed: {rep['failed_engines']}")
            reports.append(rep)
    finally:
        for a in [learner, *engines]:
            ray.kill(a)
    timed = reports[1:]
    sync_s = statistics.median(r["wall_s"] for r in timed)
    copy_s = clone_seconds(shapes)
    return {"size": name, "params_m": nbytes / 4e6, "weight_bytes": nbytes, "engines": args.engines,
            "sync_bytes": timed[-1]["bytes"], "buckets": timed[-1]["buckets"], "sync_s": sync_s,
            "sync_s_all": [r["wall_s"] for r in timed], "gb_per_s": timed[-1]["bytes"] / sync_s / 1e9,
            "copy_s": copy_s, "ratio_to_copy": sync_s / copy_s}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1m,50m,200m")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import ray

    root = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent),
                                       "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}})
    results = []
    try:
        for name in args.sizes.split(","):
            r = bench_size(ray, name, args, root)
            results.append(r)
            print(f"{name:>5}: {r['params_m']:6.1f} M params, {r['weight_bytes'] / 1e6:7.1f} MB x {r['engines']} engine(s) "
                  f"in {r['buckets']} buckets: sync {r['sync_s']:.3f} s ({r['gb_per_s']:.2f} GB/s, "
                  f"bytes sent {r['sync_bytes'] / 1e6:.1f} MB) | clone {r['copy_s']:.3f} s | "
                  f"ratio {r['ratio_to_copy']:.2f}x", flush=True)
    finally:
        ray.shutdown()
    print(json.dumps({"load_avg_1m": os.getloadavg()[0], "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
