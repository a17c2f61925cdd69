"""An upcycled Mixtral with tied embeddings (``gspo-upcycle`` on a tiny tied Llama) in the vLLM rollout engine:
it starts, its log-probs equal transformers' float32 ones, and a weight sync in the checkpoint format (the tied
``lm_head`` left out, as the learner sends it) reaches the engine exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from cluster.models import upcycle as up
from learner.weight_sync import to_checkpoint_format
from rollout.config import RolloutConfig
from rollout.engine import RolloutEngine
from tests.helpers.rollout import engine_options

START = 4
SEQS = [[1] + [10 + (7 * i + 3 * j) % 80 for j in range(30)] for i in range(4)]
TOL = 1e-4


def _hf_logprobs(model, seq):
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
    return torch.tensor([lp[t - 1, seq[t]].item() for t in range(START, len(seq))])


def _max_diff(ray, engine, model) -> float:
    return max((torch.tensor(ray.get(engine.sequence_logprobs.remote(s, START))) - _hf_logprobs(model, s)).abs().max().item()
               for s in SEQS)


@pytest.mark.matrix  # the default set: the engine's exact sync on qwen2_moe, the upcycle's sigma-0 logits (unit)
def test_upcycled_tied_mixtral_loads_and_syncs_exactly_in_the_engine(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    dense = up.build_tiny_llama(tmp_path / "dense", tied=True)
    out = tmp_path / "moe"
    up.upcycle(dense, out, experts=4, top_k=2, noise=0.05, seed=1, log=lambda *_: None)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert ref.config.tie_word_embeddings

    rc = RolloutConfig(max_model_len=64, max_response_tokens=6, seed=5)
    engine = ray_cluster.remote(RolloutEngine).options(**engine_options(rc)).remote(
        str(out), rc, cache_dir=str(tmp_path / "cache"))
    try:
        assert _max_diff(ray_cluster, engine, ref) <= TOL

        new = copy.deepcopy(ref)
        gen = torch.Generator().manual_seed(9)
        with torch.no_grad():
            for p in new.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        state = to_checkpoint_format(new, dict(new.state_dict()))
        state.pop("lm_head.weight", None)
        assert any(".block_sparse_moe.experts.3.w1.weight" in k for k in state)
        ray_cluster.get(engine.load_state_dict.remote(state, 1))
        assert _max_diff(ray_cluster, engine, ref) > 100 * TOL  # the sync changed the engine ...
        assert _max_diff(ray_cluster, engine, new) <= TOL  # ... to exactly the new weights
    finally:
        ray_cluster.get(engine.shutdown.remote())
        ray_cluster.kill(engine)
