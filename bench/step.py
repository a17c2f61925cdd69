"""Time breakdown of RL steps on the default config, and rollout throughput against a baseline.

    python bench/step.py [CONFIG] [--steps N] [dotted.key=value ...]

Runs the real pipeline for a few steps (no warm start, no eval) and prints the mean seconds per phase and
the rollout tokens/s. In the same invocation it generates the same number of completions for the same
prompts with transformers ``generate`` (sampling, same temperature and length limit, one process, same
thread count as one engine) and prints our rollout tokens/s as a ratio of that baseline.
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


def hf_generate_tokens_per_s(model_path: str, prompts: list[list[int]], n: int, max_new: int, temperature: float,
                             threads: int, eos: int, pad: int) -> tuple[float, int, float]:
    """Baseline: transformers generate with left padding, sampling, ``n`` return sequences per prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_p=1.0,
                             top_k=0, max_new_tokens=max_new, num_return_sequences=n, eos_token_id=eos,
                             pad_token_id=pad)
    dt = time.perf_counter() - t
    new = out[:, L:]
    # tokens up to and including the first EOS count as generated
    tokens = 0
    for row in new.tolist():
        tokens += (row.index(eos) + 1) if eos in row else len(row)
    return tokens / dt, tokens, dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default="configs/tiny_moe.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from cluster.config import load_config
    from cluster.driver.trainer import Trainer

    out = tempfile.mkdtemp(prefix="bench-")
    cfg = load_config(args.config, [*args.overrides, f"trainer.output_dir={out}", "trainer.run_name=bench",
                                    f"trainer.total_steps={args.steps}", "warm_start.steps=0", "wandb.mode=disabled",
                                    "trainer.save_every=0", "trainer.plots=false"])
    t = Trainer(cfg)
    t0 = time.perf_counter()
    t.start()
    startup = time.perf_counter() - t0
    steps = []
    from cluster.data.prompts import PromptStream

    # the prompts of the first step, for the baseline
    first_prompts = PromptStream(t.train_rows, seed=t.stream.seed, position=t.stream.position).take(
        cfg.trainer.prompts_per_step)
    try:
        for _ in range(args.steps):
            steps.append(t.rl_step())
    finally:
        t.shutdown()
        import ray

        ray.shutdown()
    phases = ["timing/rollout_s", "timing/reward_s", "timing/learner_s", "timing/weight_sync_s", "timing/step_s"]
    rep = {k: statistics.mean(s[k] for s in steps[1:] or steps) for k in phases}
    ours = statistics.mean(s["throughput/rollout_tokens_per_s"] for s in steps[1:] or steps)
    base, base_tokens, base_s = hf_generate_tokens_per_s(
        t.model_path, [r.prompt_token_ids for r in first_prompts], cfg.trainer.group_size,
        cfg.rollout.max_response_tokens, cfg.rollout.temperature, cfg.rollout.threads_per_engine,
        t.tokenizer.eos_token_id, t.pad_id)
    print(f"start-up (Ray, {cfg.learner.world_size} learner ranks, {cfg.rollout.num_engines} engines, "
          f"{cfg.reward.num_workers} reward workers): {startup:.1f} s")
    print(f"mean over steps 2..{args.steps} (seconds):")
    for k in phases:
        share = 100 * rep[k] / rep["timing/step_s"]
        print(f"  {k:24s} {rep[k]:7.3f}  ({share:4.1f}% of a step)")
    print(f"rollout tokens/s (vLLM engines):            {ours:9.0f}")
    print(f"baseline tokens/s (transformers generate):  {base:9.0f}  ({base_tokens} tokens in {base_s:.2f} s)")
    print(f"ratio ours / baseline:                      {ours / base:9.2f}x")
    print(json.dumps({"phases_s": rep, "rollout_tokens_per_s": ours, "baseline_tokens_per_s": base,
                      "ratio": ours / base, "startup_s": startup}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
