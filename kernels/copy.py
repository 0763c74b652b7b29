"""Triton kernel for fastft.copy (spec: fastft/reference/copy.py): one strided-to-strided element copy.

``strided_copy(src, dst, ...)`` copies ``src`` into ``dst`` (same shape, any strides) element by element,
both reinterpreted as same-width integers so every dtype is copied bit for bit. Dimensions that are
contiguous with their neighbour in both tensors are merged first, so a dense copy is one flat loop; up to
``MAX_DIMS`` dimensions remain. Index arithmetic is int64 when any offset can pass 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch

MAX_DIMS = 6
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _digit(rest, size, src_stride, dst_stride, src_off, dst_off):
    d = rest % size
    return rest // size, src_off + d * src_stride, dst_off + d * dst_stride


@triton.jit
def _strided_copy_kernel(
    src_ptr,
    dst_ptr,
    n,
    z0,
    z1,
    z2,
    z3,
    z4,  # sizes of the inner dims, innermost first (the outermost is implied by n)
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,  # src strides, innermost first
    d0,
    d1,
    d2,
    d3,
    d4,
    d5,  # dst strides
    RANK: tl.constexpr,
    WIDE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if WIDE:
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    else:
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    rest = i
    src_off = tl.zeros_like(i)
    dst_off = tl.zeros_like(i)
    if RANK > 1:
        rest, src_off, dst_off = _digit(rest, z0, s0, d0, src_off, dst_off)
        s0 = s1
        d0 = d1
    if RANK > 2:
        rest, src_off, dst_off = _digit(rest, z1, s1, d1, src_off, dst_off)
        s0 = s2
        d0 = d2
    if RANK > 3:
        rest, src_off, dst_off = _digit(rest, z2, s2, d2, src_off, dst_off)
        s0 = s3
        d0 = d3
    if RANK > 4:
        rest, src_off, dst_off = _digit(rest, z3, s3, d3, src_off, dst_off)
        s0 = s4
        d0 = d4
    if RANK > 5:
        rest, src_off, dst_off = _digit(rest, z4, s4, d4, src_off, dst_off)
        s0 = s5
        d0 = d5
    # the outermost remaining dimension: no modulo
    values = tl.load(src_ptr + src_off + rest * s0, mask=mask)
    tl.store(dst_ptr + dst_off + rest * d0, values, mask=mask)


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()])


def merged_dims(shape, src_strides, dst_strides) -> list[tuple[int, int, int]]:
    """(size, src stride, dst stride) per dimension, innermost first, after dropping size-1 dimensions and
    merging each dimension into its inner neighbour where both tensors step over it contiguously."""
    dims: list[list[int]] = []
    for size, s, d in reversed(list(zip(shape, src_strides, dst_strides))):
        if size == 1:
            continue
        if dims and s == dims[-1][0] * dims[-1][1] and d == dims[-1][0] * dims[-1][2]:
            dims[-1][0] *= size
        else:
            dims.append([size, s, d])
    return [tuple(x) for x in dims] or [(1, 0, 0)]


def strided_copy(src: torch.Tensor, dst: torch.Tensor, *, BLOCK: int, num_warps: int) -> bool:
    """Copy ``src`` into ``dst`` (same shape and element size). False, copying nothing, when more than
    ``MAX_DIMS`` dimensions remain after merging (the caller copies another way)."""
    src, dst = _as_ints(src), _as_ints(dst)
    n = src.numel()
    if n == 0:
        return True
    dims = merged_dims(src.shape, src.stride(), dst.stride())
    if len(dims) > MAX_DIMS:
        return False
    extent = max(sum((z - 1) * abs(st) for z, st, _ in dims), sum((z - 1) * abs(st) for z, _, st in dims))
    sizes = [z for z, _, _ in dims[:-1]] + [1] * (MAX_DIMS - len(dims))
    pad = [0] * (MAX_DIMS - len(dims))
    launch(
        _strided_copy_kernel,
        (cdiv(n, BLOCK),),
        src,
        dst,
        n,
        *sizes[: MAX_DIMS - 1],
        *[s for _, s, _ in dims],
        *pad,
        *[d for _, _, d in dims],
        *pad,
        RANK=len(dims),
        WIDE=max(n, extent) >= 2**31,
        BLOCK=BLOCK,
        num_warps=num_warps,
    )
    return True
