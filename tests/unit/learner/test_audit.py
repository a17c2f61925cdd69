"""The offline ratio audit (learner/audit.py) and the audit dump (cluster/driver/audit_dump.py).

Fast tests: the audit's own math against hand-computed values and against the training code
(learner.objectives, imported here only as the thing being cross-checked), and the whole audit on a synthetic
step folder with planted defects. Slow test: a real short run saves step 1, the audit is clean, and a planted
one-token mask shift makes it fail naming the check.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from learner import audit


def test_expected_response_mask_hand_values():
    # row 0: prompt 3, 5 real tokens -> response tokens at 3, 4 -> targets 2, 3; row 1: no response
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    got = audit.expected_response_mask(torch.tensor([3, 2]), attn)
    want = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(got, want)
    # unknown prompt length (-1): nothing
    assert not audit.expected_response_mask(torch.tensor([-1, 2]), attn)[0].any()


def test_sequence_log_ratios_hand_values():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.5, -2.0, -2.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    got = audit.sequence_log_ratios(lp, old, mask)
    # (0.5 + 0 - 1.0) / 3 ; empty row -> 0
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx([-0.5 / 3, 0.0], abs=1e-15)
    # explicit lengths override the mask count (what GSPO's |y_i| must equal)
    assert audit.sequence_log_ratios(lp, old, mask, torch.tensor([2, 0]))[0].item() == pytest.approx(-0.25)


def test_gspo_objective_hand_values_and_gradient():
    # Two sequences, S = 2. Row 0: log s = 1e-4 (inside [1-3e-4, 1+4e-4]); row 1: log s = 1e-3 with A > 0
    # -> clipped at 1 + 4e-4, constant term.
    lp = torch.tensor([[1e-4, 1e-4], [1e-3, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    adv = torch.tensor([-1.0, 2.0], dtype=torch.float64)
    loss, stats = audit.policy_objective(lp, old, adv, mask, algorithm="gspo", clip_low=3e-4, clip_high=4e-4,
                                         loss_agg="seq_mean_token_mean", num_sequences=2, num_tokens=3)
    s0 = math.exp(1e-4)
    want = -(s0 * -1.0 + (1 + 4e-4) * 2.0) / 2
    assert float(loss) == pytest.approx(want, rel=1e-12)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    assert stats["seq_ratio_max"] == pytest.approx(math.exp(1e-3))
    loss.backward()
    # d loss / d lp(row 0, t) = -A s / (|y| S) = -(-1) s0 / (2 * 2); clipped row: 0
    assert lp.grad[0].tolist() == pytest.approx([s0 / 4, s0 / 4], rel=1e-12)
    assert lp.grad[1].tolist() == [0.0, 0.0]


def test_grpo_objective_aggregations_hand_values():
    lp = torch.tensor([[math.log(1.5), 0.0], [0.0, 0.0]], dtype=torch.float64)
    old = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    kw = dict(algorithm="grpo", clip_low=0.2, clip_high=0.27, num_sequences=2, num_tokens=3)
    # token terms: row 0: ratio 1.5 clipped to 1.27 (A>0), ratio 1 -> 1; row 1: ratio 1 * -1
    terms = [1.27, 1.0, -1.0]
    loss, stats = audit.policy_objective(lp, old, adv, mask, loss_agg="token_mean", **kw)
    assert float(loss) == pytest.approx(-sum(terms) / 3)
    assert stats["clip_fraction"] == pytest.approx(1 / 3) and stats["ratio_max"] == pytest.approx(1.5)
    loss, _ = audit.policy_objective(lp, old, adv, mask, loss_agg="seq_mean_token_mean", **kw)
    assert float(loss) == pytest.approx(-((1.27 + 1.0) / 2 + -1.0) / 2)
    loss, _ = audit.policy_objective(lp, old, adv, mask, loss_agg="seq_mean_token_sum", **kw)
    assert float(loss) == pytest.approx(-sum(terms) / 2)
    loss, _ = audit.policy_objective(lp, old, adv, mask, loss_agg="seq_mean_token_sum", norm_length=8,
                                     **{**kw, "algorithm": "dr_grpo"})
    assert float(loss) == pytest.approx(-sum(terms) / 2 / 8)  # Dr. GRPO: the token sums over S, then over L
    with pytest.raises(ValueError, match="norm_length"):
        audit.policy_objective(lp, old, adv, mask, loss_agg="seq_mean_token_sum", **{**kw, "algorithm": "dr_grpo"})
    with pytest.raises(ValueError, match="loss_agg"):
        audit.policy_objective(lp, old, adv, mask, loss_agg="nope", **kw)
    with pytest.raises(ValueError, match="algorithm"):
        audit.policy_objective(lp, old, adv, mask, loss_agg="token_mean", **{**kw, "algorithm": "ppo"})


@pytest.mark.parametrize("algorithm,loss_agg", [("gspo", "seq_mean_token_mean"), ("gspo_token", "seq_mean_token_mean"),
                                                ("grpo", "token_mean"), ("grpo", "seq_mean_token_mean"),
                                                ("dr_grpo", "seq_mean_token_sum")])
def test_objective_agrees_with_training_code(algorithm, loss_agg):
    """Cross-check against learner.objectives (the code under audit) on random data, value and gradient,
    with the training side split into two micro-batches with global normalisers."""
    from learner.objectives import loss_normalisers, policy_loss, resolve_objective

    g = torch.Generator().manual_seed(0)
    b, t = 6, 9
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[2] = False  # an empty response
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lp = (old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.05).requires_grad_(True)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    clip = (3e-3, 4e-3) if algorithm.startswith("gspo") else (0.02, 0.03)
    options = {"norm_length": 7} if algorithm == "dr_grpo" else {}
    s, n = loss_normalisers(mask)
    ours, stats = audit.policy_objective(lp, old, adv, mask, algorithm=algorithm, clip_low=clip[0], clip_high=clip[1],
                                         loss_agg=loss_agg, num_sequences=s, num_tokens=n, **options)
    (g_ours,) = torch.autograd.grad(ours, lp)
    theirs = 0.0
    parts = []
    for lo, hi in ((0, 4), (4, 6)):
        result = policy_loss(lp[lo:hi], old[lo:hi], adv[lo:hi], mask[lo:hi],
            resolve_objective(algorithm, clip_low=clip[0], clip_high=clip[1], loss_agg=loss_agg, options=options),
            num_sequences=s, num_tokens=n)
        part, m = result.loss, result.metrics
        theirs = theirs + part
        parts.append(m)
    (g_theirs,) = torch.autograd.grad(theirs, lp)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-12)
    assert torch.allclose(g_ours, g_theirs, atol=1e-12)
    assert 0 < stats["clip_fraction"] < 1  # the data exercise both branches


def _write_synthetic_step(root: Path, model_dir: Path, *, algorithm: str = "gspo", episodes: bool = False) -> Path:
    """A step folder as cluster.driver.audit_dump writes it, with float32 'training' values from the training code:
    2 ranks x 2 minibatches x 2 rows; prompt lengths from the 'dataset'. With ``episodes`` the even rows are
    multi-turn episodes whose response tokens 2 and 3 are an environment's reply (not trained, engine log-prob
    0.0), saved with their sampled-token masks (``episode_response_mask``) as audit_dump writes them."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from learner.logprobs import token_log_probs
    from learner.objectives import loss_normalisers, policy_loss, resolve_objective

    step = root / "audit" / "step_00000001"
    step.mkdir(parents=True)
    shutil.copytree(model_dir, step / "model")
    g = torch.Generator().manual_seed(5)
    n, length, temperature = 8, 12, 0.8
    prompt_lens = torch.tensor([4, 4, 5, 5, 3, 3, 6, 6])
    totals = torch.tensor([10, 12, 9, 11, 7, 12, 8, 10])
    ids = torch.randint(3, 20, (n, length), generator=g)
    attn = (torch.arange(length)[None] < totals[:, None]).long()
    ids = torch.where(attn.bool(), ids, torch.zeros_like(ids))
    mask = torch.zeros(n, length - 1, dtype=torch.bool)
    for i in range(n):
        mask[i, prompt_lens[i] - 1 : totals[i] - 1] = True
    sampled = torch.full((n, int((totals - prompt_lens).max())), -1, dtype=torch.int8)
    for i in range(0, n, 2) if episodes else ():
        r = int(totals[i] - prompt_lens[i])
        sampled[i, :r] = torch.tensor([0 if j in (2, 3) else 1 for j in range(r)])  # 2, 3: the environment's
        mask[i, prompt_lens[i] + 1 : min(prompt_lens[i] + 3, totals[i] - 1)] = False  # token j: target P-1+j
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    lp = token_log_probs(logits, ids[:, 1:], temperature)
    lp_masked = torch.where(mask, lp.detach(), 0.0)
    old = torch.where(mask, lp.detach() + 1e-6 * torch.randn(n, length - 1, generator=g), 0.0)
    adv = torch.randn(n, generator=g)
    split = [{"ranks": [[0, 5], [2, 7]]}, {"ranks": [[1, 3], [4, 6]]}]
    for mb in split:
        rows = [i for r in mb["ranks"] for i in r]
        mb["num_sequences"], mb["num_tokens"] = loss_normalisers(mask[rows])
    objective = resolve_objective(algorithm)
    clip_low, clip_high, loss_agg = objective.clip_low, objective.clip_high, objective.loss_agg
    rows0 = [i for r in split[0]["ranks"] for i in r]
    result = policy_loss(lp[rows0], old[rows0], adv[rows0], mask[rows0],
        resolve_objective(algorithm), num_sequences=split[0]["num_sequences"], num_tokens=split[0]["num_tokens"])
    loss, m = result.loss, result.metrics
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    ent = 0.0
    with torch.no_grad():
        z = logits.double() / temperature
        logp = torch.log_softmax(z, -1)
        ent = float(torch.where(mask, -(logp.exp() * logp).sum(-1), 0.0).sum() / mask.sum())
    metrics = {
        "loss/policy": float(loss) * 0.9,  # mean over steps: not the first minibatch's alone
        "loss/policy_minibatches": [float(loss), float(loss) * 0.8],
        "actor/num_optimizer_steps": 2.0,
        "actor/entropy": ent,
        "actor/train_rollout_logprob_diff": float(torch.where(mask, (lp.detach() - old).abs(), 0.0).sum() / mask.sum()),
        "actor/num_response_tokens": float(mask.sum()),
    }
    tensors = {"input_ids": ids, "attention_mask": attn, "response_mask": mask, "old_log_probs": old.float(),
               "advantages": adv, "rewards": torch.zeros(n), "weight_versions": torch.ones(n, dtype=torch.long),
               "learner_log_probs": lp_masked.float(), "prompt_lengths": prompt_lens.long()}
    if episodes:
        tensors[audit.EPISODE_MASK_KEY] = sampled
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(step / audit.BATCH_FILE))
    save_file({k: v.contiguous() for k, v in grads.items()}, str(step / audit.GRADIENT_FILE))
    (step / audit.SPLIT_FILE).write_text(json.dumps({"minibatches": split}))
    uids = [f"p{i}" for i in range(n)]
    (step / audit.META_FILE).write_text(json.dumps({
        "step": 1, "prompt_uids": uids, "prompt_token_ids": {u: ids[i, : prompt_lens[i]].tolist() for i, u in enumerate(uids)},
        "objective": {"algorithm": algorithm, "clip_low": clip_low, "clip_high": clip_high, "loss_agg": loss_agg,
                      "temperature": temperature, "micro_batch_size": 1, "world_size": 2,
                      "old_logprob_source": "rollout"},
    }))
    (step / audit.METRICS_FILE).write_text(json.dumps(metrics))
    return step


def _by_name(result):
    return {c.name: c for c in result.checks}


def test_synthetic_step_clean_then_planted_defects(tiny_moe, tmp_path):
    step = _write_synthetic_step(tmp_path / "run", tiny_moe)
    model = audit.load_model(step / "model")
    result = audit.run_audit(step, 1e-4, model=model)
    checks = _by_name(result)
    assert not result.failed, audit.format_report(result, 1e-4)
    for name in ("mask_alignment", "behaviour_log_probs", "learner_log_probs", "sequence_log_ratio", "normalisers",
                 "minibatch_split", "entropy", "logprob_diff_metric", "loss_first_minibatch",
                 "gradient_first_minibatch", "length_normalisation", "prompt_tokens", "num_response_tokens"):
        assert checks[name].status == "ok", name
    assert checks["ratio_statistics"].status == "skipped"  # 2 optimizer steps

    # A normaliser off by one token in the split: the normaliser check fails, nothing else changes.
    split = json.loads((step / audit.SPLIT_FILE).read_text())
    split["minibatches"][1]["num_tokens"] += 1
    (step / audit.SPLIT_FILE).write_text(json.dumps(split))
    result = audit.run_audit(step, 1e-4, model=model)
    assert [c.name for c in result.failed] == ["normalisers"]
    split["minibatches"][1]["num_tokens"] -= 1
    (step / audit.SPLIT_FILE).write_text(json.dumps(split))

    # A logged loss that aggregated micro-batches with a wrong normaliser (x2): the loss check fails.
    metrics = json.loads((step / audit.METRICS_FILE).read_text())
    metrics["loss/policy_minibatches"][0] *= 2
    (step / audit.METRICS_FILE).write_text(json.dumps(metrics))
    result = audit.run_audit(step, 1e-4, model=model)
    assert [c.name for c in result.failed] == ["loss_first_minibatch"]
    report = audit.format_report(result, 1e-4)
    assert "audit FAILED" in report and "loss_first_minibatch" in report


def test_cli_missing_step_exits_2(tmp_path, capsys):
    assert audit.main([str(tmp_path), "--step", "3"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_synthetic_episode_step_audits_clean_and_catches_trained_environment_tokens(tiny_moe, tmp_path):
    """Multi-turn episodes (docs/agents.md): the audit's mask keeps the engines' sampled tokens only, from the
    saved episode masks; a training mask that takes the environment's reply in fails, and so does an episode mask
    that does not cover its response."""
    from safetensors.torch import load_file, save_file

    step = _write_synthetic_step(tmp_path / "run", tiny_moe, episodes=True)
    model = audit.load_model(step / "model")
    result = audit.run_audit(step, 1e-4, model=model)
    checks = _by_name(result)
    assert not result.failed, audit.format_report(result, 1e-4)
    for name in ("mask_alignment", "length_normalisation", "episode_mask_length", "prompt_tokens",
                 "behaviour_log_probs", "sequence_log_ratio", "normalisers", "entropy", "logprob_diff_metric",
                 "loss_first_minibatch", "gradient_first_minibatch", "num_response_tokens"):
        assert checks[name].status == "ok", name
    assert "4 multi-turn episodes" in result.header

    batch_file = step / audit.BATCH_FILE
    clean = load_file(str(batch_file))

    def audit_with(**changed):
        save_file({k: v.contiguous() for k, v in {**clean, **changed}.items()}, str(batch_file))
        return {c.name for c in audit.run_audit(step, 1e-4, model=model).failed}

    # Training on the environment's reply (every response token in the saved mask): its engine log-probs are 0.0.
    full = clean["response_mask"].clone()
    for i in range(0, 8, 2):
        p = int(clean["prompt_lengths"][i])
        full[i, p - 1 : int(clean["attention_mask"][i].sum()) - 1] = True
    failed = audit_with(response_mask=full)
    assert {"mask_alignment", "length_normalisation", "behaviour_log_probs"} <= failed
    # An episode mask one token short of its response.
    short = clean[audit.EPISODE_MASK_KEY].clone()
    short[0, int((short[0] >= 0).sum()) - 1] = -1
    assert "episode_mask_length" in audit_with(**{audit.EPISODE_MASK_KEY: short})
