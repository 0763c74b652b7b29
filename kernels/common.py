"""Triton device helpers shared by fastft's kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def max_combine(a, b):
    """Combine function of ``tl.associative_scan`` for a running maximum."""
    return tl.maximum(a, b)


@triton.jit
def last_at_most(table_ptr, x, mask, hi_start, STEPS: tl.constexpr):
    """Per lane, the largest ``i`` in ``[0, hi_start]`` with ``table[i] <= x`` for a non-decreasing
    ``table`` whose ``table[0] <= x`` (0 if none other); ``STEPS`` >= bit length of ``hi_start``."""
    lo = tl.zeros(x.shape, dtype=tl.int32)
    hi = tl.zeros(x.shape, dtype=tl.int32) + hi_start
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        go = tl.load(table_ptr + mid, mask=mask, other=0) <= x
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo
