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
    GROUP: tl.constexpr,
):
    # One program: tokens [t0, t0 + BLOCK_T) of one channel block, one token at a time, GROUP tokens' x and
    # dout loaded together. Token s's gradient g[s] (through SiLU: the pre-activation recomputed from the
    # last W inputs, kept in registers) is computed once; dx[s - (W-1)] = sum_k w[W-1-k] g[s-(W-1)+k] over
    # the taps k whose token is in its document (pos >= k) is written once the last of them is known, so
    # the program reads W - 1 tokens past its block. dweight (row W-1-j: tap j) and dbias (row W) sums of
    # its own tokens go to part[program].
    pid_t = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < c
    rows = ch * 0  # a row's index per channel: the interpreter takes no scalar-and-vector mask
    t0 = pid_t * BLOCK_T  # token indices in int32 (n is); offsets in int64
    zero = tl.zeros((BLOCK_C,), dtype=tl.float32)
    taps = ()  # taps[j] = weight[:, W-1-j]: the weight of x[s - j] in token s's pre-activation
    for j in tl.static_range(W):
        taps += (tl.load(w_ptr + ch * W + (W - 1 - j), mask=cmask, other=0).to(tl.float32),)
    bias = zero
    if HAS_BIAS:
        bias = tl.load(b_ptr + ch, mask=cmask, other=0).to(tl.float32)
    xw = ()  # xw[i] = x[s - 1 - i]
    for i in tl.static_range(W - 1):
        row = t0 - 1 - i
        xw += (
            tl.load(x_ptr + row.to(tl.int64) * stride_x + ch, mask=cmask & (rows + row >= 0), other=0).to(tl.float32),
        )
    gw = (zero,) * (W - 1)  # gw[i] = g[s - 1 - i] (before t0: never read)
    pw = (t0 * 0,) * (W - 1)  # pw[i] = pos[s - 1 - i]
    dws = (zero,) * W  # dws[j] = sum over own tokens s of g[s] * x[s - j] (x[s - j] in s's document)
    db = zero
    for group in range(tl.cdiv(BLOCK_T + W - 1, GROUP)):
        base = t0 + group * GROUP
        xrow = x_ptr + base.to(tl.int64) * stride_x + ch
        grow = dout_ptr + base.to(tl.int64) * stride_dout + ch
        xs = ()
        gs = ()
        ps = ()
        for i in tl.static_range(GROUP):
            m = cmask & (rows + base + i < n)
            xs += (tl.load(xrow + i * stride_x, mask=m, other=0),)
            gs += (tl.load(grow + i * stride_dout, mask=m, other=0),)
            ps += (tl.load(pos_ptr + base + i, mask=base + i < n, other=0).to(tl.int32),)
        for i in tl.static_range(GROUP):
            s = base + i
            p = ps[i]
            xm = (xs[i].to(tl.float32),)  # xm[j] = x[s - j] where s - j is in s's document, else 0
            for j in tl.static_range(1, W):
                xm += (tl.where(p >= j, xw[j - 1], 0.0),)
            g = gs[i].to(tl.float32)
            if SILU:
                pre = bias + xm[0] * taps[0]
                for j in tl.static_range(1, W):
                    pre += xm[j] * taps[j]
                sig = tl.sigmoid(pre)
                g = g * (sig * (1 + pre * (1 - sig)))
            g_own = tl.where(s < t0 + BLOCK_T, g, 0.0)  # tokens past n have g = 0
            db += g_own
            for j in tl.static_range(W):
                dws = dws[:j] + (dws[j] + g_own * xm[j],) + dws[j + 1 :]
            d = s - (W - 1)  # the token whose dx is now known
            dx = tl.where(p >= W - 1, g, 0.0) * taps[W - 1]
            for k in tl.static_range(W - 1):
                dx += tl.where(pw[W - 2 - k] >= k, gw[W - 2 - k], 0.0) * taps[k]
            ok = cmask & (rows + d >= t0) & (rows + d < t0 + BLOCK_T) & (rows + d < n)
            tl.store(dx_ptr + d.to(tl.int64) * c + ch, dx.to(dx_ptr.dtype.element_ty), mask=ok)
            xw = ((xm[0],) + xw)[: W - 1]
            gw = ((g,) + gw)[: W - 1]
            pw = ((p,) + pw)[: W - 1]
    part = part_ptr + pid_t.to(tl.int64) * (ROWS * c) + ch
    for j in tl.static_range(W):
        tl.store(part + (W - 1 - j) * c, dws[j], mask=cmask)
    tl.store(part + W * c, db, mask=cmask)


@triton.jit
def _conv_reduce_kernel(
    part_ptr,
    dw_ptr,
    db_ptr,
    blocks,
    c,
    W: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # dweight [C, W] (row i of part: column i) and dbias [C] (row W): part's rows summed over the blocks in
    # order, in fp32, stored in the outputs' dtypes.
    ch = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < c
    rows = tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, BLOCK_C), dtype=tl.float32)
    ptrs = part_ptr + rows[:, None] * c + ch[None, :]
    m = (rows[:, None] < W + 1) & cmask[None, :]
    for _ in range(blocks):
        acc += tl.load(ptrs, mask=m, other=0)
        ptrs += ROWS * c
    tl.store(
        dw_ptr + ch[None, :] * W + rows[:, None],
        acc.to(dw_ptr.dtype.element_ty),
        mask=(rows[:, None] < W) & cmask[None, :],
    )
    db = tl.sum(tl.where(rows[:, None] == W, acc, 0.0), axis=0)
    tl.store(db_ptr + ch, db.to(db_ptr.dtype.element_ty), mask=cmask)


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
    dout,
    x,
    weight,
    bias,
    pos,
    silu: bool,
    *,
    BLOCK_T: int,
    BLOCK_C: int,
    GROUP: int,
    num_warps: int,
    maxnreg: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in ``x.dtype``, dweight ``[C, W]`` in ``weight.dtype``, dbias ``[C]`` in ``bias.dtype`` (weight's
    without bias)) as the reference's ``shifted_conv1d_backward``, summed in fp32; ``dout`` ``[N, C]`` with
    unit channel stride. Deterministic: per-program partial sums, then a second kernel
    sums them in a fixed order."""
    n, c = x.shape
    w = weight.shape[1]
    rows = next_power_of_2(w + 1)
    blocks = cdiv(n, BLOCK_T)
    dx = torch.empty((n, c), dtype=x.dtype, device=x.device)
    part = torch.empty((blocks, rows, c), dtype=torch.float32, device=x.device)
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
        ROWS=rows,
        HAS_BIAS=bias is not None,
        SILU=silu,
        BLOCK_T=BLOCK_T,
        BLOCK_C=BLOCK_C,
        GROUP=GROUP,
        num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    dweight = torch.empty((c, w), dtype=weight.dtype, device=x.device)
    dbias = torch.empty((c,), dtype=(weight if bias is None else bias).dtype, device=x.device)
    launch(
        _conv_reduce_kernel, (cdiv(c, _REDUCE_C),), part, dweight, dbias, blocks, c, W=w, ROWS=rows, BLOCK_C=_REDUCE_C
    )
    return dx, dweight, dbias


_REDUCE_C = 128  # channels per program of the partial sums' reduction
