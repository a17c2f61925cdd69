"""R3, engine side: ``rollout.return_routed_experts`` reports the experts vLLM ran for every input position of a
sampled sequence; they match a transformers forward of the same sequence at the same weights, before and after a
weight sync, also for positions served from the prefix cache (float32: top-2 sets agree exactly on the tiny MoE;
vLLM's own routed-experts return needs Model Runner V2, which needs Triton and is refused on this CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.moe import RouterTap
from rollout.config import RolloutConfig
from rollout.engine import RolloutEngine
from tests.helpers.rollout import LONG_PROMPT, checkpoint_state, engine_options, perturbed, rows, sync


def hf_routing(model, seq: list[int]) -> np.ndarray:
    """[len(seq) - 1, layers, k] sorted expert ids of a transformers forward over ``seq[:-1]``."""
    tap = RouterTap(model)
    try:
        with tap.capture() as rec, torch.no_grad():
            model(torch.tensor([seq[:-1]]))
    finally:
        tap.remove()
    return np.sort(rec.used_tensor().permute(1, 0, 2).numpy(), -1)


def test_engine_reports_the_experts_it_ran_before_and_after_a_sync(ray_cluster, tiny_moe, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    cfg = RolloutConfig(max_model_len=256, max_response_tokens=8, return_routed_experts=True, seed=3)
    engine = ray_cluster.remote(RolloutEngine).options(**engine_options(cfg)).remote(str(tiny_moe), cfg,
                                                                                   cache_dir=str(tmp_path))
    prompts = rows(tok, ["12+34=", LONG_PROMPT])  # the long one spans several KV blocks
    try:
        for version, weights in ((0, model), (1, perturbed(model, seed=2))):
            if version:
                sync(ray_cluster, engine, checkpoint_state(weights), version)
            # the second call of a version finds the prompts in the prefix cache: those positions' experts come
            # from the first call's records, and must still be the ones a full forward runs
            for call in range(2):
                comps = ray_cluster.get(engine.generate.remote(prompts, 3, seed=10 * version + call))
                for c in comps:
                    seq = c.prompt_token_ids + c.response_token_ids
                    assert c.routed_experts.shape == (len(seq) - 1, 2, 2) and c.routed_experts.dtype == np.int16
                    assert np.array_equal(np.sort(c.routed_experts, -1), hf_routing(weights, seq)), (version, call)
            stats = ray_cluster.get(engine.routing_stats.remote())
            assert stats["filled_positions"] > 0 and stats["unresolved"] == 0, stats
        # greedy evaluation and prompt log-probs consume their own records (nothing leaks into the next call)
        ray_cluster.get(engine.generate_greedy.remote(prompts))
        comps = ray_cluster.get(engine.generate.remote(prompts[:1], 2, seed=9))
        assert all(c.routed_experts is not None for c in comps)
    finally:
        ray_cluster.get(engine.shutdown.remote())
        ray_cluster.kill(engine)


@pytest.mark.matrix  # the default set: the capture before and after a sync (above); episodes' R3 end to end in
# tests/matrix/test_agent_r3.py. Moved at 1407 passed in 14 min 59 s (Zen 4), about 24.6 min estimated on the Zen 3
def test_turns_of_an_episode_carry_each_positions_own_forward_experts(ray_cluster, tiny_moe, tmp_path):
    """R3 for episodes: turns batched continuously (``advance_turns``) report the experts of every input position
    of the episode so far; a later turn's earlier positions (served from the prefix cache) come from the turn that
    computed them, and all agree with a transformers forward of the whole interleaved sequence."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.contracts import TurnRequest

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    cfg = RolloutConfig(max_model_len=256, max_response_tokens=8, return_routed_experts=True, seed=3)
    engine = ray_cluster.remote(RolloutEngine).options(**engine_options(cfg)).remote(str(tiny_moe), cfg,
                                                                                   cache_dir=str(tmp_path))
    reply = tok("<result>46</result>", add_special_tokens=False)["input_ids"]
    contexts = {f"e{i}": tok(p)["input_ids"] for i, p in enumerate(["12+34=", LONG_PROMPT, LONG_PROMPT])}
    try:
        for turn in range(2):
            pending = [TurnRequest(k, ids, max_tokens=8, seed=7 * turn + i) for i, (k, ids) in
                       enumerate(contexts.items())]
            ended = {}
            while len(ended) < len(contexts):  # one turn joins per call: the others are mid-decode
                got, _ = ray_cluster.get(engine.advance_turns.remote(pending[:1], None, 0.0))
                pending = pending[1:]
                ended.update({t.episode_id: t for t in got})
            for k, t in ended.items():
                seq = contexts[k] + t.token_ids
                assert t.routed_experts.shape == (len(seq) - 1, 2, 2), (k, turn)
                assert np.array_equal(np.sort(t.routed_experts, -1), hf_routing(model, seq)), (k, turn)
                contexts[k] = seq + reply  # the next turn continues the exact ids
        stats = ray_cluster.get(engine.routing_stats.remote())
        assert stats["filled_positions"] > 0 and stats["unresolved"] == 0, stats
    finally:
        ray_cluster.get(engine.shutdown.remote())
        ray_cluster.kill(engine)
