"""Exact weight sync on a real pretrained chat model: SmolLM2-135M-Instruct (llama, 30 layers, tied embeddings,
a 49k byte-level BPE vocabulary, ChatML template), converted by ``make real-model`` into
``models/smollm2-135m-instruct``. Skipped, with the reason, when that folder is absent.

A real DeepSpeed learner rank and a real vLLM engine in fp32: before training and after each of two GSPO steps on
the engine's own samples of chat-templated prompts (each followed by a streamed weight sync), the engine's
log-probs of fixed chat sequences equal the learner's within ``TOL``, the next rollout's behaviour log-probs equal
the learner's pre-update ones, and the weights moved.

``TOL`` is 1e-4, not the 1e-5 of the tiny models: as loaded, before any sync, vLLM's CPU kernels and torch's
differ by 3.05e-5 (measured 2026-12-02) on this model, whose logits reach about 42 (a float32 ulp there is
3.8e-6: 8 ulps after 30 layers of differently ordered sums). A sync that dropped or mis-placed a tensor moves
log-probs by far more than that (0.43-0.49 for the tied-embedding drift of tests/test_architectures.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.config import LearnerConfig
from rollout.config import RolloutConfig
from tests.helpers import REPO_ROOT
from tests.helpers.sync import learner_logprobs, weight_change

MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
pytestmark = [
    pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(),
                       reason=f"{MODEL} absent: `make real-model` converts SmolLM2-135M-Instruct into it"),
]
TOL = 1e-4
QUESTIONS = ["What is 37 plus 48?", "What is 91 minus 19?", "What is 23 times 4?", "What is 56 plus 7?"]


def chat_ids(tokenizer, question: str, answer: str | None = None) -> list[int]:
    """Token ids of a ChatML user turn (and the assistant's answer, when given)."""
    messages = [{"role": "user", "content": question}]
    if answer is None:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    messages.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)


def max_diff(ray, learner, engine, fixed: list[tuple[list[int], int]]) -> tuple[float, torch.Tensor]:
    """(max |engine - learner| log-prob over the fixed sequences' answer tokens, the engine's log-probs)."""
    diffs, engine_all = [], []
    for seq, start in fixed:
        e = torch.tensor(ray.get(engine.sequence_logprobs.remote(seq, start)))
        diffs.append((e - learner_logprobs(ray, learner, seq, start)).abs().max().item())
        engine_all.append(e)
    return max(diffs), torch.cat(engine_all)


def rollout_batch(ray, engine, prompts, step: int, eos: int):
    """4 prompts x 4 samples from the engine; reward = 1 for a response with a digit and the EOS, else 0 (varies
    within groups, so the advantages are not all zero)."""
    from cluster.driver.batching import build_train_batch
    from learner.advantages import group_advantages
    from learner.objectives import loss_normalisers

    done = ray.get(engine.generate.remote(prompts, 4, temperature=1.0, max_tokens=24, seed=step))
    rewards = torch.tensor([float(any(ch.isdigit() for ch in c.response_text) and c.response_token_ids[-1] == eos)
                            + 0.01 * len(c.response_token_ids) for c in done])
    batch = build_train_batch(done, rewards, group_advantages(rewards, 4), pad_token_id=eos)
    seqs, toks = loss_normalisers(batch.response_mask)
    return batch, seqs, toks


def test_two_gspo_steps_keep_engine_equal_to_learner(ray_cluster, tmp_path):
    from transformers import AutoTokenizer

    from cluster.common import free_port
    from learner.service import LearnerRank
    from rollout.contracts import PromptRow
    from rollout.engine import RolloutEngine

    ray = ray_cluster
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == eos
    prompts = [PromptRow(f"q{i}", q, chat_ids(tokenizer, q), "") for i, q in enumerate(QUESTIONS)]
    fixed = [(chat_ids(tokenizer, q, a), len(chat_ids(tokenizer, q)))
             for q, a in [(QUESTIONS[0], "37 + 48 = \\boxed{85}"), (QUESTIONS[2], "23 x 4 = 92.")]]
    cfg = LearnerConfig(zero_stage=2, micro_batch_size=4, lr=1e-4, pre_update_pass="always")
    learner = ray.remote(LearnerRank).options(num_cpus=1).remote(
        str(MODEL), cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), seed=0,
        temperature=1.0)
    engine = ray.remote(RolloutEngine).options(num_cpus=1).remote(
        str(MODEL), RolloutConfig(max_model_len=256, max_response_tokens=24, kv_cache_gb=0.5),
        cache_dir=str(tmp_path / "cache"))
    try:
        diff, engine_lp = max_diff(ray, learner, engine, fixed)
        print(f"smollm2 load: max|diff|={diff:.3g}")
        assert diff < TOL, ("as loaded", diff)
        weights = ray.get(learner.checkpoint_state_dict.remote())
        for step in (1, 2):
            batch, seqs, toks = rollout_batch(ray, engine, prompts, step, eos)
            out = ray.get(learner.train_rollout_batch.remote([batch], [seqs], [toks]))
            assert out["actor/num_optimizer_steps"] == 1
            assert out["actor/train_rollout_logprob_diff"] < TOL, (step, out["actor/train_rollout_logprob_diff"])
            report = ray.get(learner.sync_weights.remote([engine], step, 0.05, 2))
            assert not report.failed_engines and ray.get(engine.weight_version.remote()) == step
            new_weights = ray.get(learner.checkpoint_state_dict.remote())
            change = weight_change(weights, new_weights)
            diff, new_lp = max_diff(ray, learner, engine, fixed)
            moved = (new_lp - engine_lp).abs().max().item()
            print(f"smollm2 step {step}: max|diff|={diff:.3g} "
                  f"train_rollout={out['actor/train_rollout_logprob_diff']:.3g} weight_change={change:.3g} "
                  f"engine_logprob_change={moved:.3g}")
            assert diff < TOL, (step, diff)
            assert change > 1e-5 and moved > 1e-4, (step, change, moved)
            weights, engine_lp = new_weights, new_lp
    finally:
        for a in (learner, engine):
            ray.kill(a)
