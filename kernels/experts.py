"""Triton kernel for the experts' low-rank add (spec: ``grouped_lowrank_add`` in fastft/reference/experts.py).

``out[i] = y[i] + scaling * u[i] @ v[e]`` for each row ``i`` of expert ``e`` (rows grouped by ``ends``), in one
pass over ``y``: a LoRA adapter's second product (``u = x A_e^T``, ``v = B_e^T``) added to the base GEMM's
rows without writing the product as a tensor of its own. Each program takes a rows x columns tile; a row's
expert is found by binary search in ``ends``, and the tile loops over the experts its rows span (usually one
or two: rows are sorted by expert), one ``tl.dot`` of ``[rows, r] x [r, columns]`` each, fp32 accumulation.
Launch wrappers take explicit launch parameters; choosing them is fastft.experts' job. Row offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch


@triton.jit
def _expert_of_rows(ends_ptr, r, experts, STEPS: tl.constexpr):
    """Per row index ``r``: the number of ``ends`` entries ``<= r`` (its expert; ``experts`` past the last)."""
    lo = tl.zeros(r.shape, dtype=tl.int32)
    hi = tl.zeros(r.shape, dtype=tl.int32) + experts
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(ends_ptr + mid, mask=active, other=0)
        right = active & (end <= r)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo


@triton.jit(do_not_specialize=["rows"])
def _lowrank_add_kernel(
    y_ptr,
    u_ptr,
    v_ptr,
    ends_ptr,
    out_ptr,
    rows,
    cols,
    rank,
    experts,
    stride_y,
    stride_u,
    stride_ve,
    stride_vr,
    stride_vc,
    scaling,
    STEPS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_R)
    row_in = r < rows
    col_in = c < cols
    e = tl.where(row_in, _expert_of_rows(ends_ptr, r, experts, STEPS), experts)
    u = tl.load(u_ptr + r[:, None] * stride_u + k[None, :], mask=row_in[:, None] & (k < rank)[None, :], other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.min(e, axis=0)
    last = tl.minimum(tl.max(e, axis=0), experts - 1)
    for i in range(0, last - first + 1):
        ex = first + i
        ue = tl.where((e == ex)[:, None], u, tl.zeros_like(u))
        v = tl.load(
            v_ptr + ex.to(tl.int64) * stride_ve + k[:, None] * stride_vr + c[None, :] * stride_vc,
            mask=(k < rank)[:, None] & col_in[None, :],
            other=0,
        )
        if IEEE:
            acc = tl.dot(ue, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(ue, v, acc)
    mask = row_in[:, None] & col_in[None, :]
    y = tl.load(y_ptr + r[:, None] * stride_y + c[None, :], mask=mask, other=0).to(tl.float32)
    out = y + tl.where((e < experts)[:, None], acc * scaling, 0.0)
    tl.store(out_ptr + r[:, None] * cols + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def grouped_lowrank_add(
    y: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    ends: torch.Tensor,
    scaling: float,
    *,
    BLOCK_M: int,
    BLOCK_N: int,
    num_warps: int,
) -> torch.Tensor:
    """``[N, out]`` contiguous in ``y.dtype``. ``y`` ``[N, out]`` and ``u`` ``[N, r]`` with unit column
    stride, ``v`` ``[E, r, out]`` any strides in ``u.dtype``, ``ends`` ``[E]`` int32 contiguous."""
    rows, cols = y.shape
    rank = u.shape[1]
    experts = v.shape[0]
    out = torch.empty((rows, cols), dtype=y.dtype, device=y.device)
    launch(
        _lowrank_add_kernel,
        (cdiv(rows, BLOCK_M), cdiv(cols, BLOCK_N)),
        y,
        u,
        v,
        ends,
        out,
        rows,
        cols,
        rank,
        experts,
        y.stride(0),
        u.stride(0),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        float(scaling),
        STEPS=experts.bit_length() + 1,
        IEEE=u.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        num_warps=num_warps,
    )
    return out
