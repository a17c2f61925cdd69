"""Attention's forward and backward on the CPU in bf16, against float32 in the same invocation (the baseline), and
bf16 with the query, key and value upcast to float32 around it (what a bf16 learner runs on the CPU,
``learner/attention.py``).

    python bench/attention_dtype.py [--rows 16] [--heads 8] [--tokens 134] [--head-dim 64] [--reps 20]

One torch thread (as a learner rank on 2 cores). Prints the median milliseconds of each and their ratios to float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

# torch is imported where it is used, so that --help answers at once (tests/unit/cluster/test_docs_commands.py).


def median_ms(dtype: torch.dtype, upcast: bool, rows: int, heads: int, tokens: int, head_dim: int, reps: int) -> float:
    """Median ms of one causal SDPA forward + backward over ``[rows, heads, tokens, head_dim]`` inputs."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(rows, heads, tokens, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        if upcast:
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).to(dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.sum().backward()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=134)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    shape = (a.rows, a.heads, a.tokens, a.head_dim, a.reps)
    fp32 = median_ms(torch.float32, False, *shape)
    bf16 = median_ms(torch.bfloat16, False, *shape)
    up = median_ms(torch.bfloat16, True, *shape)
    print(f"float32 {fp32:.1f} ms, bf16 {bf16:.1f} ms ({bf16 / fp32:.2f}x), bf16 upcast to float32 {up:.1f} ms "
          f"({up / fp32:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
