"""Token log-probabilities and entropy from logits, memory-light.

Pure torch (no Ray, vLLM, DeepSpeed or config imports). Both functions walk the ``[B, T, V]`` logits in
chunks of rows of the flattened ``[B*T, V]`` view, so that besides the logits themselves only one chunk's
float32 working copy (``chunk_size x V``) exists at a time. ``token_log_probs`` is differentiable through a
custom autograd function whose backward recomputes the softmax chunk by chunk instead of keeping a float32
copy of the whole logits tensor alive between forward and backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Default work per chunk: about 2**25 logits (128 MiB as float32), whatever the vocabulary size.
_CHUNK_ELEMENTS = 1 << 25


def _rows_per_chunk(vocab_size: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size={chunk_size!r} must be a positive number of rows")
        return int(chunk_size)
    return max(1, _CHUNK_ELEMENTS // max(1, vocab_size))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half, bfloat16 and float32 inputs; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """``log_softmax(logits / temperature)`` gathered at ``tokens``, over rows of a ``[N, V]`` view."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, rows: int) -> Tensor:  # noqa: D401
        n, _ = logits.shape
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        for start in range(0, n, rows):
            z = logits[start : start + rows].to(dtype) / temperature
            lse_c = torch.logsumexp(z, dim=-1)
            lse[start : start + rows] = lse_c
            out[start : start + rows] = z.gather(-1, tokens[start : start + rows, None]).squeeze(-1) - lse_c
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        ctx.rows = rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        # d log p(token) / d z = onehot(token) - softmax(z), and z = logits / temperature.
        logits, tokens, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n = logits.shape[0]
        for start in range(0, n, ctx.rows):
            sl = slice(start, start + ctx.rows)
            g = grad_out[sl].to(lse.dtype)
            z = logits[sl].to(lse.dtype) / ctx.temperature
            chunk = torch.exp(z - lse[sl, None]).mul_(-g[:, None])
            chunk.scatter_add_(-1, tokens[sl, None], g[:, None])
            grad[sl] = chunk.div_(ctx.temperature).to(grad.dtype)
        return grad, None, None, None


def token_log_probs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, *, chunk_size: int | None = None
) -> Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    ``out[b, t] = log_softmax(logits[b, t] / temperature)[tokens[b, t]]`` (natural log, nats): the policy's
    ``log pi_theta(y_t | x, y_<t)`` that enters the importance ratios of GSPO (paper Eq. 7) and GRPO, in the
    same post-temperature form as the rollout engine's behaviour log-probs.

    Memory: the logits are read in chunks of ``chunk_size`` rows of the flattened ``[B*T, V]`` view (default:
    about 2**25 logits per chunk), so no float32 copy of the whole ``[B, T, V]`` tensor is made, neither in the
    forward nor in the backward (which recomputes the softmax per chunk and writes the logits' gradient, one
    ``[B, T, V]`` tensor in the logits' dtype). Not twice differentiable.

    Args:
        logits: float ``[B, T, V]`` (any float dtype), position ``t`` predicting ``tokens[:, t]``.
        tokens: integer ``[B, T]`` token ids in ``[0, V)``; padding positions need a valid id too.
        temperature: sampling temperature (> 0) the behaviour policy used.
        chunk_size: rows of ``[B*T, V]`` per chunk (None: automatic).

    Returns:
        ``[B, T]`` float32 log-probs (float64 when ``logits`` is float64), differentiable w.r.t. ``logits``.

    Raises:
        ValueError: wrong ranks or mismatched shapes, a non-integer ``tokens`` tensor, a token id outside
            ``[0, V)``, or ``temperature <= 0``.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if tuple(tokens.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"tokens shape {tuple(tokens.shape)} does not match logits [B, T] {tuple(logits.shape[:2])}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    b, t, v = logits.shape
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= v):
        raise ValueError(
            f"tokens hold ids in [{int(tokens.min())}, {int(tokens.max())}], outside the vocabulary [0, {v})"
        )
    flat = logits.reshape(b * t, v)
    out = _ChunkedTokenLogProbs.apply(flat, tokens.reshape(b * t).long(), float(temperature), _rows_per_chunk(v, chunk_size))
    return out.view(b, t)


@torch.no_grad()
def entropy_from_logits(
    logits: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    num_tokens: float | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Mean entropy (nats) of the token distributions at the response positions, a training metric.

    ``H_t = -sum_v p_v log p_v`` with ``p = softmax(logits[b, t] / temperature)``, computed per row as
    ``logsumexp(z) - sum_v softmax(z)_v z_v``; the result is ``sum_{response tokens} H_t / num_tokens``.
    Logits of ``-inf`` (banned tokens) contribute 0. Computed in chunks of rows of ``[B*T, V]`` (float32 per
    chunk, never a second ``[B, T, V]`` float tensor) and without autograd: the result is detached.

    Args:
        logits: float ``[B, T, V]``.
        response_mask: bool or 0/1 ``[B, T]``; positions outside it are ignored, whatever their logits.
        temperature: > 0; the entropy is of the tempered distribution (1.0: of the raw policy).
        num_tokens: global token count to divide by (so micro-batch results sum to the minibatch mean);
            None: this call's number of response tokens. A call with no response token gives 0.
        chunk_size: rows per chunk (None: automatic).

    Returns:
        0-dim float32 tensor (float64 for float64 logits).

    Raises:
        ValueError: wrong shapes, ``temperature <= 0``, or ``num_tokens`` below this call's token count.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if tuple(response_mask.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} does not match logits [B, T] {tuple(logits.shape[:2])}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0")
    b, t, v = logits.shape
    dtype = _compute_dtype(logits.dtype)
    mask = response_mask.reshape(b * t) != 0
    local = int(mask.sum())
    if num_tokens is None:
        denom = local
    elif not float(num_tokens) >= local:
        raise ValueError(f"num_tokens={num_tokens!r} is smaller than this call's {local} response tokens")
    else:
        denom = float(num_tokens)
    flat = logits.reshape(b * t, v)
    rows = _rows_per_chunk(v, chunk_size)
    total = torch.zeros((), dtype=dtype, device=logits.device)
    for start in range(0, b * t, rows):
        m = mask[start : start + rows]
        z = flat[start : start + rows].to(dtype) / temperature
        lse = torch.logsumexp(z, dim=-1)
        p = torch.exp(z - lse[:, None])
        pz = torch.where(p > 0, p * z, 0.0).sum(-1)
        total += torch.where(m, lse - pz, 0.0).sum()
    return total / max(denom, 1)
