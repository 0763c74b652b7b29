"""Triton kernels for the packed causal depthwise conv1d (spec: fastft/reference/conv.py).

Tokens x channels tiles; a tap ``j`` reads ``x[t - j]`` only where ``j <= pos[t]`` (same document), so
no state crosses a document boundary. Launch wrappers take explicit launch parameters; choosing them is
fastft.conv's job. Token offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2


@triton.jit
def _pre_activation(
    x_ptr,
    w_ptr,
    b_ptr,
    pos,
    t,
    ch,
    tmask,
    cmask,
    stride_x,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """fp32 ``[BLOCK_T, BLOCK_C]``: ``bias + sum_{j <= pos[t]} w[c, W-1-j] * x[t-j, c]`` for tokens ``t``."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ch, mask=cmask, other=0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        w = tl.load(w_ptr + ch * W + (W - 1 - j), mask=cmask, other=0).to(tl.float32)
        m = (tmask & (pos >= j))[:, None] & cmask[None, :]
        xv = tl.load(x_ptr + (t - j)[:, None] * stride_x + ch[None, :], mask=m, other=0).to(tl.float32)
        acc += xv * w[None, :]
    return acc


@triton.jit(do_not_specialize=["n"])
def _conv_forward_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    pos_ptr,
    out_ptr,
    n,
    c,
    stride_x,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tmask = t < n
    cmask = ch < c
    pos = tl.load(pos_ptr + t, mask=tmask, other=0)
    acc = _pre_activation(x_ptr, w_ptr, b_ptr, pos, t, ch, tmask, cmask, stride_x, W, HAS_BIAS, BLOCK_T, BLOCK_C)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    out = out_ptr + t[:, None] * c + ch[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["n"])
def _conv_backward_kernel(
    dout_ptr,
    x_ptr,
    w_ptr,
    b_ptr,
    pos_ptr,
    dx_ptr,
    part_ptr,
    n,
    c,
    stride_x,
    stride_dout,
    W: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TILES: tl.constexpr,
):
    # One program: TILES consecutive token tiles of one channel block. dx of each tile, and this program's
    # partial sums of dweight (row W-1-j: tap j) and dbias (row W) in part[program's token block].
    pid_t = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < c
    rows = tl.arange(0, ROWS)
    partial = tl.zeros((ROWS, BLOCK_C), dtype=tl.float32)
    for tile in range(TILES):
        t = (pid_t.to(tl.int64) * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < n
        dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for k in tl.static_range(W):
            # Token t + k's gradient reaches x[t] through tap k iff t + k is in t's document.
            tk = t + k
            kmask = tk < n
            pos_k = tl.load(pos_ptr + tk, mask=kmask, other=0)
            g = tl.load(
                dout_ptr + tk[:, None] * stride_dout + ch[None, :], mask=kmask[:, None] & cmask[None, :], other=0
            )
            g = g.to(tl.float32)
            if SILU:
                pre = _pre_activation(
                    x_ptr, w_ptr, b_ptr, pos_k, tk, ch, kmask, cmask, stride_x, W, HAS_BIAS, BLOCK_T, BLOCK_C
                )
                s = tl.sigmoid(pre)
                g = g * (s * (1 + pre * (1 - s)))
            w = tl.load(w_ptr + ch * W + (W - 1 - k), mask=cmask, other=0).to(tl.float32)
            dx += tl.where((kmask & (pos_k >= k))[:, None], g, 0.0) * w[None, :]
            if k == 0:  # g is token t's own gradient: this tile's share of dweight and dbias
                partial += tl.where(rows[:, None] == W, tl.sum(g, axis=0)[None, :], 0.0)
                for j in tl.static_range(W):
                    m = (tmask & (pos_k >= j))[:, None] & cmask[None, :]
                    xv = tl.load(x_ptr + (t - j)[:, None] * stride_x + ch[None, :], mask=m, other=0).to(tl.float32)
                    partial += tl.where(rows[:, None] == W - 1 - j, tl.sum(g * xv, axis=0)[None, :], 0.0)
        tl.store(
            dx_ptr + t[:, None] * c + ch[None, :], dx.to(dx_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :]
        )
    part = part_ptr + (pid_t * (W + 1) + rows[:, None]).to(tl.int64) * c + ch[None, :]
    tl.store(part, partial, mask=(rows[:, None] < W + 1) & cmask[None, :])


def conv1d_forward(x, weight, bias, pos, silu: bool, *, BLOCK_T: int, BLOCK_C: int, num_warps: int) -> torch.Tensor:
    """``[N, C]`` output in ``x.dtype`` for ``x`` ``[N, C]`` (unit channel stride), contiguous ``weight``
    ``[C, W]``, ``bias`` ``[C]`` or None, int64 positions ``pos`` ``[N]``; N, C >= 1."""
    n, c = x.shape
    out = torch.empty((n, c), dtype=x.dtype, device=x.device)
    launch(
        _conv_forward_kernel,
        (cdiv(n, BLOCK_T), cdiv(c, BLOCK_C)),
        x,
        weight,
        weight if bias is None else bias,
        pos,
        out,
        n,
        c,
        x.stride(0),
        W=weight.shape[1],
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_T=BLOCK_T,
        BLOCK_C=BLOCK_C,
        num_warps=num_warps,
    )
    return out


def conv1d_backward(
    dout, x, weight, bias, pos, silu: bool, *, BLOCK_T: int, BLOCK_C: int, TILES: int, num_warps: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in ``x.dtype``, dweight fp32 ``[C, W]``, dbias fp32 ``[C]``) as the reference's
    ``shifted_conv1d_backward``; ``dout`` ``[N, C]`` with unit channel stride. Deterministic: per-program
    partial sums, then a fixed-order sum over them."""
    n, c = x.shape
    w = weight.shape[1]
    blocks = cdiv(n, BLOCK_T * TILES)
    dx = torch.empty((n, c), dtype=x.dtype, device=x.device)
    part = torch.empty((blocks, w + 1, c), dtype=torch.float32, device=x.device)
    launch(
        _conv_backward_kernel,
        (blocks, cdiv(c, BLOCK_C)),
        dout,
        x,
        weight,
        weight if bias is None else bias,
        pos,
        dx,
        part,
        n,
        c,
        x.stride(0),
        dout.stride(0),
        W=w,
        ROWS=next_power_of_2(w + 1),
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_T=BLOCK_T,
        BLOCK_C=BLOCK_C,
        TILES=TILES,
        num_warps=num_warps,
    )
    sums = part.sum(0)  # [W + 1, C]
    return dx, sums[:w].t().contiguous(), sums[w].clone()
