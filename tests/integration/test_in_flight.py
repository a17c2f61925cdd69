"""In-flight weight updates (``sync.in_flight``) on a real vLLM engine in a Ray actor: a turn open across a
weight load ends with tokens of two versions, nothing aborted or sampled again, each token's log-prob the one of
the weights (and, with ``keep``, the KV) that sampled it, checked against transformers float32 forwards of the
tiny Qwen3-MoE; a turn that joins during the load waits for it and reuses no KV of the old weights. Routing
capture (R3) is on: each position keeps the experts of the forward that sampled from it (those computed before
the load the old weights', also where they came from the prefix cache), against the same forwards' routers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.moe import RouterTap
from rollout.config import RolloutConfig
from rollout.contracts import TurnRequest
from rollout.engine import RolloutEngine
from tests.helpers.rollout import LONG_PROMPT, checkpoint_state, engine_options, perturbed, put_buckets
from tests.helpers.rollout import base_model, tokenizer  # noqa: F401 - fixtures

TOL = 1e-4


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_moe, tmp_path_factory):
    cfg = RolloutConfig(max_model_len=256, max_response_tokens=12, temperature=1.0, seed=7,
                        return_routed_experts=True)
    actor = ray_cluster.remote(RolloutEngine).options(**engine_options(cfg)).remote(
        str(tiny_moe), cfg, cache_dir=str(tmp_path_factory.mktemp("vllm_cache")))
    yield actor
    ray_cluster.get(actor.shutdown.remote())
    ray_cluster.kill(actor)


def forward(model, ids: list[int], cache=None):
    """``(logits [T, V], sorted experts int [T, layers, k], KV cache)`` of ``model`` over ``ids`` (after
    ``cache``'s positions, when given)."""
    tap = RouterTap(model)
    try:
        with tap.capture() as rec, torch.no_grad():
            out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    finally:
        tap.remove()
    return out.logits[0].float(), np.sort(rec.used_tensor().permute(1, 0, 2).numpy(), -1), out.past_key_values


def logprobs_of(logits: torch.Tensor, ids: list[int], first: int) -> torch.Tensor:
    """log softmax of ``logits`` row ``j`` at ``ids[first + j]``, for every row that has a next id."""
    logp = torch.log_softmax(logits, -1)
    return torch.stack([logp[j, ids[first + j]] for j in range(len(ids) - first)])


def full_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    """log softmax of each token ``ids[start:]`` given all before it, one forward of ``model``."""
    return logprobs_of(forward(model, ids)[0][start - 1 :], ids, start)


def reference(old, new, ids: list[int], start: int, mode: str) -> tuple[torch.Tensor, np.ndarray]:
    """What a turn open across a load samples from, as log-probs of ``ids[start:]`` and experts of positions
    ``0 .. len(ids)-2``: positions ``0 .. start-2`` computed by ``old`` (the KV and experts the request had at the
    load); the rest by ``new``, over that KV (``keep``) or over KV it recomputed (``recompute``)."""
    _, head, cache = forward(old, ids[: start - 1])
    if mode == "keep":
        logits, tail, _ = forward(new, ids[start - 1 : -1], cache)
    else:
        logits, experts, _ = forward(new, ids[:-1])
        logits, tail = logits[start - 1 :], experts[start - 1 :]
    return logprobs_of(logits, ids, start), np.concatenate([head, tail])


def _turn_across_a_load(ray, engine, prompt, mode, state, version):
    """Open a turn, let it sample two tokens, load ``state`` as ``version`` while it is open (a second turn on
    the same prompt joins during the load), then run both to their end; returns the two ``SampledTurn``s."""
    ray.get(engine.set_in_flight.remote(mode))
    first = TurnRequest(f"{mode}#0", prompt, max_tokens=12, seed=3)
    for _ in range(2):  # one scheduler step each: the prefill and the first token, then the second
        assert ray.get(engine.advance_turns.remote([first] if _ == 0 else [], None, 0.0))[0] == []
    ray.get(engine.start_weight_update.remote())
    # longer than the first: with recompute it hits the prompt KV the first one recomputed, whose routing is its
    # donor once the first one has ended (a running request's routing is taken only at its end)
    joined = TurnRequest(f"{mode}#1", prompt, max_tokens=16, seed=4)
    assert ray.get(engine.advance_turns.remote([joined], None, 0.0)) == ([], 0.0)  # waits: no step mid-load
    for meta, ref in put_buckets(ray, state, 2):
        ray.get(engine.update_weights.remote(meta, ref))
    ray.get(engine.finish_weight_update.remote(version))
    got = {}
    while len(got) < 2:
        got.update({t.episode_id: t for t in ray.get(engine.advance_turns.remote([], None, 0.05))[0]})
    return got[first.episode_id], got[joined.episode_id]


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_a_turn_spans_a_weight_load_with_each_tokens_version_and_logprob(ray_cluster, engine, tokenizer,
                                                                         base_model, mode):
    prompt = tokenizer(LONG_PROMPT)["input_ids"]
    assert len(prompt) > 128
    version = ray_cluster.get(engine.weight_version.remote())
    old = perturbed(base_model, seed=10 + version) if version else base_model
    new = perturbed(base_model, seed=11 + version)
    turn, joined = _turn_across_a_load(ray_cluster, engine, prompt, mode, checkpoint_state(new), version + 1)

    n = len(turn.token_ids)
    k = turn.token_versions.index(version + 1) if turn.token_versions else n
    assert turn.token_versions == [version] * k + [version + 1] * (n - k) and 2 <= k < n  # nothing re-sampled
    assert turn.weight_version == version and len(turn.logprobs) == n
    ids = prompt + turn.token_ids
    got = torch.tensor(turn.logprobs)
    assert (got[:k] - full_logprobs(old, ids, len(prompt))[:k]).abs().max() < TOL  # sampled by the old weights
    want, experts = reference(old, new, ids, len(prompt) + k, mode)
    assert (got[k:] - want).abs().max() < TOL  # the new weights, over the old KV (keep) or a recomputed one
    fresh = full_logprobs(new, ids, len(prompt) + k)
    if mode == "keep":  # ... which for keep a plain forward of the new weights is not
        assert (got[k:] - fresh).abs().max() > 1e-3
    assert np.array_equal(np.sort(turn.routed_experts, -1), experts)  # R3: each position its own forward's
    # the turn that joined during the load: the new version only, and no KV (or experts) of the old weights
    assert joined.token_versions is None and joined.weight_version == version + 1
    logits, experts, _ = forward(new, prompt + joined.token_ids)
    want = logprobs_of(logits[len(prompt) - 1 :], prompt + joined.token_ids, len(prompt))
    assert (torch.tensor(joined.logprobs) - want).abs().max() < TOL
    assert np.array_equal(np.sort(joined.routed_experts, -1), experts[:-1])
    assert ray_cluster.get(engine.routing_stats.remote())["unresolved"] == 0
    if mode == "recompute":  # the next test continues from these weights
        ray_cluster.get(engine.set_in_flight.remote("off"))


def test_off_refuses_a_load_while_turns_are_open(ray_cluster, engine, tokenizer):
    ray_cluster.get(engine.set_in_flight.remote("off"))
    req = TurnRequest("off#0", tokenizer("1 + 2 = ")["input_ids"], max_tokens=8, seed=1)
    ended, _ = ray_cluster.get(engine.advance_turns.remote([req], None, 0.0))
    if not ended:
        with pytest.raises(Exception, match="still open"):
            ray_cluster.get(engine.start_weight_update.remote())
    assert ray_cluster.get(engine.drop_turns.remote(["off#0", "nobody"]))[0] == (0 if ended else 1)
    with pytest.raises(Exception, match="must be one of"):
        ray_cluster.get(engine.set_in_flight.remote("sometimes"))
