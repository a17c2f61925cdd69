"""Seconds per learner update on the default config: rank count, ZeRO stage, the pre-update pass, gradient
checkpointing, token-budget micro-batches, side by side in one invocation.

    python bench/learner.py [CONFIG] [--rounds N] [--only NAME,NAME] [dotted.key=value ...]

What is timed: ``train_rollout_batch`` on every learner rank (Ray actors, one process and one torch thread per
rank, as the driver runs them), wall seconds from the call to the last rank's answer, for one rollout batch
shaped like the driver's: ``trainer.prompts_per_step`` prompts of the config's data, ``trainer.group_size``
completions each sampled from the config's model at ``rollout.temperature`` with at most
``rollout.max_response_tokens`` tokens (transformers ``generate``), behaviour log-probs from the same model,
rewards by exact match (the model is not warm-started here, so most are 0; no timed operation depends on the
values), group advantages, cut into ``learner.num_minibatches`` minibatches and the ranks' shards
by ``cluster.driver.batching.split_for_ranks``. The health guard is the config's (``health.guard()``).

Variants (all from the config's learner section; each on its own engine, built once):

- ``default``: the config as it is (tiny_moe.yaml: 1 rank, ZeRO-0, a guard without pre-checks, the mismatch
  monitor; tiny_moe_zero2.yaml: 2 ranks, ZeRO-2, MoE diagnostics and the guard's pre-checks, so the pre-update
  pass runs);
- ``pass_always`` / ``pass_skipped``: MoE diagnostics off and a guard with ``max_grad_norm`` only, the
  pre-update pass forced on (``always``) or left to ``auto`` (nothing needs it: skipped): the cost of the pass
  alone; ``pass_separate``: ``pass_always`` without ``learner.fuse_first_minibatch`` (the pass forwards the first
  minibatch too, instead of taking it from that minibatch's training forwards);
- ``ranks2_zero{0,1}``, ``ranks1_zero{0,1,2}``: the default with another rank count / ZeRO stage (1 rank
  trains the whole minibatch with micro-batches of ``micro_batch_size x 2`` rows: as many passes as each of
  2 ranks runs); ``ranks1_zero2_threads2``: one rank with 2 torch threads (the cores 2 ranks have);
- ``checkpointing``: the default with ``learner.gradient_checkpointing=true``;
- ``token_budget``: the default with ``learner.max_tokens_per_micro_batch`` = a quarter of a rank's shard;
- ``lora``: the default with ``learner.lora`` rank 8, alpha 16 (the attention projections; switched on as the
  driver does after the warm start).
- ``grpo``, ``ppo``: the default with ``learner.algorithm`` grpo, or ppo (its critic: a second engine per rank).
- ``padded``: the default without sequence packing (``learner.pack_sequences=false``); ``packed_flat`` (or
  ``packed_bins``): the default with the other ``learner.packing_layout``; ``bf16_autocast``: with
  ``learner.autocast=bfloat16`` (float32 configs); ``bf16_deepspeed``: with ``learner.dtype=bfloat16`` at ZeRO
  stage >= 1, the learner ``precision=bf16`` runs (float32 configs; compare with ``ranks1_zero1`` for the stage);
- the ceiling, ``plain_torch_padded`` / ``plain_torch_packed`` / ``plain_torch_packed_bf16``: one plain torch
  forward+backward of the same batch in the bench's own process (transformers, 1 thread, no DeepSpeed, Ray or
  optimizer), padded micro-batches of ``micro_batch_size`` rows, or packed (``learner.packing``); float32 weights,
  or bfloat16 with float32 attention (the learner's bf16 on the CPU). A variant is compared with the ceiling of
  its own ``learner.dtype``. Learner and ceiling are printed as tokens/s over the
  batch's real tokens, and the log-prob gap of bf16 autocast against float32 on the response tokens.

The batch line gives, under ``packing``, the positions the default variant's training forwards run (packed, and
what padding each micro-batch to its longest row would run) and ``packed_pad_share``: the share of packed
positions that are padding (the bins' unused tails).

Rounds interleave the variants (round r runs one update of every variant, in an order rotated by r, so none
always runs first after the ceiling's passes), so a change of machine load hits all of them alike; the first update of each variant is a warm-up and is not timed. Printed: per
variant the median and the minimum seconds per update and both as ratios of ``default``'s (on a busy machine
the noise only adds time, so the minimum is the steadier estimate of the cost itself), the pass's cost
(``pass_skipped / pass_always``), the load average before and after, and the last line one JSON object with
everything.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def variants(cfg, shard_tokens: int) -> dict[str, tuple[int, dict, dict | None]]:
    """name -> (world size, learner-config overrides, guard) for the config ``cfg``."""
    base_guard = cfg.health.guard()
    lean_guard = {"max_grad_norm": 1000.0} if base_guard is not None else None
    lc = cfg.learner
    ws = lc.world_size
    other = 1 if ws != 1 else 2
    out: dict[str, tuple[int, dict, dict | None]] = {
        "default": (ws, {}, base_guard),
        "pass_always": (ws, {"moe_diagnostics": False, "pre_update_pass": "always"}, lean_guard),
        "pass_skipped": (ws, {"moe_diagnostics": False, "pre_update_pass": "auto", "mismatch_monitor_every": 0},
                         lean_guard),
        "pass_separate": (ws, {"moe_diagnostics": False, "pre_update_pass": "always", "fuse_first_minibatch": False},
                          lean_guard),
    }
    for n in (ws, other):
        # the same rows per forward/backward in all: a rank's shard of a minibatch is ws / n times the default's
        mb = {} if n == ws else {"micro_batch_size": max(lc.micro_batch_size * ws // n, 1)}
        for stage in (0, 1, 2):
            if (n, stage) != (ws, lc.zero_stage):
                out[f"ranks{n}_zero{stage}"] = (n, {"zero_stage": stage, **mb}, base_guard)
    if other == 1 and ws * lc.threads_per_rank <= (os.cpu_count() or 1):
        # one rank with the cores the ranks had: the rank count against threads per rank
        out[f"ranks1_zero{lc.zero_stage}_threads{ws}"] = (
            1, {"zero_stage": lc.zero_stage, "threads_per_rank": ws * lc.threads_per_rank,
                "micro_batch_size": lc.micro_batch_size * ws}, base_guard)
    out["checkpointing"] = (ws, {"gradient_checkpointing": True}, base_guard)
    out["padded"] = (ws, {"pack_sequences": False}, base_guard)  # no sequence packing: the padded forward
    for layout in ("bins", "flat"):  # learner.packing_layout
        if layout != lc.packing_layout:
            out[f"packed_{layout}"] = (ws, {"packing_layout": layout}, base_guard)
    if lc.dtype == "float32":
        out["bf16_autocast"] = (ws, {"autocast": "bfloat16"}, base_guard)
        # what precision=bf16 runs: bf16 weights under DeepSpeed (fp32 master copy), ZeRO >= 1
        out["bf16_deepspeed"] = (ws, {"dtype": "bfloat16", "zero_stage": max(lc.zero_stage, 1)}, base_guard)
    out["token_budget"] = (ws, {"max_tokens_per_micro_batch": max(shard_tokens // 4, 1)}, base_guard)
    out["lora"] = (ws, {"lora": {"rank": 8, "alpha": 16}}, base_guard)
    out["grpo"] = (ws, {"algorithm": "grpo"}, base_guard)  # token ratios, group advantages
    out["ppo"] = (ws, {"algorithm": "ppo"}, base_guard)  # grpo's loss + the critic's passes and updates (docs/ppo.md)
    return out


def driver_batch(cfg, model_path: str):
    """A rollout batch as the driver builds it (see the module docstring). Returns ``(TrainBatch, facts)``."""
    import torch
    from transformers import AutoModelForCausalLM

    from cluster.driver.batching import build_train_batch
    from cluster.data.prompts import PromptStream
    from cluster.data.tasks import load_rows, load_tokenizer
    from learner.advantages import group_advantages
    from learner.logprobs import token_log_probs
    from rollout.contracts import Completion

    tok = load_tokenizer(model_path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rows, _ = load_rows(cfg, tok)
    prompts = PromptStream(rows, seed=cfg.trainer.seed).take(cfg.trainer.prompts_per_step)
    G, L, temp = cfg.trainer.group_size, cfg.rollout.max_response_tokens, cfg.rollout.temperature
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    torch.manual_seed(cfg.trainer.seed)
    completions, rewards = [], []
    with torch.no_grad():
        for row in prompts:
            ids = torch.tensor([row.prompt_token_ids])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temp,
                                 top_p=1.0, top_k=0, max_new_tokens=L, num_return_sequences=G,
                                 eos_token_id=tok.eos_token_id, pad_token_id=pad)
            for j, seq in enumerate(out[:, ids.shape[1]:].tolist()):
                resp = seq[: seq.index(tok.eos_token_id) + 1] if tok.eos_token_id in seq else seq
                text = tok.decode(resp, skip_special_tokens=True)
                completions.append(Completion(row.uid, j, row.prompt_token_ids, resp, [0.0] * len(resp), text,
                                              "stop" if tok.eos_token_id in resp else "length", 0))
                rewards.append(1.0 if text.strip() == row.answer.strip() else 0.0)
    r = torch.tensor(rewards)
    adv = group_advantages(r, G, normalize_std=cfg.learner.normalize_adv_std)
    batch = build_train_batch(completions, r, adv, pad)
    with torch.no_grad():  # behaviour log-probs: the model that sampled, post-temperature
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        lp = token_log_probs(logits, batch.input_ids[:, 1:], temp)
    batch.old_log_probs = torch.where(batch.response_mask, lp, 0.0).float()
    facts = {"sequences": len(batch), "padded_length": int(batch.input_ids.shape[1]),
             "real_tokens": int(batch.attention_mask.sum()),
             "response_tokens": int(batch.response_mask.sum()), "reward_mean": float(r.mean())}
    return batch, facts


def packing_facts(plans: list, lc) -> dict[str, float]:
    """Positions the default variant's training forwards run over the ranks' ``plans`` (``RankPlan``s): its
    micro-batches (``learner.microbatch.micro_slices`` with ``lc``'s settings, rows longest first with
    ``group_by_length``), each packed (``learner.packing.PackedRows``) or padded to its longest row. Returns the
    real tokens, both position counts and the share of packed positions that are padding (bins' tails)."""
    from learner.microbatch import length_order, micro_slices, row_widths
    from learner.packing import PackedRows

    tokens = packed = padded = 0
    for plan in plans:
        for mb in plan.minibatches:
            if lc.group_by_length:
                mb = mb.select(length_order(mb.attention_mask))
            for lo, hi in micro_slices(mb.attention_mask, lc.micro_batch_size, lc.max_tokens_per_micro_batch):
                w = max(row_widths(mb.attention_mask[lo:hi]))
                am, mask = mb.attention_mask[lo:hi, :w], mb.response_mask[lo:hi, : w - 1]
                p = PackedRows(am, mask)
                tokens, packed, padded = tokens + p.num_tokens, packed + p.num_positions, padded + am.numel()
    return {"real_tokens": tokens, "packed_positions": packed, "padded_positions": padded,
            "packed_pad_share": 1 - tokens / packed if packed else 0.0}


def plain_torch(model, batch, micro_batch_size: int, temperature: float, packed: bool) -> float:
    """Seconds of one plain-torch forward+backward over ``batch`` in this process (no DeepSpeed, no Ray, no
    optimizer): a response-token log-prob sum per micro-batch of ``micro_batch_size`` rows, padded to the micro-batch's
    width (``packed=False``) or packed (``learner.packing``)."""
    import torch

    from learner.logprobs import token_log_probs
    from learner.packing import PackedRows

    t = time.perf_counter()
    for lo in range(0, len(batch), micro_batch_size):
        ids, am = batch.input_ids[lo:lo + micro_batch_size], batch.attention_mask[lo:lo + micro_batch_size]
        w = max(int(am.sum(-1).max()), 2)  # right padded: trimmed to the micro-batch's longest row, as the learner
        ids, am, mask = ids[:, :w], am[:, :w], batch.response_mask[lo:lo + micro_batch_size, : w - 1]
        if packed:
            p = PackedRows(am, mask)
            logits = p.wanted_logits(model, ids)
            loss = token_log_probs(logits, p.target_ids(ids), temperature).sum()
        else:
            logits = model(input_ids=ids, attention_mask=am).logits[:, :-1]
            loss = torch.where(mask, token_log_probs(logits, ids[:, 1:], temperature), 0.0).sum()
        loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def bf16_gap(model, batch, temperature: float) -> dict[str, float]:
    """The log-prob gap bf16 autocast costs: mean and max |log p (bf16 autocast) - log p (float32)| over the
    response tokens, one padded forward of ``batch`` each (the float32 forward is what the fp32 engine matches
    within ~1e-6, docs/benchmarks.md)."""
    import torch

    from learner.logprobs import token_log_probs

    with torch.no_grad():
        lp = token_log_probs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1],
                             batch.input_ids[:, 1:], temperature)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        lp16 = token_log_probs(logits.float(), batch.input_ids[:, 1:], temperature)
    d = (lp16 - lp).abs()[batch.response_mask]
    return {"mean": float(d.mean()), "max": float(d.max())}


class RankHost:
    """One learner process (a Ray actor): a ``LearnerRank`` per variant, all in one process group."""

    def __init__(self, model_path: str, rank: int, world_size: int, port: int, temperature: float, seed: int):
        self.args = dict(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, seed=seed,
                         temperature=temperature)
        self.model_path = model_path
        self.ranks: dict = {}

    def add(self, name: str, learner_cfg: dict) -> int:
        from learner.config import LearnerConfig
        from learner.service import LearnerRank

        self.ranks[name] = LearnerRank(self.model_path, LearnerConfig(**learner_cfg), **self.args)
        self.ranks[name].enable_lora()  # learner.lora set: the switch the driver makes after the warm start
        return os.getpid()

    def train(self, name: str, plan, guard) -> dict:
        """One update of variant ``name``; its logged float metrics (``RolloutTrainResult.metrics``)."""
        result = self.ranks[name].train_rollout_batch(plan.minibatches, plan.num_sequences, plan.num_tokens,
                                                      guard=guard)
        return {k: v for k, v in result.metrics.items() if isinstance(v, float)}


def start_hosts(ray, model_path: str, cfg, groups: set[tuple[int, int]]) -> dict[tuple[int, int], list]:
    """One group of ``RankHost`` actors per (world size, threads per rank): each group its own process group,
    and a process's torch thread count is one setting for every engine it holds."""
    from cluster.common import free_port

    cls = ray.remote(RankHost).options(num_cpus=cfg.learner.num_cpus_per_rank)
    hosts = {}
    for n, threads in sorted(groups):
        port = free_port("127.0.0.1")
        hosts[n, threads] = [cls.remote(model_path, r, n, port, cfg.rollout.temperature, cfg.trainer.seed)
                             for r in range(n)]
    return hosts


def run(cfg, model_path: str, rounds: int, only: list[str] | None) -> dict:
    """Build the variants' engines, then ``rounds`` interleaved rounds of one update each."""
    import ray

    from cluster.driver.batching import split_for_ranks

    batch, facts = driver_batch(cfg, model_path)
    shard_rows = len(batch) // (cfg.learner.num_minibatches * cfg.learner.world_size)
    table = variants(cfg, shard_tokens=shard_rows * facts["padded_length"])
    if only:
        table = {k: v for k, v in table.items() if k in only or k == "default"}
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    ray.init(address="local", num_cpus=max(os.cpu_count() or 2, 2), include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})
    try:
        key = {name: (n, over.get("threads_per_rank", cfg.learner.threads_per_rank))
               for name, (n, over, _) in table.items()}
        hosts = start_hosts(ray, model_path, cfg, set(key.values()))
        split = {n: split_for_ranks(batch, cfg.learner.num_minibatches, n, cfg.trainer.seed) for n in {n for n, _ in hosts}}
        plans = {n: [ray.put(p) for p in rank_plans] for n, rank_plans in split.items()}
        facts["packing"] = packing_facts(split[cfg.learner.world_size], cfg.learner)
        t0 = time.perf_counter()
        for name, (n, over, _) in table.items():
            learner_cfg = {**cfg.learner.model_dump(), "world_size": n, **over}
            ray.get([h.add.remote(name, learner_cfg) for h in hosts[key[name]]])
        build_s = time.perf_counter() - t0
        seconds: dict[str, list[float]] = {name: [] for name in [*table, *PLAIN]}
        last: dict[str, dict] = {}
        models = {dtype: plain_model(model_path, dtype) for dtype in {d for _, d in PLAIN.values()}}
        model = models["float32"]
        names = list(table)
        for rnd in range(rounds + 1):  # round 0: warm-up
            # the order rotates by one each round: no variant always runs first, after the ceiling's passes in
            # this process (measured: the first ran 6-9% slower than the same settings later in the round)
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                n, _, guard = table[name]
                t = time.perf_counter()
                outs = ray.get([h.train.remote(name, plans[n][r], guard) for r, h in enumerate(hosts[key[name]])])
                if rnd:
                    seconds[name].append(time.perf_counter() - t)
                last[name] = outs[0]
            for name, (packed, dtype) in PLAIN.items():
                s = plain_torch(models[dtype], batch, cfg.learner.micro_batch_size, cfg.rollout.temperature, packed)
                if rnd:
                    seconds[name].append(s)
        gap = bf16_gap(model, batch, cfg.rollout.temperature)
    finally:
        ray.shutdown()
    return {"batch": facts, "build_s": build_s, "seconds": seconds, "last": last, "table": table, "bf16_gap": gap,
            "learner_dtype": cfg.learner.dtype}


# the ceiling: plain torch forward+backward of the batch's tokens in the bench's own process (1 thread):
# name -> (packed, dtype of the weights)
PLAIN = {"plain_torch_padded": (False, "float32"), "plain_torch_packed": (True, "float32"),
         "plain_torch_packed_bf16": (True, "bfloat16")}


def plain_model(model_path: str, dtype: str = "float32"):
    """The model in ``dtype`` under plain transformers, for the ceiling (bf16: attention in float32, as the
    learner runs it on the CPU, learner/attention.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.attention import use_fp32_attention

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    if dtype == "bfloat16":
        use_fp32_attention(model)
    return model


def report(res: dict, load_before: tuple, load_after: tuple, rounds: int) -> dict:
    """Print the table and return the JSON summary."""
    sec, table = res["seconds"], res["table"]
    base, base_min = statistics.median(sec["default"]), min(sec["default"])
    rows = {}
    print(f"batch: {res['batch']}; engines built in {res['build_s']:.1f} s; {rounds} timed update(s) per variant")
    print(f"{'variant':22s} {'ranks':>5s} {'median s':>9s} {'min s':>7s} {'x default (median, min)':>24s}  "
          "pre-update pass  settings")
    for name, (n, over, guard) in table.items():
        med, low = statistics.median(sec[name]), min(sec[name])
        ran = "actor/entropy" in res["last"][name]
        rows[name] = {"world_size": n, "overrides": over, "guard": guard, "median_s": med, "min_s": low,
                      "ratio_to_default": med / base, "min_ratio_to_default": low / base_min,
                      "pre_update_pass_ran": ran, "all_s": sec[name]}
        print(f"{name:22s} {n:5d} {med:9.3f} {low:7.3f} {med / base:15.2f} {low / base_min:8.2f}  "
              f"{'ran' if ran else 'skipped':15s}  {over or '(config)'}")
    tokens = res["batch"]["real_tokens"]
    ceiling = {name: tokens / statistics.median(sec[name]) for name in PLAIN}
    best = {dtype: max(c for name, c in ceiling.items() if PLAIN[name][1] == dtype) for _, dtype in PLAIN.values()}
    print(f"tokens/s over the batch's {tokens} real tokens (learner: one update, its passes included; ceiling: "
          f"one plain torch forward+backward of the same tokens in this process, 1 thread, in the learner's "
          f"dtype; a learner rank's threads are the mean over its last update's micro-batches):")
    for name in [*table, *PLAIN]:
        tps = tokens / statistics.median(sec[name])
        # a rank with elastic threads (learner.max_threads_per_rank) may run 2+ threads on an idle machine:
        # the ceiling runs 1, so compare per thread (perf/learner_threads_mean of the last update)
        threads = res["last"].get(name, {}).get("perf/learner_threads_mean", 1.0) if name in table else 1.0
        dtype = PLAIN[name][1] if name in PLAIN else table[name][1].get("dtype", res["learner_dtype"])
        row = rows.setdefault(name, {"median_s": statistics.median(sec[name]), "all_s": sec[name]})
        row.update(tokens_per_s=tps, threads=threads, dtype=dtype)
        print(f"   {name:24s} {tps:10.0f} tokens/s on {threads:.2f} thread(s) = {tps / threads / best[dtype]:.2f}x "
              f"the {dtype} ceiling per thread")
    gap = res["bf16_gap"]
    print(f"bf16 autocast log-prob gap against float32 on the response tokens: mean {gap['mean']:.2e}, "
          f"max {gap['max']:.2e} nats")
    summary = {"rows": rows, "batch": res["batch"], "load_before": load_before, "load_after": load_after,
               "rounds": rounds, "ceiling_tokens_per_s": ceiling, "bf16_gap": gap}
    if "pass_always" in rows and "pass_skipped" in rows:
        ratio = rows["pass_skipped"]["median_s"] / rows["pass_always"]["median_s"]
        low = rows["pass_skipped"]["min_s"] / rows["pass_always"]["min_s"]
        summary["pass_skipped_over_always"] = {"median": ratio, "min": low}
        print(f"pre-update pass: skipped / always = {ratio:.2f} by the median, {low:.2f} by the min (the pass "
              f"costs {1 - ratio:.0%} / {1 - low:.0%} of the update)")
    if "pass_always" in rows and "pass_separate" in rows:
        fused = {k: rows["pass_always"][k] / rows["pass_separate"][k] for k in ("median_s", "min_s")}
        summary["pass_fused_over_separate"] = fused
        print(f"pre-update pass with the first minibatch fused / separate = {fused['median_s']:.2f} by the median, "
              f"{fused['min_s']:.2f} by the min")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after} on {os.cpu_count()} cores")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", nargs="?", default="configs/tiny_moe.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--rounds", type=int, default=5, help="timed updates per variant (after one warm-up)")
    ap.add_argument("--only", default="", help="comma-separated variant names (default is always run)")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import torch

    from cluster.config import load_config
    from cluster.models.resolve import ensure_model

    torch.set_num_threads(1)
    cfg = load_config(args.config, args.overrides)
    m = cfg.model
    build = m.build_kwargs()
    model_path = str(ensure_model(m.path, Path(tempfile.mkdtemp(prefix="bench-learner-")) / "model",
                                  seed=m.build_seed, **build))
    load_before = tuple(round(x, 2) for x in os.getloadavg())
    res = run(cfg, model_path, args.rounds, [s for s in args.only.split(",") if s] or None)
    summary = report(res, load_before, tuple(round(x, 2) for x in os.getloadavg()), args.rounds)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
