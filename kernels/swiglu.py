"""Triton kernels for SwiGLU (spec: fastft/reference/swiglu.py).

Rows x columns tiles of the output; each program reads its columns' gate and up entries (two row-strided
tensors: a fused gate-up projection's halves, or two projections' outputs), computes in fp32 and
writes the output (forward) or both inputs' gradients (backward, the activation recomputed from the inputs:
nothing else is saved). Side-by-side halves are two contiguous tiles; interleaved ones one contiguous tile
of twice the width, split in registers (and the gradients interleaved back before one store). With ``GELU``
the activation is GELU's tanh form, ``g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))`` (``0.5 (1 + tanh z) =
sigmoid(2 z)``), else ``g * sigmoid(alpha g)``. Launch wrappers take explicit launch parameters; choosing them
is fastft.swiglu's job. Row offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch


@triton.jit
def _halves(
    g_ptr,
    u_ptr,
    r,
    stride_g,
    stride_u,
    rows,
    width,
    INTERLEAVED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """fp32 gate and up ``[BLOCK_R, BLOCK_C]`` of rows ``r`` and this program's output columns (interleaved:
    both from ``g_ptr``'s rows)."""
    if INTERLEAVED:
        cc = tl.program_id(1) * (2 * BLOCK_C) + tl.arange(0, 2 * BLOCK_C)
        mask = (r < rows)[:, None] & (cc < 2 * width)[None, :]
        pairs = tl.load(g_ptr + r[:, None] * stride_g + cc[None, :], mask=mask, other=0).to(tl.float32)
        g, u = tl.split(tl.reshape(pairs, (BLOCK_R, BLOCK_C, 2)))
    else:
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r < rows)[:, None] & (c < width)[None, :]
        g = tl.load(g_ptr + r[:, None] * stride_g + c[None, :], mask=mask, other=0).to(tl.float32)
        u = tl.load(u_ptr + r[:, None] * stride_u + c[None, :], mask=mask, other=0).to(tl.float32)
    return g, u


@triton.jit
def _clamped(g, u, limit):
    """``min(g, limit)`` and ``clamp(u, -limit, limit)``, NaN kept (as ``torch.clamp``)."""
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    return g, u


@triton.jit
def _activation(g, alpha, GELU: tl.constexpr):
    """The activation's sigmoid factor ``s`` (``act = g s``) and its derivative ``act'``."""
    if GELU:
        k = 1.5957691216057308  # 2 sqrt(2 / pi)
        s = tl.sigmoid(k * (g + 0.044715 * g * g * g))
        d = s + g * s * (1 - s) * k * (1 + 3 * 0.044715 * g * g)
    else:
        s = tl.sigmoid(g * alpha)
        d = s + alpha * g * s * (1 - s)
    return s, d


@triton.jit(do_not_specialize=["rows"])
def _swiglu_forward_kernel(
    g_ptr,
    u_ptr,
    out_ptr,
    rows,
    width,
    stride_g,
    stride_u,
    alpha,
    limit,
    up_shift,
    INTERLEAVED: tl.constexpr,
    LIMIT: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    g, u = _halves(g_ptr, u_ptr, r, stride_g, stride_u, rows, width, INTERLEAVED, BLOCK_R, BLOCK_C)
    if LIMIT:
        g, u = _clamped(g, u, limit)
    s, _ = _activation(g, alpha, GELU)  # the derivative, unused, is compiled out
    y = (u + up_shift) * (g * s)
    mask = (r < rows)[:, None] & (c < width)[None, :]
    tl.store(out_ptr + r[:, None] * width + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def _swiglu_backward_kernel(
    g_ptr,
    u_ptr,
    dy_ptr,
    dg_ptr,
    du_ptr,
    rows,
    width,
    stride_g,
    stride_u,
    stride_dg,
    stride_du,
    alpha,
    limit,
    up_shift,
    INTERLEAVED: tl.constexpr,
    LIMIT: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < width)[None, :]
    g, u = _halves(g_ptr, u_ptr, r, stride_g, stride_u, rows, width, INTERLEAVED, BLOCK_R, BLOCK_C)
    dy = tl.load(dy_ptr + r[:, None] * width + c[None, :], mask=mask, other=0).to(tl.float32)
    gc = g
    uc = u
    if LIMIT:
        gc, uc = _clamped(g, u, limit)
    s, dact = _activation(gc, alpha, GELU)
    dg = dy * (uc + up_shift) * dact
    du = dy * (gc * s)
    if LIMIT:  # torch.clamp's gradient: where the input lies within its bounds, ends included
        dg = tl.where(g <= limit, dg, 0.0)
        du = tl.where((u >= -limit) & (u <= limit), du, 0.0)
    if INTERLEAVED:
        cc = tl.program_id(1) * (2 * BLOCK_C) + tl.arange(0, 2 * BLOCK_C)
        pairs = tl.interleave(dg, du).to(dg_ptr.dtype.element_ty)
        mask2 = (r < rows)[:, None] & (cc < 2 * width)[None, :]
        tl.store(dg_ptr + r[:, None] * stride_dg + cc[None, :], pairs, mask=mask2)
    else:
        tl.store(dg_ptr + r[:, None] * stride_dg + c[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + r[:, None] * stride_du + c[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)


def _launch(
    kernel, tensors, strides, rows, width, interleaved, alpha, limit, up_shift, gelu, BLOCK_R, BLOCK_C, num_warps
):
    launch(
        kernel,
        (cdiv(rows, BLOCK_R), cdiv(width, BLOCK_C)),
        *tensors,
        rows,
        width,
        *strides,
        float(alpha),
        float(limit if limit is not None else 0.0),
        float(up_shift),
        INTERLEAVED=interleaved,
        LIMIT=limit is not None,
        GELU=gelu,
        BLOCK_R=BLOCK_R,
        BLOCK_C=BLOCK_C,
        num_warps=num_warps,
    )


def swiglu_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    interleaved: bool,
    alpha: float,
    limit: float | None,
    up_shift: float,
    gelu: bool,
    *,
    BLOCK_R: int,
    BLOCK_C: int,
    num_warps: int,
) -> torch.Tensor:
    """``[R, W]`` in ``gate.dtype`` from ``gate`` and ``up`` ``[R, W]`` (unit column strides; views of one
    ``[R, 2W]`` tensor's halves, or two tensors), or with ``interleaved`` from ``gate`` ``[R, 2W]`` alone
    (``up`` is ignored); ``gelu``: GELU's tanh form instead of ``g sigmoid(alpha g)``."""
    rows, width = gate.shape[0], gate.shape[1] // 2 if interleaved else gate.shape[1]
    out = gate.new_empty((rows, width))
    args = (rows, width, interleaved, alpha, limit, up_shift, gelu, BLOCK_R, BLOCK_C, num_warps)
    _launch(_swiglu_forward_kernel, (gate, up, out), (gate.stride(0), up.stride(0)), *args)
    return out


def swiglu_backward(
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    dgate: torch.Tensor,
    dup: torch.Tensor,
    interleaved: bool,
    alpha: float,
    limit: float | None,
    up_shift: float,
    gelu: bool,
    *,
    BLOCK_R: int,
    BLOCK_C: int,
    num_warps: int,
) -> None:
    """Writes ``gate``'s and ``up``'s gradients into ``dgate`` and ``dup`` (their shapes, unit column strides)
    given contiguous ``dy`` ``[R, W]``; with ``interleaved``, ``gate``'s (``[R, 2W]``, both halves) into
    ``dgate`` alone."""
    rows, width = dy.shape
    args = (rows, width, interleaved, alpha, limit, up_shift, gelu, BLOCK_R, BLOCK_C, num_warps)
    strides = (gate.stride(0), up.stride(0), dgate.stride(0), dup.stride(0))
    _launch(_swiglu_backward_kernel, (gate, up, dy, dgate, dup), strides, *args)
