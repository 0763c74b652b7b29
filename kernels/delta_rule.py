"""Triton kernels for fastft.delta_rule's chunked gated delta rule: the scan over chunks (its sequential part)
and, for one log decay per head, the intra-chunk part, the output's products and the passes into the chunk
layout and back.

``chunk_scan(w, u, k_decayed, chunk_decay, first, ...)`` computes what ``fastft.delta_rule.scan_chunks``
computes (its specification): for each head, chunk after chunk, the state entering the chunk (zeroed where
``first``), ``v_new = u - w @ state`` and the state leaving it, ``state * chunk_decay + k_decayed^T @ v_new``
(``chunk_decay`` a scalar per head and chunk, or one per row of the state: Kimi Delta Attention).

``chunk_scan_backward`` runs the same chunks in reverse, carrying ``dS``, the gradient of the state leaving a
chunk: for chunk i, with ``S`` its entering state and ``dS`` (0 after the last chunk, and 0 entering a chunk
that starts a document, whose entering state does not depend on the one before),

    dv_new_total = dv_new + k_decayed @ dS        (= du)
    dS_before    = dstates + chunk_decay * dS - w^T @ dv_new_total

and writes each chunk's ``dS`` and ``du``; ``dchunk_decay = sum(S * dS)`` (over the row only, for a decay per
row), ``dw = -du @ S^T`` and ``dk_decayed = v_new @ dS^T`` are then taken over all chunks at once
(``fastft.delta_rule``).

One program per (head, block of BV value columns) keeps its ``[Dk, BV]`` slice of the state (or of dS) in
registers for the whole scan; every column of the state evolves alone, so the blocks never communicate. fp32
throughout; on NVIDIA GPUs from sm80 the products run on tensor cores in 3xTF32 (each fp32 operand split into a
TF32 high part and the TF32 rest, three products summed: fp32's accuracy, not TF32's), elsewhere in IEEE fp32.

``intra_forward`` / ``intra_backward`` run one program per (head, chunk of at most 64 tokens), all chunks at
once: the chunk's ``T = (I + L)^-1`` (blocks of 16 by forward substitution, merged by products), ``w``, ``u``
and the decays, and their backward through ``T`` without a solve. ``output_forward`` / ``output_backward``: the
output's products per chunk. ``pack_forward`` / ``pack_backward`` and ``unpack_forward`` / ``unpack_backward``:
the tokens into the chunk layout's fp32 slots (q and k l2-normalised, q scaled) and the output back, one program
per head and block of rows. ``fastft.delta_rule._TritonChunks`` states the algorithm; the torch backend's
autograd graph is its specification.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, dot_precision, launch, next_power_of_2, unit_inner


@triton.jit
def _chunk_scan_kernel(
    w_ptr,
    u_ptr,
    kd_ptr,
    decay_ptr,
    first_ptr,
    states_ptr,
    vnew_ptr,
    NC,
    C,
    DK,
    DV,
    PER_CHANNEL: tl.constexpr,
    DOT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_h = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    oc = tl.arange(0, BC)
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    ck = (oc[:, None] < C) & (ok[None, :] < DK)
    cv = (oc[:, None] < C) & (ov[None, :] < DV)
    kv = (ok[:, None] < DK) & (ov[None, :] < DV)
    state = tl.zeros([BK, BV], dtype=tl.float32)
    for c in range(NC):
        chunk = i_h * NC + c
        first = tl.load(first_ptr + c)
        state = tl.where(first != 0, 0.0, state)
        tl.store(states_ptr + chunk * DK * DV + ok[:, None] * DV + ov[None, :], state, mask=kv)
        w = tl.load(w_ptr + chunk * C * DK + oc[:, None] * DK + ok[None, :], mask=ck, other=0.0)
        u = tl.load(u_ptr + chunk * C * DV + oc[:, None] * DV + ov[None, :], mask=cv, other=0.0)
        v_new = u - tl.dot(w, state, input_precision=DOT)
        tl.store(vnew_ptr + chunk * C * DV + oc[:, None] * DV + ov[None, :], v_new, mask=cv)
        kd = tl.load(kd_ptr + chunk * C * DK + oc[:, None] * DK + ok[None, :], mask=ck, other=0.0)
        if PER_CHANNEL:
            decay = tl.load(decay_ptr + chunk * DK + ok, mask=ok < DK, other=0.0)[:, None]
        else:
            decay = tl.load(decay_ptr + chunk)
        state = state * decay + tl.dot(tl.trans(kd), v_new, input_precision=DOT)


@triton.jit
def _chunk_scan_backward_kernel(
    w_ptr,
    kd_ptr,
    decay_ptr,
    first_ptr,
    dstates_ptr,
    dvnew_ptr,
    dsout_ptr,
    du_ptr,
    NC,
    C,
    DK,
    DV,
    PER_CHANNEL: tl.constexpr,
    DOT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_h = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    oc = tl.arange(0, BC)
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    ck = (oc[:, None] < C) & (ok[None, :] < DK)
    cv = (oc[:, None] < C) & (ov[None, :] < DV)
    kv = (ok[:, None] < DK) & (ov[None, :] < DV)
    # The gradient of the state leaving the chunk (columns ov), carried backwards through the chunks.
    ds = tl.zeros([BK, BV], dtype=tl.float32)
    for r in range(NC):
        c = NC - 1 - r
        chunk = i_h * NC + c
        tl.store(dsout_ptr + chunk * DK * DV + ok[:, None] * DV + ov[None, :], ds, mask=kv)
        kd = tl.load(kd_ptr + chunk * C * DK + oc[:, None] * DK + ok[None, :], mask=ck, other=0.0)
        dv = tl.load(dvnew_ptr + chunk * C * DV + oc[:, None] * DV + ov[None, :], mask=cv, other=0.0)
        dv += tl.dot(kd, ds, input_precision=DOT)
        tl.store(du_ptr + chunk * C * DV + oc[:, None] * DV + ov[None, :], dv, mask=cv)
        if PER_CHANNEL:
            decay = tl.load(decay_ptr + chunk * DK + ok, mask=ok < DK, other=0.0)[:, None]
        else:
            decay = tl.load(decay_ptr + chunk)
        w = tl.load(w_ptr + chunk * C * DK + oc[:, None] * DK + ok[None, :], mask=ck, other=0.0)
        dstate = tl.load(dstates_ptr + chunk * DK * DV + ok[:, None] * DV + ov[None, :], mask=kv, other=0.0)
        ds = dstate + ds * decay - tl.dot(tl.trans(w), dv, input_precision=DOT)
        # The state entering a document's first chunk is 0, whatever the chunk before it left.
        first = tl.load(first_ptr + c)
        ds = tl.where(first != 0, 0.0, ds)


def chunk_scan(
    w: torch.Tensor,
    u: torch.Tensor,
    k_decayed: torch.Tensor,
    chunk_decay: torch.Tensor,
    first: torch.Tensor,
    *,
    BV: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(states ``[H, NC, Dk, Dv]``, v_new ``[H, NC, C, Dv]``) fp32 for fp32 w, k_decayed ``[H, NC, C, Dk]``,
    u ``[H, NC, C, Dv]``, chunk_decay ``[H, NC]`` (or ``[H, NC, Dk]``: one per row of the state) and bool first
    ``[NC]`` (see ``scan_chunks``)."""
    h, nc, c, dk = w.shape
    dv = u.shape[-1]
    w, u, k_decayed, chunk_decay = (x.float().contiguous() for x in (w, u, k_decayed, chunk_decay))
    states = w.new_empty(h, nc, dk, dv)
    v_new = w.new_empty(h, nc, c, dv)
    if h * nc == 0:
        return states, v_new
    # tl.dot needs every dimension >= 16.
    bc, bk, bv = max(16, next_power_of_2(c)), max(16, next_power_of_2(dk)), max(16, min(BV, next_power_of_2(dv)))
    first = first.to(torch.int8).contiguous()
    launch(
        _chunk_scan_kernel,
        (h, cdiv(dv, bv)),
        w,
        u,
        k_decayed,
        chunk_decay,
        first,
        states,
        v_new,
        nc,
        c,
        dk,
        dv,
        PER_CHANNEL=chunk_decay.dim() == 3,
        DOT=dot_precision(w.device),
        BC=bc,
        BK=bk,
        BV=bv,
        num_warps=num_warps,
    )
    return states, v_new


def chunk_scan_backward(
    w: torch.Tensor,
    k_decayed: torch.Tensor,
    chunk_decay: torch.Tensor,
    first: torch.Tensor,
    dstates: torch.Tensor,
    dv_new: torch.Tensor,
    *,
    BV: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dS ``[H, NC, Dk, Dv]``: the gradient of the state leaving each chunk, du ``[H, NC, C, Dv]``) fp32, for
    ``chunk_scan``'s inputs w, k_decayed, chunk_decay, first and the gradients of its outputs, dstates and
    dv_new."""
    h, nc, c, dk = w.shape
    dv = dstates.shape[-1]
    w, k_decayed, chunk_decay, dstates, dv_new = (
        x.float().contiguous() for x in (w, k_decayed, chunk_decay, dstates, dv_new)
    )
    ds = w.new_empty(h, nc, dk, dv)
    du = w.new_empty(h, nc, c, dv)
    if h * nc == 0:
        return ds, du
    bc, bk, bv = max(16, next_power_of_2(c)), max(16, next_power_of_2(dk)), max(16, min(BV, next_power_of_2(dv)))
    launch(
        _chunk_scan_backward_kernel,
        (h, cdiv(dv, bv)),
        w,
        k_decayed,
        chunk_decay,
        first.to(torch.int8).contiguous(),
        dstates,
        dv_new,
        ds,
        du,
        nc,
        c,
        dk,
        dv,
        PER_CHANNEL=chunk_decay.dim() == 3,
        DOT=dot_precision(w.device),
        BC=bc,
        BK=bk,
        BV=bv,
        num_warps=num_warps,
    )
    return ds, du


# The intra-chunk kernels run 4 warps: Triton 3.6 builds them with 8 over 16-wide operands into wrong results and
# illegal memory accesses.
_INTRA_WARPS = 4
# The intra-chunk backward takes the head dimension 32 columns at a time, so that its tiles fit in registers.
_INTRA_BACKWARD_COLUMNS = 32


@triton.jit
def _intra_forward_kernel(
    k_ptr,
    v_ptr,
    beta_ptr,
    g_ptr,
    t_ptr,
    w_ptr,
    u_ptr,
    kd_ptr,
    cd_ptr,
    cum_ptr,
    C,
    DK,
    DV,
    DOT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)  # over H * NC
    oc = tl.arange(0, BC)
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BV)
    mc = oc < C
    ck = mc[:, None] & (ok[None, :] < DK)
    cv = mc[:, None] & (ov[None, :] < DV)
    cc = mc[:, None] & (oc[None, :] < C)
    g = tl.load(g_ptr + chunk * C + oc, mask=mc, other=0.0)
    beta = tl.load(beta_ptr + chunk * C + oc, mask=mc, other=0.0)
    cum = tl.cumsum(g, 0)
    k = tl.load(k_ptr + chunk * C * DK + oc[:, None] * DK + ok[None, :], mask=ck, other=0.0)
    kb = k * beta[:, None]
    # L: the strictly lower part of (k_beta k^T) * exp(cum_i - cum_j); the exponent is taken where j < i only
    # (above the diagonal it is >= 0 and may overflow)
    strict = oc[:, None] > oc[None, :]
    decay = tl.exp(tl.where(strict, cum[:, None] - cum[None, :], 0.0))
    lower = tl.where(strict, tl.dot(kb, tl.trans(k), input_precision=DOT) * decay, 0.0)
    # T = (I + L)^-1 in blocks of 16 (BC <= 64: at most four). D, the inverse of L's block diagonal (I + B), by
    # forward substitution in all blocks at once, one row of each per step: T_i = e_i - sum_{j<i} B_ij T_j.
    # Then with N = D (L - B), strictly block lower (N^4 = 0): (I + L)^-1 = (I + N)^-1 D = (I - N)(I + N^2) D.
    eye = (oc[:, None] == oc[None, :]).to(tl.float32)
    same = (oc[:, None] // 16) == (oc[None, :] // 16)
    t = eye
    for i in range(1, 16):
        row = (oc[:, None] % 16) == i
        t = tl.where(row, eye - tl.dot(tl.where(row & same, lower, 0.0), t, input_precision=DOT), t)
    n = tl.dot(t, tl.where(same, 0.0, lower), input_precision=DOT)
    t = tl.dot(tl.dot(eye - n, eye + tl.dot(n, n, input_precision=DOT), input_precision=DOT), t, input_precision=DOT)
    tl.store(t_ptr + chunk * C * C + oc[:, None] * C + oc[None, :], t, mask=cc)
    w = tl.dot(t, kb * tl.exp(cum)[:, None], input_precision=DOT)
    tl.store(w_ptr + chunk * C * DK + oc[:, None] * DK + ok[None, :], w, mask=ck)
    v = tl.load(v_ptr + chunk * C * DV + oc[:, None] * DV + ov[None, :], mask=cv, other=0.0)
    u = tl.dot(t, v * beta[:, None], input_precision=DOT)
    tl.store(u_ptr + chunk * C * DV + oc[:, None] * DV + ov[None, :], u, mask=cv)
    last = tl.sum(tl.where(oc == C - 1, cum, 0.0), 0)
    kd = k * tl.exp(last - cum)[:, None]
    tl.store(kd_ptr + chunk * C * DK + oc[:, None] * DK + ok[None, :], kd, mask=ck)
    tl.store(cd_ptr + chunk, tl.exp(last))
    tl.store(cum_ptr + chunk * C + oc, cum, mask=mc)


def intra_forward(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The intra-chunk part of the chunked gated delta rule (one log decay per head and token), per chunk of at most
    64 tokens, for fp32 k ``[H, NC, C, Dk]``, v ``[H, NC, C, Dv]``, beta and g ``[H, NC, C]``: with ``cum`` the
    cumulative sum of g along the chunk and ``L`` the strictly lower part of ``(k * beta) k^T * exp(cum_i - cum_j)``,
    returns fp32 (T ``[H, NC, C, C]`` = ``(I + L)^-1``, w = ``T ((k * beta) * exp(cum))``, u = ``T (v * beta)``,
    k_decayed = ``k * exp(cum_last - cum)``, chunk_decay ``[H, NC]`` = ``exp(cum_last)``, cum ``[H, NC, C]``)."""
    h, nc, c, dk = k.shape
    dv = v.shape[-1]
    if c > 64:
        raise ValueError(f"k: chunks of at most 64 tokens (its blocked inverse has four blocks of 16), got {c}")
    k, v, beta, g = (x.float().contiguous() for x in (k, v, beta, g))
    t = k.new_empty(h, nc, c, c)
    w = k.new_empty(h, nc, c, dk)
    u = k.new_empty(h, nc, c, dv)
    kd = k.new_empty(h, nc, c, dk)
    cd = k.new_empty(h, nc)
    cum = k.new_empty(h, nc, c)
    if h * nc == 0:
        return t, w, u, kd, cd, cum
    bc, bk, bv = (max(16, next_power_of_2(n)) for n in (c, dk, dv))
    launch(
        _intra_forward_kernel,
        (h * nc,),
        k,
        v,
        beta,
        g,
        t,
        w,
        u,
        kd,
        cd,
        cum,
        c,
        dk,
        dv,
        DOT=dot_precision(k.device),
        BC=bc,
        BK=bk,
        BV=bv,
        num_warps=_INTRA_WARPS,
    )
    return t, w, u, kd, cd, cum


@triton.jit
def _intra_backward_kernel(
    k_ptr,
    v_ptr,
    beta_ptr,
    cum_ptr,
    t_ptr,
    u_ptr,
    w_ptr,
    du_ptr,
    dw_ptr,
    dkd_ptr,
    dcd_ptr,
    dk_in_ptr,
    dcum_ptr,
    dk_ptr,
    dv_ptr,
    dbeta_ptr,
    dg_ptr,
    C,
    DK,
    DV,
    DOT: tl.constexpr,
    BC: tl.constexpr,
    BD: tl.constexpr,
):
    # The [C, D] rows are taken BD columns at a time (three passes), so that only [C, C] and [C, BD] tiles live.
    chunk = tl.program_id(0).to(tl.int64)
    oc = tl.arange(0, BC)
    od = tl.arange(0, BD)
    mc = oc < C
    cc = mc[:, None] & (oc[None, :] < C)
    beta = tl.load(beta_ptr + chunk * C + oc, mask=mc, other=0.0)
    cum = tl.load(cum_ptr + chunk * C + oc, mask=mc, other=0.0)
    last = tl.sum(tl.where(oc == C - 1, cum, 0.0), 0)
    e = tl.exp(cum)
    kd_factor = tl.exp(last - cum)
    tt = tl.trans(tl.load(t_ptr + chunk * C * C + oc[:, None] * C + oc[None, :], mask=cc, other=0.0))
    # u = T (v beta), w = T x: d(v beta) = T^T du, dx = T^T dw, dL = -(d(v beta) u^T + dx w^T), strictly lower
    dl = tl.zeros((BC, BC), dtype=tl.float32)
    dbeta = tl.zeros((BC,), dtype=tl.float32)
    for d0 in range(0, DV, BD):
        cv = mc[:, None] & (d0 + od[None, :] < DV)
        vv = chunk * C * DV + oc[:, None] * DV + d0 + od[None, :]
        dvb = tl.dot(tt, tl.load(du_ptr + vv, mask=cv, other=0.0), input_precision=DOT)
        dl += tl.dot(dvb, tl.trans(tl.load(u_ptr + vv, mask=cv, other=0.0)), input_precision=DOT)
        tl.store(dv_ptr + vv, dvb * beta[:, None], mask=cv)
        dbeta += tl.sum(dvb * tl.load(v_ptr + vv, mask=cv, other=0.0), 1)
    # ... and A = (k beta) k^T, of which L = A * G on the strictly lower part
    a = tl.zeros((BC, BC), dtype=tl.float32)
    for d0 in range(0, DK, BD):
        ck = mc[:, None] & (d0 + od[None, :] < DK)
        kk = chunk * C * DK + oc[:, None] * DK + d0 + od[None, :]
        dx = tl.dot(tt, tl.load(dw_ptr + kk, mask=ck, other=0.0), input_precision=DOT)
        dl += tl.dot(dx, tl.trans(tl.load(w_ptr + kk, mask=ck, other=0.0)), input_precision=DOT)
        k = tl.load(k_ptr + kk, mask=ck, other=0.0)
        a += tl.dot(k * beta[:, None], tl.trans(k), input_precision=DOT)
    strict = oc[:, None] > oc[None, :]
    dlg = tl.where(strict, -dl * tl.exp(tl.where(strict, cum[:, None] - cum[None, :], 0.0)), 0.0)
    dgam = dlg * a
    dcum = tl.load(dcum_ptr + chunk * C + oc, mask=mc, other=0.0) + tl.sum(dgam, 1) - tl.sum(dgam, 0)
    # dk = dlg^T (k beta) + d(k beta) beta + dkd * exp(last - cum) + the share through the rest of the op, with
    # d(k beta) = dlg k + dx exp(cum)
    kdd = tl.zeros((BC,), dtype=tl.float32)
    for d0 in range(0, DK, BD):
        ck = mc[:, None] & (d0 + od[None, :] < DK)
        kk = chunk * C * DK + oc[:, None] * DK + d0 + od[None, :]
        k = tl.load(k_ptr + kk, mask=ck, other=0.0)
        kb = k * beta[:, None]
        dx = tl.dot(tt, tl.load(dw_ptr + kk, mask=ck, other=0.0), input_precision=DOT)
        dkb = tl.dot(dlg, k, input_precision=DOT) + dx * e[:, None]
        dkd = tl.load(dkd_ptr + kk, mask=ck, other=0.0)
        dk = tl.dot(tl.trans(dlg), kb, input_precision=DOT) + dkb * beta[:, None] + dkd * kd_factor[:, None]
        dk += tl.load(dk_in_ptr + kk, mask=ck, other=0.0)
        tl.store(dk_ptr + kk, dk, mask=ck)
        dbeta += tl.sum(dkb * k, 1)
        dcum += tl.sum(dx * kb, 1) * e
        kdd += tl.sum(dkd * k, 1)
    kdd *= kd_factor
    dcum -= kdd
    dcd = tl.load(dcd_ptr + chunk)
    dcum += tl.where(oc == C - 1, tl.sum(kdd, 0) + dcd * tl.exp(last), 0.0)
    tl.store(dbeta_ptr + chunk * C + oc, dbeta, mask=mc)
    # cum = cumsum(g) along the chunk: dg_j = sum_{i >= j} dcum_i, summed as such (a total less a cumulative sum
    # would lose a small suffix to the total's rounding)
    dcum = tl.where(mc, dcum, 0.0)
    tl.store(dg_ptr + chunk * C + oc, tl.cumsum(dcum, 0, reverse=True), mask=mc)


def intra_backward(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    cum: torch.Tensor,
    t: torch.Tensor,
    u: torch.Tensor,
    w: torch.Tensor,
    du: torch.Tensor,
    dw: torch.Tensor,
    dk_decayed: torch.Tensor,
    dchunk_decay: torch.Tensor,
    dk_in: torch.Tensor,
    dcum: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``intra_forward``'s backward: from its inputs k, v, beta, outputs cum, T, u, w and the gradients of u, w,
    k_decayed and chunk_decay, plus the gradients that k (``dk_in``) and cum (``dcum``) already have from the rest of
    the op, returns fp32 (dk, dv, dbeta, dg) of k, v, beta and the log decays g (``cum``'s cumulative sum along
    the chunk taken back); the returned dk includes ``dk_in``."""
    h, nc, c, dk_dim = k.shape
    dv_dim = v.shape[-1]
    f = [x.float().contiguous() for x in (k, v, beta, cum, t, u, w, du, dw, dk_decayed, dchunk_decay, dk_in, dcum)]
    dk = f[0].new_empty(h, nc, c, dk_dim)
    dv = f[1].new_empty(h, nc, c, dv_dim)
    dbeta = f[0].new_empty(h, nc, c)
    dg = f[0].new_empty(h, nc, c)
    if h * nc == 0:
        return dk, dv, dbeta, dg
    bc = max(16, next_power_of_2(c))
    bd = max(16, min(_INTRA_BACKWARD_COLUMNS, next_power_of_2(max(dk_dim, dv_dim))))
    launch(
        _intra_backward_kernel,
        (h * nc,),
        *f,
        dk,
        dv,
        dbeta,
        dg,
        c,
        dk_dim,
        dv_dim,
        DOT=dot_precision(k.device),
        BC=bc,
        BD=bd,
        num_warps=_INTRA_WARPS,
    )
    return dk, dv, dbeta, dg


# ---- the output's products ----------------------------------------------------------------------------------

# The output kernels take the head dimensions this many columns at a time.
_OUTPUT_COLUMNS = 32


@triton.jit
def _pair_decays(cum, oc):
    """``[BC, BC]``: ``exp(cum_i - cum_j)`` for ``j <= i``, 0 above the diagonal."""
    lower = oc[:, None] >= oc[None, :]
    return tl.where(lower, tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)


@triton.jit
def _scores(q_ptr, k_ptr, chunk, oc, mc, C, DK, DOT: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """``[BC, BC]``: the chunk's ``q k^T``, the key dimension BD columns at a time."""
    od = tl.arange(0, BD)
    s = tl.zeros((BC, BC), dtype=tl.float32)
    for d0 in range(0, DK, BD):
        ck = mc[:, None] & (d0 + od[None, :] < DK)
        kk = chunk * C * DK + oc[:, None] * DK + d0 + od[None, :]
        q = tl.load(q_ptr + kk, mask=ck, other=0.0)
        k = tl.load(k_ptr + kk, mask=ck, other=0.0)
        s += tl.dot(q, tl.trans(k), input_precision=DOT)
    return s


@triton.jit
def _output_forward_kernel(
    q_ptr,
    k_ptr,
    cum_ptr,
    states_ptr,
    vnew_ptr,
    o_ptr,
    C,
    DK,
    DV,
    DOT: tl.constexpr,
    BC: tl.constexpr,
    BD: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    v0 = tl.program_id(1) * BD
    oc, od = tl.arange(0, BC), tl.arange(0, BD)
    mc = oc < C
    cum = tl.load(cum_ptr + chunk * C + oc, mask=mc, other=0.0)
    cv = mc[:, None] & (v0 + od[None, :] < DV)
    vv = chunk * C * DV + oc[:, None] * DV + v0 + od[None, :]
    # o = exp(cum) * (q S) + ((q k^T) * G) v_new
    qs = tl.zeros((BC, BD), dtype=tl.float32)
    s = tl.zeros((BC, BC), dtype=tl.float32)
    for d0 in range(0, DK, BD):
        ck = mc[:, None] & (d0 + od[None, :] < DK)
        kk = chunk * C * DK + oc[:, None] * DK + d0 + od[None, :]
        q = tl.load(q_ptr + kk, mask=ck, other=0.0)
        s += tl.dot(q, tl.trans(tl.load(k_ptr + kk, mask=ck, other=0.0)), input_precision=DOT)
        sm = (d0 + od[:, None] < DK) & (v0 + od[None, :] < DV)
        st = tl.load(states_ptr + chunk * DK * DV + (d0 + od[:, None]) * DV + v0 + od[None, :], mask=sm, other=0.0)
        qs += tl.dot(q, st, input_precision=DOT)
    vnew = tl.load(vnew_ptr + vv, mask=cv, other=0.0)
    o = qs * tl.exp(cum)[:, None] + tl.dot(s * _pair_decays(cum, oc), vnew, input_precision=DOT)
    tl.store(o_ptr + vv, o, mask=cv)


def output_forward(
    q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor, states: torch.Tensor, v_new: torch.Tensor
) -> torch.Tensor:
    """The chunked gated delta rule's output, per chunk: fp32 ``o = exp(cum) * (q S) + ((q k^T) * G) v_new``
    ``[H, NC, C, Dv]`` with ``G_ij = exp(cum_i - cum_j)`` for ``j <= i`` (0 above), for fp32 q, k ``[H, NC, C,
    Dk]``, the cumulative log decays cum ``[H, NC, C]``, the entering states S ``[H, NC, Dk, Dv]`` and v_new
    ``[H, NC, C, Dv]``."""
    h, nc, c, dk = q.shape
    dv = v_new.shape[-1]
    q, k, cum, states, v_new = (x.float().contiguous() for x in (q, k, cum, states, v_new))
    o = q.new_empty(h, nc, c, dv)
    if h * nc == 0:
        return o
    bd = max(16, min(_OUTPUT_COLUMNS, next_power_of_2(max(dk, dv))))
    launch(
        _output_forward_kernel,
        (h * nc, cdiv(dv, bd)),
        q,
        k,
        cum,
        states,
        v_new,
        o,
        c,
        dk,
        dv,
        DOT=dot_precision(q.device),
        BC=max(16, next_power_of_2(c)),
        BD=bd,
        num_warps=_INTRA_WARPS,
    )
    return o


@triton.jit
def _output_backward_v_kernel(
    q_ptr,
    k_ptr,
    cum_ptr,
    do_ptr,
    dstates_ptr,
    dvnew_ptr,
    C,
    DK,
    DV,
    DOT: tl.constexpr,
    BC: tl.constexpr,
    BD: tl.constexpr,
):
    # d v_new = ((q k^T) * G)^T do, dS = (q exp(cum))^T do, for one block of value columns
    chunk = tl.program_id(0).to(tl.int64)
    v0 = tl.program_id(1) * BD
    oc, od = tl.arange(0, BC), tl.arange(0, BD)
    mc = oc < C
    cum = tl.load(cum_ptr + chunk * C + oc, mask=mc, other=0.0)
    e = tl.exp(cum)
    cv = mc[:, None] & (v0 + od[None, :] < DV)
    vv = chunk * C * DV + oc[:, None] * DV + v0 + od[None, :]
    do = tl.load(do_ptr + vv, mask=cv, other=0.0)
    p = _scores(q_ptr, k_ptr, chunk, oc, mc, C, DK, DOT, BC, BD) * _pair_decays(cum, oc)
    tl.store(dvnew_ptr + vv, tl.dot(tl.trans(p), do, input_precision=DOT), mask=cv)
    for d0 in range(0, DK, BD):
        ck = mc[:, None] & (d0 + od[None, :] < DK)
        q = tl.load(q_ptr + chunk * C * DK + oc[:, None] * DK + d0 + od[None, :], mask=ck, other=0.0)
        ds = tl.dot(tl.trans(q * e[:, None]), do, input_precision=DOT)
        sm = (d0 + od[:, None] < DK) & (v0 + od[None, :] < DV)
        tl.store(dstates_ptr + chunk * DK * DV + (d0 + od[:, None]) * DV + v0 + od[None, :], ds, mask=sm)


@triton.jit
def _output_backward_qk_kernel(
    q_ptr,
    k_ptr,
    cum_ptr,
    states_ptr,
    vnew_ptr,
    do_ptr,
    dq_ptr,
    dk_ptr,
    dcum_ptr,
    C,
    DK,
    DV,
    DOT: tl.constexpr,
    BC: tl.constexpr,
    BD: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    oc, od = tl.arange(0, BC), tl.arange(0, BD)
    mc = oc < C
    cum = tl.load(cum_ptr + chunk * C + oc, mask=mc, other=0.0)
    e = tl.exp(cum)
    g = _pair_decays(cum, oc)
    # dp = do v_new^T (over the value columns), p = (q k^T) * G
    dp = tl.zeros((BC, BC), dtype=tl.float32)
    for v0 in range(0, DV, BD):
        cv = mc[:, None] & (v0 + od[None, :] < DV)
        vv = chunk * C * DV + oc[:, None] * DV + v0 + od[None, :]
        dp += tl.dot(
            tl.load(do_ptr + vv, mask=cv, other=0.0),
            tl.trans(tl.load(vnew_ptr + vv, mask=cv, other=0.0)),
            input_precision=DOT,
        )
    p = _scores(q_ptr, k_ptr, chunk, oc, mc, C, DK, DOT, BC, BD) * g
    dpg = dp * g
    dgam = dp * p
    dcum = tl.sum(dgam, 1) - tl.sum(dgam, 0)
    # dq = dpg k + exp(cum) * (do S^T); dk = dpg^T q; cum's share through exp(cum) * (q S)
    for d0 in range(0, DK, BD):
        ck = mc[:, None] & (d0 + od[None, :] < DK)
        kk = chunk * C * DK + oc[:, None] * DK + d0 + od[None, :]
        dqs = tl.zeros((BC, BD), dtype=tl.float32)
        for v0 in range(0, DV, BD):
            cv = mc[:, None] & (v0 + od[None, :] < DV)
            do = tl.load(do_ptr + chunk * C * DV + oc[:, None] * DV + v0 + od[None, :], mask=cv, other=0.0)
            sm = (d0 + od[:, None] < DK) & (v0 + od[None, :] < DV)
            st = tl.load(states_ptr + chunk * DK * DV + (d0 + od[:, None]) * DV + v0 + od[None, :], mask=sm, other=0.0)
            dqs += tl.dot(do, tl.trans(st), input_precision=DOT)
        q = tl.load(q_ptr + kk, mask=ck, other=0.0)
        k = tl.load(k_ptr + kk, mask=ck, other=0.0)
        tl.store(dq_ptr + kk, tl.dot(dpg, k, input_precision=DOT) + dqs * e[:, None], mask=ck)
        tl.store(dk_ptr + kk, tl.dot(tl.trans(dpg), q, input_precision=DOT), mask=ck)
        dcum += tl.sum(dqs * q, 1) * e
    tl.store(dcum_ptr + chunk * C + oc, dcum, mask=mc)


def output_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    cum: torch.Tensor,
    states: torch.Tensor,
    v_new: torch.Tensor,
    d_out: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """``output_forward``'s backward: fp32 (dq, dk, dcum, dstates, dv_new) of its inputs from the output's
    gradient ``d_out``."""
    h, nc, c, dk = q.shape
    dv = v_new.shape[-1]
    q, k, cum, states, v_new, d_out = (x.float().contiguous() for x in (q, k, cum, states, v_new, d_out))
    dq, dkey = q.new_empty(q.shape), q.new_empty(q.shape)
    dcum, dstates, dv_new = q.new_empty(cum.shape), q.new_empty(states.shape), q.new_empty(v_new.shape)
    if h * nc == 0:
        return dq, dkey, dcum, dstates, dv_new
    meta = dict(
        DOT=dot_precision(q.device),
        BC=max(16, next_power_of_2(c)),
        BD=max(16, min(_OUTPUT_COLUMNS, next_power_of_2(max(dk, dv)))),
        num_warps=_INTRA_WARPS,
    )
    launch(
        _output_backward_v_kernel,
        (h * nc, cdiv(dv, meta["BD"])),
        q,
        k,
        cum,
        d_out,
        dstates,
        dv_new,
        c,
        dk,
        dv,
        **meta,
    )
    launch(_output_backward_qk_kernel, (h * nc,), q, k, cum, states, v_new, d_out, dq, dkey, dcum, c, dk, dv, **meta)
    return dq, dkey, dcum, dstates, dv_new


# ---- the tokens into the chunk layout's slots and back ------------------------------------------------------

# Rows (tokens or slots) of one head per program: about 4096 elements in the widest [rows, D] tile.
_TILE = 4096
# transformers' and flash-linear-attention's l2norm eps (``fastft.reference.delta_rule.l2norm``)
L2NORM_EPS = 1e-6


def _rows(width_block: int) -> int:
    return max(16, min(64, _TILE // width_block))


@triton.jit
def _pack_forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    index_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    gs_ptr,
    betas_ptr,
    N,
    S,
    H,
    DK,
    DV,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    scale,
    eps,
    NORM: tl.constexpr,
    BS: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """A block of one head's slots: each slot's token's q (l2-normalised with NORM, times scale), k (normalised
    with NORM), v, g and beta in fp32, 0 where the slot is empty."""
    i_s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    os = i_s * BS + tl.arange(0, BS)
    ms = os < S
    tok = tl.load(index_ptr + os, mask=ms, other=N)
    full = tok < N
    ok, ov = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = full[:, None] & (ok < DK)[None, :], full[:, None] & (ov < DV)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + ok[None, :], mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + tok[:, None] * stride_kt + h * stride_kh + ok[None, :], mask=mk, other=0.0).to(tl.float32)
    if NORM:
        q *= tl.math.rsqrt(tl.sum(q * q, 1) + eps)[:, None]
        k *= tl.math.rsqrt(tl.sum(k * k, 1) + eps)[:, None]
    sk = (h * S + os)[:, None] * DK + ok[None, :]
    stored = ms[:, None] & (ok < DK)[None, :]
    tl.store(query_ptr + sk, q * scale, mask=stored)
    tl.store(key_ptr + sk, k, mask=stored)
    v = tl.load(v_ptr + tok[:, None] * stride_vt + h * stride_vh + ov[None, :], mask=mv, other=0.0).to(tl.float32)
    tl.store(value_ptr + (h * S + os)[:, None] * DV + ov[None, :], v, mask=ms[:, None] & (ov < DV)[None, :])
    th = tok * H + h
    tl.store(gs_ptr + h * S + os, tl.load(g_ptr + th, mask=full, other=0.0).to(tl.float32), mask=ms)
    tl.store(betas_ptr + h * S + os, tl.load(beta_ptr + th, mask=full, other=0.0).to(tl.float32), mask=ms)


@triton.jit
def _pack_backward_kernel(
    q_ptr,
    k_ptr,
    slot_ptr,
    dquery_ptr,
    dkey_ptr,
    dvalue_ptr,
    dgs_ptr,
    dbetas_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    dg_ptr,
    dbeta_ptr,
    N,
    S,
    H,
    DK,
    DV,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    scale,
    eps,
    NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """A block of one head's tokens: the gradients of q, k (through the l2norm with NORM: for ``y = x r``,
    ``r = 1 / sqrt(sum x^2 + eps)``, ``dx = r (dy - y sum(dy y))``), v, g and beta from their slots', each in its
    input's dtype ([N, H, D] and [N, H] contiguous)."""
    i_t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ot = i_t * BT + tl.arange(0, BT)
    mt = ot < N
    slot = tl.load(slot_ptr + ot, mask=mt, other=0)
    ok, ov = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = mt[:, None] & (ok < DK)[None, :], mt[:, None] & (ov < DV)[None, :]
    sk = (h * S + slot)[:, None] * DK + ok[None, :]
    dq = tl.load(dquery_ptr + sk, mask=mk, other=0.0) * scale
    dk = tl.load(dkey_ptr + sk, mask=mk, other=0.0)
    if NORM:
        q = tl.load(q_ptr + ot[:, None] * stride_qt + h * stride_qh + ok[None, :], mask=mk, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(q * q, 1) + eps)[:, None]
        q *= r
        dq = r * (dq - q * tl.sum(dq * q, 1)[:, None])
        k = tl.load(k_ptr + ot[:, None] * stride_kt + h * stride_kh + ok[None, :], mask=mk, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(k * k, 1) + eps)[:, None]
        k *= r
        dk = r * (dk - k * tl.sum(dk * k, 1)[:, None])
    tk = (ot[:, None] * H + h) * DK + ok[None, :]
    tl.store(dq_ptr + tk, dq.to(dq_ptr.dtype.element_ty), mask=mk)
    tl.store(dk_ptr + tk, dk.to(dk_ptr.dtype.element_ty), mask=mk)
    dv = tl.load(dvalue_ptr + (h * S + slot)[:, None] * DV + ov[None, :], mask=mv, other=0.0)
    tl.store(dv_ptr + (ot[:, None] * H + h) * DV + ov[None, :], dv.to(dv_ptr.dtype.element_ty), mask=mv)
    dg = tl.load(dgs_ptr + h * S + slot, mask=mt, other=0.0)
    tl.store(dg_ptr + ot * H + h, dg.to(dg_ptr.dtype.element_ty), mask=mt)
    dbeta = tl.load(dbetas_ptr + h * S + slot, mask=mt, other=0.0)
    tl.store(dbeta_ptr + ot * H + h, dbeta.to(dbeta_ptr.dtype.element_ty), mask=mt)


@triton.jit
def _unpack_forward_kernel(o_ptr, slot_ptr, out_ptr, N, S, H, DV, BT: tl.constexpr, BV: tl.constexpr):
    """A block of one head's tokens: each token's slot's output, in out's dtype ([N, H, DV] contiguous)."""
    i_t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ot, ov = i_t * BT + tl.arange(0, BT), tl.arange(0, BV)
    mt = ot < N
    m = mt[:, None] & (ov < DV)[None, :]
    slot = tl.load(slot_ptr + ot, mask=mt, other=0)
    o = tl.load(o_ptr + (h * S + slot)[:, None] * DV + ov[None, :], mask=m, other=0.0)
    tl.store(out_ptr + (ot[:, None] * H + h) * DV + ov[None, :], o.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _unpack_backward_kernel(
    dout_ptr, index_ptr, do_ptr, N, S, H, DV, stride_t, stride_h, BS: tl.constexpr, BV: tl.constexpr
):
    """A block of one head's slots: each slot's token's output gradient in fp32, 0 where the slot is empty."""
    i_s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    os, ov = i_s * BS + tl.arange(0, BS), tl.arange(0, BV)
    ms = os < S
    tok = tl.load(index_ptr + os, mask=ms, other=N)
    mv = (ov < DV)[None, :]
    d = tl.load(
        dout_ptr + tok[:, None] * stride_t + h * stride_h + ov[None, :], mask=(tok < N)[:, None] & mv, other=0.0
    )
    tl.store(do_ptr + (h * S + os)[:, None] * DV + ov[None, :], d.to(tl.float32), mask=ms[:, None] & mv)


def _check_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must be [N, H, Dk] alike, got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [N, H, Dv] with q's N, H = {tuple(q.shape[:2])}, got {tuple(v.shape)}")


def pack_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    token_index: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens into the chunk layout's slots (``fastft.delta_rule.ChunkTable``): for q, k ``[N, H, Dk]``, v
    ``[N, H, Dv]``, g and beta ``[N, H]`` (any floating dtypes, read as they are) and ``token_index`` ``[NC, C]``
    (each slot's token, N where empty), fp32 (query ``[H, NC, C, Dk]`` = ``l2norm(q) * scale``, key =
    ``l2norm(k)`` (q and k as they are without ``use_qk_l2norm``), value ``[H, NC, C, Dv]``, g and beta ``[H,
    NC, C]``) of each slot's token, 0 in the empty slots."""
    _check_tokens(q, k, v)
    n, h, dk = q.shape
    dv = v.shape[-1]
    if g.shape != (n, h) or beta.shape != (n, h):
        raise ValueError(f"g and beta must be [N, H] = {(n, h)}, got {tuple(g.shape)} and {tuple(beta.shape)}")
    if token_index.dim() != 2:
        raise ValueError(f"token_index must be [NC, C], got shape {tuple(token_index.shape)}")
    nc, cs = token_index.shape
    q, k, v = (unit_inner(x) for x in (q, k, v))
    f32 = torch.float32
    query, key = (q.new_empty(h, nc, cs, dk, dtype=f32) for _ in range(2))
    value = q.new_empty(h, nc, cs, dv, dtype=f32)
    gs, betas = (q.new_empty(h, nc, cs, dtype=f32) for _ in range(2))
    if h * nc * cs == 0:
        return query, key, value, gs, betas
    bk, bv = next_power_of_2(dk), next_power_of_2(dv)
    bs = _rows(max(bk, bv))
    launch(
        _pack_forward_kernel,
        (cdiv(nc * cs, bs), h),
        q,
        k,
        v,
        g.contiguous(),
        beta.contiguous(),
        token_index.contiguous(),
        query,
        key,
        value,
        gs,
        betas,
        n,
        nc * cs,
        h,
        dk,
        dv,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        float(scale),
        L2NORM_EPS,
        NORM=bool(use_qk_l2norm),
        BS=bs,
        BK=bk,
        BV=bv,
        num_warps=4,
    )
    return query, key, value, gs, betas


def pack_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    slot: torch.Tensor,
    dquery: torch.Tensor,
    dkey: torch.Tensor,
    dvalue: torch.Tensor,
    dg: torch.Tensor,
    dbeta: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype, torch.dtype, torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_forward``'s backward, with ``slot`` ``[N]`` (each token's slot, chunk * C + j): from the slots'
    gradients (dquery, dkey ``[H, NC, C, Dk]``, dvalue ``[H, NC, C, Dv]``, dg, dbeta ``[H, NC, C]``) and q, k as
    ``pack_forward`` read them, the gradients of q, k, v ``[N, H, D]`` and g, beta ``[N, H]``, contiguous, in
    ``dtypes`` (those of q, k, v, g, beta)."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must be [N, H, Dk] alike, got {tuple(q.shape)} and {tuple(k.shape)}")
    n, h, dk = q.shape
    if dquery.dim() != 4 or dquery.shape[0] != h or dquery.shape[3] != dk or dkey.shape != dquery.shape:
        raise ValueError(f"dquery and dkey must be [H, NC, C, Dk] with q's H, Dk, got {tuple(dquery.shape)}")
    hh, nc, cs = dquery.shape[:3]
    if dvalue.dim() != 4 or dvalue.shape[:3] != (hh, nc, cs):
        raise ValueError(f"dvalue must be [H, NC, C, Dv] = {(hh, nc, cs)} + (Dv,), got {tuple(dvalue.shape)}")
    if dg.shape != (hh, nc, cs) or dbeta.shape != (hh, nc, cs):
        raise ValueError(f"dg and dbeta must be [H, NC, C] = {(hh, nc, cs)}, got {tuple(dg.shape)}")
    if slot.shape != (n,):
        raise ValueError(f"slot must be [N] = {(n,)}, got {tuple(slot.shape)}")
    dv_width = dvalue.shape[-1]
    out = tuple(
        q.new_empty(shape, dtype=dtype)
        for shape, dtype in zip(((n, h, dk),) * 2 + ((n, h, dv_width),) + ((n, h),) * 2, dtypes)
    )
    if n * h == 0:
        return out
    q, k = unit_inner(q), unit_inner(k)
    bk, bv = next_power_of_2(dk), next_power_of_2(dv_width)
    bt = _rows(max(bk, bv))
    launch(
        _pack_backward_kernel,
        (cdiv(n, bt), h),
        q,
        k,
        slot.contiguous(),
        *(x.float().contiguous() for x in (dquery, dkey, dvalue, dg, dbeta)),
        *out,
        n,
        nc * cs,
        h,
        dk,
        dv_width,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        float(scale),
        L2NORM_EPS,
        NORM=bool(use_qk_l2norm),
        BT=bt,
        BK=bk,
        BV=bv,
        num_warps=4,
    )
    return out


def unpack_forward(o: torch.Tensor, slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The slots back to the tokens: for o ``[H, NC, C, Dv]`` (fp32) and ``slot`` ``[N]`` (each token's slot),
    out ``[N, H, Dv]`` in ``dtype``, ``out[t, h] = o[h].view(-1, Dv)[slot[t]]``."""
    if o.dim() != 4:
        raise ValueError(f"o must be [H, NC, C, Dv], got shape {tuple(o.shape)}")
    if slot.dim() != 1:
        raise ValueError(f"slot must be [N], got shape {tuple(slot.shape)}")
    h, nc, cs, dv = o.shape
    n = slot.shape[0]
    out = o.new_empty(n, h, dv, dtype=dtype)
    if n * h == 0:
        return out
    bv = next_power_of_2(dv)
    bt = _rows(bv)
    launch(
        _unpack_forward_kernel,
        (cdiv(n, bt), h),
        o.float().contiguous(),
        slot.contiguous(),
        out,
        n,
        nc * cs,
        h,
        dv,
        BT=bt,
        BV=bv,
        num_warps=4,
    )
    return out


def unpack_backward(dout: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """``unpack_forward``'s backward: for dout ``[N, H, Dv]`` and ``token_index`` ``[NC, C]`` (each slot's
    token, N where empty), the slots' gradient ``[H, NC, C, Dv]`` fp32, 0 in the empty slots."""
    if dout.dim() != 3:
        raise ValueError(f"dout must be [N, H, Dv], got shape {tuple(dout.shape)}")
    if token_index.dim() != 2:
        raise ValueError(f"token_index must be [NC, C], got shape {tuple(token_index.shape)}")
    n, h, dv = dout.shape
    nc, cs = token_index.shape
    d = dout.new_empty(h, nc, cs, dv, dtype=torch.float32)
    if h * nc * cs == 0:
        return d
    dout = unit_inner(dout)
    bv = next_power_of_2(dv)
    bs = _rows(bv)
    launch(
        _unpack_backward_kernel,
        (cdiv(nc * cs, bs), h),
        dout,
        token_index.contiguous(),
        d,
        n,
        nc * cs,
        h,
        dv,
        dout.stride(0),
        dout.stride(1),
        BS=bs,
        BV=bv,
        num_warps=4,
    )
    return d
