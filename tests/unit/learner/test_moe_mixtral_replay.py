"""Routing Replay on Mixtral routers (learner/moe.py), which renormalise their top-k gates without a
``norm_topk_prob`` switch (the upcycled SmolLM2 of ``cluster/models/upcycle.py`` is a Mixtral).

A tiny random ``MixtralForCausalLM`` (2 layers, 4 experts, top-2, float32), built here. Checked: replay of the
router's own choice is bit-identical to the plain forward; under a moved router, replaying the old experts gives
each MoE block the output of a hand-written Mixtral block (softmax over the router logits, gathered at the
forced experts, renormalised, gated SwiGLU experts) on the block's own input; a router whose gating the formula
does not describe is refused.
"""

from __future__ import annotations

import pytest
import torch

from learner.moe import ALWAYS_RENORMALISE, RouterTap, find_routers, renormalises_topk, topk_set_changes

E, K = 4, 2


def _mixtral(tied: bool = False):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=E,
                           num_experts_per_tok=K, tie_word_embeddings=tied, router_jitter_noise=0.0,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).float().eval()
    with torch.no_grad():  # routers far from uniform, so that moving them changes choices but not all of them
        for _, _, router in find_routers(model):
            router.weight.normal_(0.0, 1.0)
    return model


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(seed))


def _blocks_io(model) -> list[list]:
    """Forward hooks on every sparse MoE block: [input hidden states [b, s, h], output [b, s, h]] per call."""
    seen: list[list] = []

    def hook(module, args, output):
        seen.append([args[0].detach().clone(), output.detach().clone()])

    for name, module in model.named_modules():
        if type(module).__name__ == "MixtralSparseMoeBlock":
            module.register_forward_hook(hook)
    return seen


def _hand_block(block, x: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Mixtral's MoE block by hand for forced experts: g = softmax(W_r x) gathered at ``forced`` and divided by
    its sum (Mixtral, arXiv 2401.04088, eq. 2), out = sum_j g_j * W2_j (silu(W1_j x) * W3_j x).

    x: float32 [b, s, h]; forced: int [b*s, k]. Returns float32 [b, s, h]."""
    h = x.reshape(-1, x.shape[-1]).double()
    probs = torch.softmax(h @ block.gate.weight.double().T, -1)
    g = probs.gather(-1, forced.long())
    g = g / g.sum(-1, keepdim=True)
    gate_up = block.experts.gate_up_proj.double()  # [E, 2I, H]: gate (w1) rows first, then up (w3)
    down = block.experts.down_proj.double()  # [E, H, I]
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(forced.shape[1]):
            e = int(forced[t, j])
            w1, w3 = gate_up[e].chunk(2, dim=0)
            out[t] += g[t, j] * (down[e] @ (torch.nn.functional.silu(w1 @ h[t]) * (w3 @ h[t])))
    return out.reshape(x.shape).float()


def test_mixtral_router_is_known_to_renormalise():
    model = _mixtral()
    routers = find_routers(model)
    assert [layer for layer, _, _ in routers] == [0, 1]
    assert type(routers[0][2]).__name__ in ALWAYS_RENORMALISE
    assert not hasattr(routers[0][2], "norm_topk_prob") and renormalises_topk(routers[0][2]) is True
    tap = RouterTap(model)
    assert tap.can_replay and tap.num_experts == E and tap.top_k == K
    # the router really does renormalise: its gates sum to 1 for every token
    with torch.no_grad():
        _, gates, _ = routers[0][2](torch.randn(5, 32))
    assert torch.allclose(gates.sum(-1), torch.ones(5), atol=1e-6) and gates.dtype == torch.float32

    class OtherTopKRouter(torch.nn.Module):  # no norm_topk_prob, not a known class: replay refused
        top_k, num_experts = 2, 4

    assert renormalises_topk(OtherTopKRouter()) is None
    other = torch.nn.Sequential(OtherTopKRouter())
    assert not RouterTap(other).can_replay and RouterTap(other).is_moe


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_replaying_the_own_choice_is_the_plain_forward(tied):
    model = _mixtral(tied)
    ids = _ids()
    tap = RouterTap(model)
    seen = _blocks_io(model)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with tap.capture() as rec:
            model(input_ids=ids)
        with tap.capture(replay=rec.used_tensor()) as rec2:
            replayed = model(input_ids=ids).logits
    assert torch.equal(replayed, plain)  # bit-identical: same gates, same dtype, same summation order
    assert torch.equal(rec2.used_tensor(), rec.used_tensor())
    # the plain forward's blocks (calls 0, 1) agree with the hand-written block on their own choice
    for layer, block in enumerate(b for _, b in model.named_modules() if type(b).__name__ == "MixtralSparseMoeBlock"):
        x, out = seen[layer]
        assert torch.allclose(_hand_block(block, x, rec.used[layer]), out, atol=1e-5)


def test_replay_under_a_moved_router_matches_the_hand_written_block():
    model = _mixtral()
    ids = _ids(2)
    tap = RouterTap(model)
    with torch.no_grad(), tap.capture() as rec:
        before = model(input_ids=ids).logits
    recorded = rec.used_tensor()
    with torch.no_grad():
        for _, _, router in find_routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.7)
    seen = _blocks_io(model)
    with torch.no_grad():
        moved = model(input_ids=ids).logits
        with tap.capture(replay=recorded) as rec3:
            replayed = model(input_ids=ids).logits
    own = rec3.router_tensor()
    changed, compared = topk_set_changes(own, recorded, torch.ones(own.shape[1], dtype=torch.bool))
    assert 0 < changed < compared  # the moved router would choose differently for some tokens
    assert torch.equal(rec3.used_tensor(), recorded)
    blocks = [b for _, b in model.named_modules() if type(b).__name__ == "MixtralSparseMoeBlock"]
    for layer, block in enumerate(blocks):
        x, out = seen[2 + layer]  # calls 0-1: the unreplayed forward, 2-3: the replayed one
        assert torch.allclose(_hand_block(block, x, recorded[layer]), out, atol=1e-5)
        # and not what the moved router's own choice gives on the same input, where that choice differs
        diff = (own[layer].sort(-1).values != recorded[layer].sort(-1).values).any(-1)
        if diff.any():
            mine = _hand_block(block, x, own[layer]).reshape(-1, x.shape[-1])
            assert not torch.allclose(mine[diff], out.reshape(-1, x.shape[-1])[diff], atol=1e-4)
    assert not torch.allclose(replayed, moved, atol=1e-4) and not torch.equal(replayed, before)


def test_replay_gradient_reaches_the_router():
    model = _mixtral()
    ids = _ids(3)
    tap = RouterTap(model)
    with torch.no_grad(), tap.capture() as rec:
        model(input_ids=ids)
    with tap.capture(replay=rec.used_tensor()):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for _, _, router in find_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_a_router_that_does_not_follow_the_formula_is_refused():
    model = _mixtral()
    ids = _ids()
    tap = RouterTap(model)
    with torch.no_grad(), tap.capture() as rec:
        model(input_ids=ids)
    for _, _, router in find_routers(model):
        router.norm_topk_prob = False  # a wrong declaration: Mixtral's router renormalises regardless
    assert tap.can_replay
    with pytest.raises(RuntimeError, match="gating weights differ"):
        with torch.no_grad(), tap.capture(replay=rec.used_tensor()):
            model(input_ids=ids)
