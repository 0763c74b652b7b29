"""Triton kernels for SwiGLU over a fused gate-up projection (spec: fastft/reference/swiglu.py).

Rows x columns tiles of the output; each program reads its columns' gate and up entries, computes in fp32 and
writes the output (forward) or both halves' gradients (backward, the activation recomputed from ``gate_up``:
nothing else is saved). Side-by-side halves are two contiguous tiles; interleaved ones one contiguous tile
of twice the width, split in registers (and the gradients interleaved back before one store). Launch wrappers
take explicit launch parameters; choosing them is fastft.swiglu's job. Row offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch


@triton.jit
def _halves(x_ptr, r, stride_x, rows, width, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """fp32 gate and up ``[BLOCK_R, BLOCK_C]`` of rows ``r`` and this program's output columns."""
    row = x_ptr + r[:, None] * stride_x
    if INTERLEAVED:
        cc = tl.program_id(1) * (2 * BLOCK_C) + tl.arange(0, 2 * BLOCK_C)
        mask = (r < rows)[:, None] & (cc < 2 * width)[None, :]
        pairs = tl.load(row + cc[None, :], mask=mask, other=0).to(tl.float32)
        g, u = tl.split(tl.reshape(pairs, (BLOCK_R, BLOCK_C, 2)))
    else:
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r < rows)[:, None] & (c < width)[None, :]
        g = tl.load(row + c[None, :], mask=mask, other=0).to(tl.float32)
        u = tl.load(row + width + c[None, :], mask=mask, other=0).to(tl.float32)
    return g, u


@triton.jit
def _clamped(g, u, limit):
    """``min(g, limit)`` and ``clamp(u, -limit, limit)``, NaN kept (as ``torch.clamp``)."""
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    return g, u


@triton.jit(do_not_specialize=["rows"])
def _swiglu_forward_kernel(
    x_ptr,
    out_ptr,
    rows,
    width,
    stride_x,
    alpha,
    limit,
    up_shift,
    INTERLEAVED: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    g, u = _halves(x_ptr, r, stride_x, rows, width, INTERLEAVED, BLOCK_R, BLOCK_C)
    if LIMIT:
        g, u = _clamped(g, u, limit)
    y = (u + up_shift) * (g * tl.sigmoid(g * alpha))
    mask = (r < rows)[:, None] & (c < width)[None, :]
    tl.store(out_ptr + r[:, None] * width + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def _swiglu_backward_kernel(
    x_ptr,
    dy_ptr,
    dx_ptr,
    rows,
    width,
    stride_x,
    alpha,
    limit,
    up_shift,
    INTERLEAVED: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < width)[None, :]
    g, u = _halves(x_ptr, r, stride_x, rows, width, INTERLEAVED, BLOCK_R, BLOCK_C)
    dy = tl.load(dy_ptr + r[:, None] * width + c[None, :], mask=mask, other=0).to(tl.float32)
    gc = g
    uc = u
    if LIMIT:
        gc, uc = _clamped(g, u, limit)
    s = tl.sigmoid(gc * alpha)
    dg = dy * (uc + up_shift) * (s + alpha * gc * s * (1 - s))
    du = dy * (gc * s)
    if LIMIT:  # torch.clamp's gradient: where the input lies within its bounds, ends included
        dg = tl.where(g <= limit, dg, 0.0)
        du = tl.where((u >= -limit) & (u <= limit), du, 0.0)
    row = dx_ptr + r[:, None] * (2 * width)
    if INTERLEAVED:
        cc = tl.program_id(1) * (2 * BLOCK_C) + tl.arange(0, 2 * BLOCK_C)
        pairs = tl.interleave(dg, du).to(dx_ptr.dtype.element_ty)
        tl.store(row + cc[None, :], pairs, mask=(r < rows)[:, None] & (cc < 2 * width)[None, :])
    else:
        tl.store(row + c[None, :], dg.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(row + width + c[None, :], du.to(dx_ptr.dtype.element_ty), mask=mask)


def _launch(kernel, tensors, rows, width, stride_x, interleaved, alpha, limit, up_shift, BLOCK_R, BLOCK_C, num_warps):
    launch(
        kernel,
        (cdiv(rows, BLOCK_R), cdiv(width, BLOCK_C)),
        *tensors,
        rows,
        width,
        stride_x,
        float(alpha),
        float(limit if limit is not None else 0.0),
        float(up_shift),
        INTERLEAVED=interleaved,
        LIMIT=limit is not None,
        BLOCK_R=BLOCK_R,
        BLOCK_C=BLOCK_C,
        num_warps=num_warps,
    )


def swiglu_forward(
    x: torch.Tensor,
    interleaved: bool,
    alpha: float,
    limit: float | None,
    up_shift: float,
    *,
    BLOCK_R: int,
    BLOCK_C: int,
    num_warps: int,
) -> torch.Tensor:
    """``[R, W]`` in ``x.dtype`` from ``x`` ``[R, 2W]`` (unit column stride)."""
    rows, width = x.shape[0], x.shape[1] // 2
    out = x.new_empty((rows, width))
    args = (rows, width, x.stride(0), interleaved, alpha, limit, up_shift, BLOCK_R, BLOCK_C, num_warps)
    _launch(_swiglu_forward_kernel, (x, out), *args)
    return out


def swiglu_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    interleaved: bool,
    alpha: float,
    limit: float | None,
    up_shift: float,
    *,
    BLOCK_R: int,
    BLOCK_C: int,
    num_warps: int,
) -> torch.Tensor:
    """``[R, 2W]`` in ``x.dtype``: the gradient of ``x`` (unit column stride) given contiguous ``dy`` ``[R, W]``."""
    rows, width = dy.shape
    dx = torch.empty((rows, 2 * width), dtype=x.dtype, device=x.device)
    args = (rows, width, x.stride(0), interleaved, alpha, limit, up_shift, BLOCK_R, BLOCK_C, num_warps)
    _launch(_swiglu_backward_kernel, (x, dy, dx), *args)
    return dx
