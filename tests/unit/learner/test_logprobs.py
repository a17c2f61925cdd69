"""token_log_probs and entropy_from_logits against hand values and float64 evaluations, and their memory
bound (no second [B, T, V] float tensor), checked by recording every tensor the ops produce."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from learner.logprobs import token_log_probs
from learner.objectives import entropy_from_logits


class NewTensors(TorchDispatchMode):
    """Records the size of every floating-point tensor an aten op allocates (views and in-place results,
    which share an input's storage, are not allocations)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                if t.untyped_storage().data_ptr() not in inputs:
                    self.sizes.append(t.numel())
        return out


def _reference_log_probs(logits, tokens, temperature):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)


def test_hand_values():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(3.0), 0.0]]])
    tokens = torch.tensor([[1, 1]])
    out = token_log_probs(logits, tokens)
    torch.testing.assert_close(out, torch.tensor([[math.log(0.75), math.log(0.25)]]))
    # temperature 2: z = [0, log(3)/2], p(1) = sqrt(3) / (1 + sqrt(3))
    out_t = token_log_probs(logits, tokens, temperature=2.0)
    r3 = math.sqrt(3)
    torch.testing.assert_close(out_t, torch.tensor([[math.log(r3 / (1 + r3)), math.log(1 / (1 + r3))]]))


@pytest.mark.parametrize("chunk_size", [1, 5, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_float64_log_softmax(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g) * 4
    tokens = torch.randint(0, 50, (3, 7), generator=g)
    out = token_log_probs(logits, tokens, temperature, chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == (3, 7)
    torch.testing.assert_close(out.double(), _reference_log_probs(logits, tokens, temperature), rtol=1e-5, atol=1e-5)


def test_bfloat16_logits_give_float32_and_large_logits_are_stable():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 4, 30, generator=g) * 1e4).to(torch.bfloat16)
    tokens = torch.randint(0, 30, (2, 4), generator=g)
    out = token_log_probs(logits, tokens)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference_log_probs(logits.float(), tokens, 1.0), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("chunk_size", [2, None])
def test_gradient_matches_float64_autograd(chunk_size):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    weights = torch.randn(2, 5, generator=g, dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    (token_log_probs(a, tokens, 0.8, chunk_size=chunk_size) * weights).sum().backward()
    b = logits.clone().requires_grad_(True)
    (_reference_log_probs(b, tokens, 0.8) * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: token_log_probs(x, tokens, 0.8, chunk_size=3), (b.detach().requires_grad_(),))


def test_float32_gradient_in_logits_dtype():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 9, generator=g).requires_grad_(True)
    tokens = torch.randint(0, 9, (2, 3), generator=g)
    token_log_probs(logits, tokens).sum().backward()
    expected = torch.nn.functional.one_hot(tokens, 9).float() - torch.softmax(logits.detach(), -1)
    assert logits.grad.dtype == torch.float32
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_bound_one_full_tensor_at_most(dtype):
    B, T, V, rows = 4, 8, 64, 4
    logits = torch.randn(B, T, V).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, V, (B, T))
    with NewTensors() as fwd:
        out = token_log_probs(logits, tokens, 0.9, chunk_size=rows)
    assert max(fwd.sizes) <= rows * V  # forward: only chunk-sized float tensors
    with NewTensors() as bwd:
        out.sum().backward()
    assert sum(1 for n in bwd.sizes if n > rows * V) == 1  # backward: the logits' gradient, nothing else
    with NewTensors() as ent:
        entropy_from_logits(logits, torch.ones(B, T), chunk_size=rows)
    assert max(ent.sizes) <= rows * V


def test_errors():
    logits = torch.randn(1, 2, 5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_log_probs(logits, torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match="temperature=0"):
        token_log_probs(logits, torch.tensor([[0, 1]]), temperature=0)
    with pytest.raises(ValueError, match="tokens shape"):
        token_log_probs(logits, torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="logits must be"):
        token_log_probs(logits[0], torch.tensor([0, 1]))


def test_entropy_hand_values():
    # uniform over 4 -> log 4; [p=0.5, 0.5, 0, 0] via -inf -> log 2 (banned tokens contribute 0)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, -math.inf, -math.inf], [float("nan")] * 4]])
    mask = torch.tensor([[True, True, False]])
    out = entropy_from_logits(logits, mask)
    assert out.item() == pytest.approx((math.log(4) + math.log(2)) / 2, rel=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_entropy_matches_float64(chunk_size):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 40, generator=g) * 3
    mask = torch.rand(3, 5, generator=g) > 0.3
    p = torch.softmax(logits.double() / 0.7, -1)
    per_token = -(p * p.log()).sum(-1)
    expected = per_token[mask].mean()
    out = entropy_from_logits(logits, mask, temperature=0.7, chunk_size=chunk_size)
    assert out.item() == pytest.approx(expected.item(), rel=1e-5)
    # global normaliser: two halves sum to the whole
    n = int(mask.sum())
    halves = entropy_from_logits(logits[:2], mask[:2], temperature=0.7, num_tokens=n) + entropy_from_logits(
        logits[2:], mask[2:], temperature=0.7, num_tokens=n)
    assert halves.item() == pytest.approx(expected.item(), rel=1e-5)


def test_entropy_empty_mask_is_zero():
    out = entropy_from_logits(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.bool))
    assert out.item() == 0.0
