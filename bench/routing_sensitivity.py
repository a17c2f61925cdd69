"""Routing sensitivity of an upcycled MoE (issue 41, item 3): after one GSPO update on a rollout batch, how far the
sequence log-likelihood ratio moves with the behaviour policy's routing replayed versus the current routing, and
the routing volatility (the share of tokens whose top-k expert set changed).

    python bench/routing_sensitivity.py [MODEL_DIR ...] [--prompts 4] [--group 8] [--max-new 48] [--lr 1e-5]
        [--seed 0] [--micro 4] [--config configs/smollm2_moe_arith.yaml] [--out FILE.json]

Default models: ``models/smollm2-135m-moe-e4k2-s{0,0.01,0.05}`` (``make real-moe ARGS="--noise S"``).

What runs, per model, in this one process with transformers and plain torch (no Ray, vLLM or DeepSpeed: the
measurement needs three extra forwards of the same batch with and without forced experts, which the service
stack does not expose; the loss, log-probs, advantages and router hooks are the project's own, learner/):

1. Rollout: the config's task rows (``cluster.data.tasks.load_rows``, the chat template), prompts drawn with
   ``--seed``; ``--group`` samples each by transformers ``generate`` at the config's temperature (top-p 1, no
   top-k), up to ``--max-new`` tokens, scored by the config's verifier. Groups whose rewards are all equal carry
   no GSPO gradient: they are skipped (at most ``3 x --prompts`` prompts tried), as ``trainer.dynamic_sampling``.
2. Behaviour pass (theta_old, no gradient): response-token log-probs at the temperature and every MoE layer's
   top-k experts (``learner.moe.RouterTap``).
3. One GSPO update (``learner.objectives.policy_loss``, the config's clip range, group z-score advantages,
   ``seq_mean_token_mean``) over the first ``1 / --minibatches`` of the groups (the pipeline's first minibatch):
   one AdamW step at ``--lr`` (the config's betas, weight decay and grad clip; a first Adam step moves every
   parameter with a gradient by about ``lr``), gradients accumulated over micro-batches of ``--micro`` rows with
   that minibatch's normalisers.
4. Two forwards at theta_new: with the behaviour pass's experts replayed (R2: gates from the live router,
   renormalised over the forced experts) and with the router's own choice.

Figures (response tokens only; ``log s_i`` is GSPO's length-normalised sequence log-ratio, paper Eq. 7):
``seq_logratio_abs_mean_{own,replay}`` mean_i |log s_i|; ``seq_logratio_gap_abs_{mean,max}``
|log s_i(own) - log s_i(replay)|: what routing changes alone do to the sequence ratio; ``seq_clip_{own,replay}``
share of sequences outside GSPO's band [1 - clip_low, 1 + clip_high]; ``token_logratio_abs_mean_{own,replay}``
and ``token_clip_{own,replay}`` (share of tokens outside GRPO's [0.8, 1.2]); ``token_logprob_gap_abs_mean``
|log pi_own - log pi_replay| per token; ``volatility_pairs`` changed / compared (response position, layer)
top-k sets between theta_old and theta_new (as ``moe/routing_volatility``), ``volatility_tokens`` share of
response positions with a changed set in at least one layer, ``volatility_layer_max`` the worst layer's share;
``replay_at_old_max_diff`` (replaying theta_old's own experts at theta_old: must be 0). Each figure is reported
for the rows the update trained on (``trained/``) and for the others (``other/``: what the pipeline's next
minibatch sees, its ratios after one optimizer step on other sequences).

Prints one JSON line per model; ``--out`` writes them all as a JSON list.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_MODELS = [f"models/smollm2-135m-moe-e4k2-s{s}" for s in ("0", "0.01", "0.05")]


def _rollout(model, tok, rows, cfg, args, verify):
    """Sampled groups with non-constant rewards: ``(sequences, prompt_lens, rewards, tried)``."""
    import torch

    seqs, plens, rewards, tried = [], [], [], 0
    order = random.Random(args.seed).sample(range(len(rows)), len(rows))
    eos = tok.eos_token_id
    for idx in order:
        if len(rewards) >= args.prompts * args.group or tried >= 3 * args.prompts:
            break
        row, tried = rows[idx], tried + 1
        prompt = torch.tensor([row.prompt_token_ids] * args.group)
        torch.manual_seed(args.seed * 1000 + idx)
        with torch.no_grad():
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                 temperature=cfg.rollout.temperature, top_p=1.0, top_k=0,
                                 max_new_tokens=args.max_new, pad_token_id=tok.pad_token_id or eos, eos_token_id=eos)
        group, scores = [], []
        for s in out[:, prompt.shape[1]:].tolist():
            resp = s[: s.index(eos) + 1] if eos in s else s
            group.append(row.prompt_token_ids + resp)
            scores.append(float(verify(tok.decode(resp, skip_special_tokens=True), {"answer": row.answer, **row.meta})))
        if len(set(scores)) > 1:
            seqs += group
            plens += [len(row.prompt_token_ids)] * args.group
            rewards += scores
    return seqs, plens, rewards, tried


def _batch(seqs, plens, pad_id):
    """Right-padded ``ids [B, w]``, ``attention [B, w]`` and the response mask ``[B, w-1]`` over targets."""
    import torch

    w = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), w), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), w), dtype=torch.long)
    mask = torch.zeros((len(seqs), w - 1), dtype=torch.bool)
    for i, (s, p) in enumerate(zip(seqs, plens)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        mask[i, p - 1 : len(s) - 1] = True  # targets p .. len-1 are the response tokens
    return ids, att, mask


def _passes(model, tap, ids, att, temperature, micro, replay=None, grad_fn=None):
    """Response-token log-probs ``[B, w-1]`` and routing ``[layers, B*w, k]`` over micro-batches; with
    ``replay`` (same layout) the experts are forced; with ``grad_fn(lp, rows)`` the loss's backward runs."""
    import torch

    from learner.logprobs import token_log_probs

    lps, routes = [], []
    w = ids.shape[1]
    for start in range(0, ids.shape[0], micro):
        rows = slice(start, min(start + micro, ids.shape[0]))
        forced = None if replay is None else replay[:, rows.start * w : rows.stop * w]
        with torch.set_grad_enabled(grad_fn is not None), tap.capture(replay=forced) as rec:
            logits = model(input_ids=ids[rows], attention_mask=att[rows]).logits
            lp = token_log_probs(logits[:, :-1], ids[rows, 1:], temperature)
        if grad_fn is not None:
            with torch.enable_grad():
                grad_fn(lp, rows)
        lps.append(lp.detach())
        routes.append(rec.router_tensor())
        del logits
    return torch.cat(lps), torch.cat(routes, dim=1)


def measure(path: str, args, cfg, rows_for) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from cluster.data.tasks import load_tokenizer
    from learner.advantages import group_advantages
    from learner.moe import RouterTap
    from learner.objectives import loss_normalisers, policy_loss, resolve_objective
    from reward.verifiers import math_verifier

    t0 = time.time()
    torch.manual_seed(args.seed)
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = True
    model.eval()
    tap = RouterTap(model)
    if not tap.can_replay:
        raise ValueError(f"{path}: the routers do not support Routing Replay")
    seqs, plens, rewards, tried = _rollout(model, tok, rows_for(path, tok), cfg, args, math_verifier)
    if not seqs:
        raise RuntimeError(f"{path}: no group with non-constant rewards among {tried} prompts")
    t_roll = time.time() - t0
    model.config.use_cache = False
    temp = cfg.rollout.temperature
    ids, att, mask = _batch(seqs, plens, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    reward_t = torch.tensor(rewards)
    adv = group_advantages(reward_t, args.group)
    old_lp, old_routes = _passes(model, tap, ids, att, temp, args.micro)
    rep_old_lp, _ = _passes(model, tap, ids, att, temp, args.micro, replay=old_routes)
    lc = cfg.learner
    objective = resolve_objective("gspo", lc.clip_low, lc.clip_high)
    # the update: the first minibatch's groups (all of them with --minibatches 1), as the pipeline's first step
    n_train = (len(seqs) // args.group + args.minibatches - 1) // args.minibatches * args.group
    n_seq, n_tok = loss_normalisers(mask[:n_train])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=tuple(lc.adam_betas), weight_decay=lc.weight_decay)
    opt.zero_grad()
    stats = {"loss": 0.0}

    def backward(lp, rows):
        out = policy_loss(lp, old_lp[rows], adv[rows], mask[rows], objective, num_sequences=n_seq, num_tokens=n_tok)
        out.loss.backward()
        stats["loss"] += float(out.loss.detach())

    model.train()
    _passes(model, tap, ids[:n_train], att[:n_train], temp, args.micro, grad_fn=backward)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), lc.grad_clip))
    opt.step()
    model.eval()
    own_lp, new_routes = _passes(model, tap, ids, att, temp, args.micro)
    rep_lp, _ = _passes(model, tap, ids, att, temp, args.micro, replay=old_routes)

    base = {
        "model": path, "sigma": _sigma(path), "sequences": len(seqs), "groups": len(seqs) // args.group,
        "trained_sequences": n_train, "prompts_tried": tried, "response_tokens": int(mask.sum()),
        "reward_mean": float(reward_t.mean()), "lr": args.lr, "loss": stats["loss"], "grad_norm_before_clip": grad_norm,
        "replay_at_old_max_diff": float((rep_old_lp - old_lp)[mask].abs().max()),
    }
    w = ids.shape[1]
    parts = {"trained": slice(0, n_train), "other": slice(n_train, len(seqs))}
    for name, rows in parts.items():
        if rows.stop > rows.start:
            cols = slice(rows.start * w, rows.stop * w)
            figures = _figures(own_lp[rows], rep_lp[rows], old_lp[rows], mask[rows], old_routes[:, cols],
                               new_routes[:, cols], objective)
            base.update({f"{name}/{k}": v for k, v in figures.items()})
    return {**base, "rollout_s": round(t_roll, 1), "total_s": round(time.time() - t0, 1)}


def _figures(own_lp, rep_lp, old_lp, mask, old_routes, new_routes, objective) -> dict:
    """The module docstring's figures over one set of rows (``[b, w-1]`` log-probs and mask, ``[layers, b*w, k]``
    routings)."""
    from learner.moe import response_positions, topk_set_changes
    from learner.objectives import sequence_log_ratio

    s_own = sequence_log_ratio(own_lp, old_lp, mask)
    s_rep = sequence_log_ratio(rep_lp, old_lp, mask)
    gap = (s_own - s_rep).abs()
    lo, hi = 1 - objective.clip_low, 1 + objective.clip_high

    def seq_clip(s):
        return float(((s.exp() < lo) | (s.exp() > hi)).float().mean())

    def tok_stats(lp):
        d = (lp - old_lp)[mask]
        return float(d.abs().mean()), float(((d.exp() < 0.8) | (d.exp() > 1.2)).float().mean())

    select = response_positions(mask)
    changed, compared = topk_set_changes(old_routes, new_routes, select)
    per_pair = (old_routes[:, select].sort(-1).values != new_routes[:, select].sort(-1).values).any(-1)
    tok_own, clip_own = tok_stats(own_lp)
    tok_rep, clip_rep = tok_stats(rep_lp)
    return {
        "seq_logratio_abs_mean_own": float(s_own.abs().mean()), "seq_logratio_abs_mean_replay": float(s_rep.abs().mean()),
        "seq_logratio_abs_max_own": float(s_own.abs().max()), "seq_logratio_abs_max_replay": float(s_rep.abs().max()),
        "seq_logratio_gap_abs_mean": float(gap.mean()), "seq_logratio_gap_abs_max": float(gap.max()),
        "seq_clip_own": seq_clip(s_own), "seq_clip_replay": seq_clip(s_rep),
        "token_logratio_abs_mean_own": tok_own, "token_logratio_abs_mean_replay": tok_rep,
        "token_clip_own": clip_own, "token_clip_replay": clip_rep,
        "token_logprob_gap_abs_mean": float((own_lp - rep_lp)[mask].abs().mean()),
        "token_logprob_gap_abs_max": float((own_lp - rep_lp)[mask].abs().max()),
        "volatility_pairs": changed / max(compared, 1),
        "volatility_tokens": float(per_pair.any(0).float().mean()),
        "volatility_layer_max": float(per_pair.float().mean(1).max()),
    }


def _sigma(path: str) -> float | None:
    info = Path(path) / "upcycle.json"
    if info.is_file():
        return json.loads(info.read_text()).get("noise")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    ap.add_argument("--config", default="configs/smollm2_moe_arith.yaml")
    ap.add_argument("--prompts", type=int, default=4, help="groups with non-constant rewards to train on")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--lr", type=float, default=None, help="default: the config's learner.lr")
    ap.add_argument("--micro", type=int, default=4, help="rows per forward")
    ap.add_argument("--minibatches", type=int, default=2,
                    help="the update trains on the first 1/M of the groups (the pipeline's first optimizer step); the "
                         "figures are reported for those rows (trained/) and the rest (other/: what the next "
                         "minibatch's forward sees)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from cluster.config import load_config
    from cluster.data.tasks import load_rows

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(args.config, ["data.num_eval=1"])
    args.lr = cfg.learner.lr if args.lr is None else args.lr

    def rows_for(path, tok):
        return load_rows(load_config(args.config, [f"model.path={path}", "data.num_eval=1"]), tok)[0]

    results = []
    for path in args.models:
        res = measure(path, args, cfg, rows_for)
        print(json.dumps(res), flush=True)
        results.append(res)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
