"""Triton kernels for fastft.selective_scan: Mamba-1's scan, run chunk-parallel on a layout whose chunks never
span two documents.

The recurrence ``h_t = a_t * h_{t-1} + b_t`` (``a_t = exp(delta_t A)``, ``b_t = delta_t u_t B_t``, elementwise
over the ``[Dm, N]`` state) is linear, so the scan splits at chunk boundaries:

1. ``chunk_ends``: each chunk from a zero entering state: the state it leaves (``local``) and its total decay
   ``exp(A * sum(delta))`` (one program per chunk and block of ``BD`` channels, a loop over the chunk's tokens);
2. the state entering each chunk, carried over chunks and zeroed where a chunk starts a document
   (``kernels/ssd.py``'s ``state_scan``, with a decay per element);
3. ``chunk_outputs``: each chunk again from its entering state: ``y_t = h_t C_t``.

The backward mirrors it: ``chunk_start_grads`` runs each chunk in reverse from a zero gradient and gives the
gradient of its entering state through its own outputs; ``state_scan_backward`` carries those back over the
chunks, giving the gradient of the state each chunk leaves (``dT``); ``chunk_grads`` runs each chunk in reverse
from ``dT`` with the recurrence's gradients, ``g_t = dy_t C_t + a_{t+1} g_{t+1}``:

    du_t     = delta_t * sum_n(g_t B_t)
    ddelta_t = sum_n(g_t (u_t B_t + A a_t h_{t-1}))
    dB_t     = sum_d(g_t delta_t u_t)           (per block of channels; summed on the host side)
    dC_t     = sum_d(dy_t h_t)                  (the same)
    dA       = sum_t(g_t delta_t a_t h_{t-1})   (per chunk; summed on the host side)

It needs ``h_{t-1}`` in reverse order: each program first reruns its chunk forward, writing the states into its
own slice of a scratch buffer (``PROGRAMS`` programs loop over the (chunk, block) pairs, so the scratch is
``PROGRAMS x chunk x BD x N`` whatever the sequence length). fp32 throughout. Each loop over a chunk's tokens
loads ``STAGES - 1`` tokens ahead (Triton's software pipelining): a step's loads do not depend on the step before.

Around them, the glue between the op's inputs and these kernels' fp32 ``[tokens, Dm]`` layout, one pass each
over tiles of tokens x channels: ``tokens_forward`` (u and ``softplus(delta + bias)`` from ``[B, Dm, T]`` in
any dtype and strides), ``output_forward`` (``(y + D u) * silu(z)`` in u's dtype) and their backwards
``output_backward`` (the scan output's gradient, z's, D's) and ``tokens_backward`` (u's with D's share and
delta's through softplus and the bias, written back as ``[B, Dm, T]``). Sums over tokens (dD, dbias) are
per-tile partials added afterwards, with no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x log2 e); exp2 is one instruction


@triton.jit
def _chunk_ends_kernel(
    u_ptr,
    delta_ptr,
    A_ptr,
    B_ptr,
    start_ptr,
    length_ptr,
    local_ptr,
    decay_ptr,
    DM,
    N,
    BD: tl.constexpr,
    BN: tl.constexpr,
    STAGES: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    od = tl.program_id(1) * BD + tl.arange(0, BD)
    on = tl.arange(0, BN)
    md, mn = od < DM, on < N
    mask = md[:, None] & mn[None, :]
    A = tl.load(A_ptr + od[:, None] * N + on[None, :], mask=mask, other=0.0) * LOG2E
    start = tl.load(start_ptr + c).to(tl.int64)
    length = tl.load(length_ptr + c)
    h = tl.zeros([BD, BN], dtype=tl.float32)
    total = tl.zeros([BD], dtype=tl.float32)
    for j in tl.range(length, num_stages=STAGES):
        t = start + j
        dt = tl.load(delta_ptr + t * DM + od, mask=md, other=0.0)
        x = tl.load(u_ptr + t * DM + od, mask=md, other=0.0)
        b = tl.load(B_ptr + t * N + on, mask=mn, other=0.0)
        h = tl.exp2(dt[:, None] * A) * h + (dt * x)[:, None] * b[None, :]
        total += dt
    offs = (c * DM + od[:, None]) * N + on[None, :]
    tl.store(local_ptr + offs, h, mask=mask)
    tl.store(decay_ptr + offs, tl.exp2(A * total[:, None]), mask=mask)


@triton.jit
def _chunk_outputs_kernel(
    u_ptr,
    delta_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    start_ptr,
    length_ptr,
    states_ptr,
    y_ptr,
    DM,
    N,
    BD: tl.constexpr,
    BN: tl.constexpr,
    STAGES: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    od = tl.program_id(1) * BD + tl.arange(0, BD)
    on = tl.arange(0, BN)
    md, mn = od < DM, on < N
    mask = md[:, None] & mn[None, :]
    A = tl.load(A_ptr + od[:, None] * N + on[None, :], mask=mask, other=0.0) * LOG2E
    start = tl.load(start_ptr + c).to(tl.int64)
    length = tl.load(length_ptr + c)
    h = tl.load(states_ptr + (c * DM + od[:, None]) * N + on[None, :], mask=mask, other=0.0)
    for j in tl.range(length, num_stages=STAGES):
        t = start + j
        dt = tl.load(delta_ptr + t * DM + od, mask=md, other=0.0)
        x = tl.load(u_ptr + t * DM + od, mask=md, other=0.0)
        b = tl.load(B_ptr + t * N + on, mask=mn, other=0.0)
        cv = tl.load(C_ptr + t * N + on, mask=mn, other=0.0)
        h = tl.exp2(dt[:, None] * A) * h + (dt * x)[:, None] * b[None, :]
        tl.store(y_ptr + t * DM + od, tl.sum(h * cv[None, :], 1), mask=md)


@triton.jit
def _chunk_start_grads_kernel(
    delta_ptr,
    A_ptr,
    C_ptr,
    dy_ptr,
    start_ptr,
    length_ptr,
    dstates_ptr,
    DM,
    N,
    BD: tl.constexpr,
    BN: tl.constexpr,
    STAGES: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    od = tl.program_id(1) * BD + tl.arange(0, BD)
    on = tl.arange(0, BN)
    md, mn = od < DM, on < N
    mask = md[:, None] & mn[None, :]
    A = tl.load(A_ptr + od[:, None] * N + on[None, :], mask=mask, other=0.0) * LOG2E
    start = tl.load(start_ptr + c).to(tl.int64)
    length = tl.load(length_ptr + c)
    carry = tl.zeros([BD, BN], dtype=tl.float32)  # the gradient of h_t from the chunk's later tokens
    for r in tl.range(length, num_stages=STAGES):
        t = start + length - 1 - r
        dt = tl.load(delta_ptr + t * DM + od, mask=md, other=0.0)
        dy = tl.load(dy_ptr + t * DM + od, mask=md, other=0.0)
        cv = tl.load(C_ptr + t * N + on, mask=mn, other=0.0)
        carry = tl.exp2(dt[:, None] * A) * (carry + dy[:, None] * cv[None, :])
    tl.store(dstates_ptr + (c * DM + od[:, None]) * N + on[None, :], carry, mask=mask)


@triton.jit
def _chunk_grads_kernel(
    u_ptr,
    delta_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    dy_ptr,
    start_ptr,
    length_ptr,
    states_ptr,
    dT_ptr,
    scratch_ptr,
    du_ptr,
    ddelta_ptr,
    dB_ptr,
    dC_ptr,
    dA_ptr,
    NCB,
    DM,
    N,
    NT,
    CS,
    NPROG,
    BD: tl.constexpr,
    BN: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks = tl.cdiv(DM, BD)
    on = tl.arange(0, BN)
    ob = tl.arange(0, BD)
    mn = on < N
    # this program's slice of the scratch: the state before each token of the chunk
    scratch = scratch_ptr + pid.to(tl.int64) * CS * BD * BN + ob[:, None] * BN + on[None, :]
    for item in range(pid, NCB * blocks, NPROG):
        c = (item // blocks).to(tl.int64)
        i_b = item % blocks
        od = i_b * BD + ob
        md = od < DM
        mask = md[:, None] & mn[None, :]
        A = tl.load(A_ptr + od[:, None] * N + on[None, :], mask=mask, other=0.0) * LOG2E
        start = tl.load(start_ptr + c).to(tl.int64)
        length = tl.load(length_ptr + c)
        offs = (c * DM + od[:, None]) * N + on[None, :]
        h = tl.load(states_ptr + offs, mask=mask, other=0.0)
        for j in tl.range(length, num_stages=STAGES):
            tl.store(scratch + j * BD * BN, h)
            t = start + j
            dt = tl.load(delta_ptr + t * DM + od, mask=md, other=0.0)
            x = tl.load(u_ptr + t * DM + od, mask=md, other=0.0)
            b = tl.load(B_ptr + t * N + on, mask=mn, other=0.0)
            h = tl.exp2(dt[:, None] * A) * h + (dt * x)[:, None] * b[None, :]
        tl.debug_barrier()
        # masked channels and states hold zeros throughout (A, h, the carry and their loads), so they add nothing
        carry = tl.load(dT_ptr + offs, mask=mask, other=0.0)  # the gradient of the state the chunk leaves
        dA = tl.zeros([BD, BN], dtype=tl.float32)
        for r in tl.range(length, num_stages=STAGES):
            j = length - 1 - r
            t = start + j
            dt = tl.load(delta_ptr + t * DM + od, mask=md, other=0.0)
            x = tl.load(u_ptr + t * DM + od, mask=md, other=0.0)
            dy = tl.load(dy_ptr + t * DM + od, mask=md, other=0.0)
            b = tl.load(B_ptr + t * N + on, mask=mn, other=0.0)
            cv = tl.load(C_ptr + t * N + on, mask=mn, other=0.0)
            h_prev = tl.load(scratch + j * BD * BN)
            a = tl.exp2(dt[:, None] * A)
            ah = a * h_prev  # h_t = ah + dt x B_t
            g = carry + dy[:, None] * cv[None, :]  # the gradient of h_t
            gah = g * ah
            gb = tl.sum(g * b[None, :], 1)
            dx = dt * x
            tl.store(du_ptr + t * DM + od, dt * gb, mask=md)
            tl.store(ddelta_ptr + t * DM + od, x * gb + tl.sum(gah * A, 1) / LOG2E, mask=md)
            tl.store(dB_ptr + (i_b * NT + t) * N + on, tl.sum(g * dx[:, None], 0), mask=mn)
            dc = tl.sum(dy[:, None] * ah, 0) + tl.sum(dy * dx, 0) * b
            tl.store(dC_ptr + (i_b * NT + t) * N + on, dc, mask=mn)
            dA += gah * dt[:, None]
            carry = a * g
        tl.store(dA_ptr + offs, dA, mask=mask)
        tl.debug_barrier()  # the next item's forward rewrites the scratch


def _blocks(dm: int, n: int, BD: int) -> tuple[int, int]:
    return max(2, min(BD, next_power_of_2(dm))), max(2, next_power_of_2(n))


def chunk_ends(u, delta, A, B, start, length, *, BD: int = 64, num_warps: int = 4, STAGES: int = 1):
    """(local, decay) fp32 ``[NC, Dm, N]``: the state each chunk leaves from a zero entering state, and
    ``exp(A * sum(delta))`` over its tokens. u, delta ``[T, Dm]``, A ``[Dm, N]``, B ``[T, N]`` fp32
    contiguous; start, length int32 ``[NC]`` (the chunks' first token and token count)."""
    nc, dm, n = start.shape[0], u.shape[1], A.shape[1]
    local = u.new_empty(nc, dm, n)
    decay = u.new_empty(nc, dm, n)
    if nc * dm * n == 0:
        return local, decay
    bd, bn = _blocks(dm, n, BD)
    args = (u, delta, A, B, start, length, local, decay, dm, n)
    launch(_chunk_ends_kernel, (nc, cdiv(dm, bd)), *args, BD=bd, BN=bn, STAGES=STAGES, num_warps=num_warps)
    return local, decay


def chunk_outputs(u, delta, A, B, C, start, length, states, *, BD: int = 64, num_warps: int = 4, STAGES: int = 1):
    """y ``[T, Dm]`` fp32: each chunk run from its entering state (``states`` ``[NC, Dm, N]``), ``h_t C_t``."""
    nc, (t, dm), n = start.shape[0], u.shape, A.shape[1]
    y = u.new_empty(t, dm)  # every token lies in one chunk of the table: each is written
    if nc * dm * n == 0:
        return y
    bd, bn = _blocks(dm, n, BD)
    args = (u, delta, A, B, C, start, length, states, y, dm, n)
    launch(_chunk_outputs_kernel, (nc, cdiv(dm, bd)), *args, BD=bd, BN=bn, STAGES=STAGES, num_warps=num_warps)
    return y


def chunk_start_grads(delta, A, C, dy, start, length, *, BD: int = 64, num_warps: int = 4, STAGES: int = 1):
    """``[NC, Dm, N]`` fp32: the gradient of each chunk's entering state through its own outputs."""
    nc, dm, n = start.shape[0], delta.shape[1], A.shape[1]
    dstates = delta.new_empty(nc, dm, n)
    if nc * dm * n == 0:
        return dstates
    bd, bn = _blocks(dm, n, BD)
    args = (delta, A, C, dy, start, length, dstates, dm, n)
    launch(_chunk_start_grads_kernel, (nc, cdiv(dm, bd)), *args, BD=bd, BN=bn, STAGES=STAGES, num_warps=num_warps)
    return dstates


def chunk_grads(
    u,
    delta,
    A,
    B,
    C,
    dy,
    start,
    length,
    states,
    dT,
    chunk_size,
    *,
    BD: int = 64,
    num_warps: int = 4,
    STAGES: int = 1,
    PROGRAMS: int = 512,
):
    """(du, ddelta ``[T, Dm]``, dB, dC ``[T, N]``, dA ``[Dm, N]``) fp32, given each chunk's entering state and
    the gradient of the state it leaves (``dT``), both ``[NC, Dm, N]``."""
    nc, (t, dm), n = start.shape[0], u.shape, A.shape[1]
    du, ddelta = u.new_empty(t, dm), u.new_empty(t, dm)
    if nc * dm * n == 0:
        return du, ddelta, u.new_zeros(t, n), u.new_zeros(t, n), u.new_zeros(dm, n)
    bd, bn = _blocks(dm, n, BD)
    blocks = cdiv(dm, bd)
    programs = max(1, min(PROGRAMS, nc * blocks))
    scratch = u.new_empty(programs, chunk_size, bd, bn)
    dB, dC = u.new_empty(blocks, t, n), u.new_empty(blocks, t, n)
    dA = u.new_empty(nc, dm, n)
    args = (u, delta, A, B, C, dy, start, length, states, dT, scratch, du, ddelta, dB, dC, dA, nc, dm, n, t, chunk_size)
    args = (*args, programs)
    launch(_chunk_grads_kernel, (programs,), *args, BD=bd, BN=bn, STAGES=STAGES, num_warps=num_warps)
    return du, ddelta, dB.sum(0), dC.sum(0), dA.sum(0)


# ---- the glue: [B, K, T] inputs in their dtypes <-> the scan's fp32 [tokens, Dm] -----------------------------
# Tiles of _BT tokens x _BC channels; flat token k of a [B, K, T] tensor sits at row k // T, column k % T.

_BT, _BC = 64, 64


@triton.jit
def _softplus(raw):
    """(torch's softplus, its derivative) in fp32: ``log1p(exp(raw))``, and raw itself above 20."""
    e = tl.exp(-tl.abs(raw))
    one_e = 1.0 + e
    log1p = tl.where(one_e == 1.0, e, tl.log(one_e) * (e / (one_e - 1.0)))  # log1p(e), exact to a few ulps
    big = raw > 20.0
    value = tl.where(big, raw, tl.maximum(raw, 0.0) + log1p)
    slope = tl.where(big, 1.0, tl.where(raw >= 0, 1.0 / one_e, e / one_e))
    return value, slope


@triton.jit
def _glue_tile(NT, DM, T, BT: tl.constexpr, BC: tl.constexpr):
    """(flat tokens, channels, mask, ``[B, K, T]`` contiguous offsets) of this program's tile."""
    k = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    od = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (k < NT)[:, None] & (od < DM)[None, :]
    return k, od, mask, (k // T)[:, None] * DM * T + od[None, :] * T + (k % T)[:, None]


@triton.jit
def _strided(ptr, k, od, mask, T, s0, s1, s2):
    return tl.load(ptr + (k // T)[:, None] * s0 + od[None, :] * s1 + (k % T)[:, None] * s2, mask=mask, other=0.0)


@triton.jit
def _tokens_forward_kernel(
    u_ptr, delta_ptr, bias_ptr, x_ptr, step_ptr, NT, DM, T, su0, su1, su2, sd0, sd1, sd2,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    k, od, mask, _ = _glue_tile(NT, DM, T, BT, BC)
    raw = _strided(delta_ptr, k, od, mask, T, sd0, sd1, sd2).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(bias_ptr + od, mask=od < DM, other=0.0).to(tl.float32)[None, :]
    if SOFTPLUS:
        raw, _ = _softplus(raw)
    offs = k[:, None] * DM + od[None, :]
    tl.store(x_ptr + offs, _strided(u_ptr, k, od, mask, T, su0, su1, su2).to(tl.float32), mask=mask)
    tl.store(step_ptr + offs, raw, mask=mask)


@triton.jit
def _output_forward_kernel(
    y_ptr, x_ptr, D_ptr, z_ptr, out_ptr, NT, DM, T, sz0, sz1, sz2,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    k, od, mask, _ = _glue_tile(NT, DM, T, BT, BC)
    offs = k[:, None] * DM + od[None, :]
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    if HAS_D:
        y += tl.load(D_ptr + od, mask=od < DM, other=0.0).to(tl.float32)[None, :] * tl.load(x_ptr + offs, mask=mask)
    if HAS_Z:
        z = _strided(z_ptr, k, od, mask, T, sz0, sz1, sz2).to(tl.float32)
        y *= z / (1.0 + tl.exp(-z))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _output_backward_kernel(
    dout_ptr, y_ptr, x_ptr, D_ptr, z_ptr, dys_ptr, dz_ptr, dD_ptr, NT, DM, T, so0, so1, sz0, sz1, sz2,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    k, od, mask, grad_offs = _glue_tile(NT, DM, T, BT, BC)
    offs = k[:, None] * DM + od[None, :]
    dout = tl.load(dout_ptr + k[:, None] * so0 + od[None, :] * so1, mask=mask, other=0.0).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + od, mask=od < DM, other=0.0).to(tl.float32)[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_Z:
        z = _strided(z_ptr, k, od, mask, T, sz0, sz1, sz2).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-z))
        pre = tl.load(y_ptr + offs, mask=mask, other=0.0)
        if HAS_D:
            pre += D * x
        dz = dout * pre * sig * (1.0 + z * (1.0 - sig))
        tl.store(dz_ptr + grad_offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        dout *= z * sig
    tl.store(dys_ptr + offs, dout, mask=mask)
    if HAS_D:
        tl.store(dD_ptr + tl.program_id(0) * DM + od, tl.sum(dout * x, 0), mask=od < DM)


@triton.jit
def _tokens_backward_kernel(
    du_ptr, ddelta_ptr, dys_ptr, D_ptr, delta_ptr, bias_ptr, du_out_ptr, ddelta_out_ptr, dbias_ptr,
    NT, DM, T, sd0, sd1, sd2,
    HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    k, od, mask, grad_offs = _glue_tile(NT, DM, T, BT, BC)
    offs = k[:, None] * DM + od[None, :]
    du = tl.load(du_ptr + offs, mask=mask, other=0.0)
    if HAS_D:
        D = tl.load(D_ptr + od, mask=od < DM, other=0.0).to(tl.float32)[None, :]
        du += D * tl.load(dys_ptr + offs, mask=mask, other=0.0)
    tl.store(du_out_ptr + grad_offs, du.to(du_out_ptr.dtype.element_ty), mask=mask)
    ddelta = tl.load(ddelta_ptr + offs, mask=mask, other=0.0)
    if SOFTPLUS:
        raw = _strided(delta_ptr, k, od, mask, T, sd0, sd1, sd2).to(tl.float32)
        if HAS_BIAS:
            raw += tl.load(bias_ptr + od, mask=od < DM, other=0.0).to(tl.float32)[None, :]
        _, slope = _softplus(raw)
        ddelta *= slope
    tl.store(ddelta_out_ptr + grad_offs, ddelta.to(ddelta_out_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(dbias_ptr + tl.program_id(0) * DM + od, tl.sum(ddelta, 0), mask=od < DM)


def _glue_grid(nt: int, dm: int) -> tuple[int, int]:
    return cdiv(nt, _BT), cdiv(dm, _BC)


def _check_inputs(u, delta=None, z=None):
    if u.dim() != 3:
        raise ValueError(f"u must be [B, Dm, T], got shape {tuple(u.shape)}")
    for name, v in (("delta", delta), ("z", z)):
        if v is not None and v.shape != u.shape:
            raise ValueError(f"{name} must be u's shape {tuple(u.shape)}, got {tuple(v.shape)}")


def _vector(name, v, dm):
    """v ``[Dm]`` contiguous (the kernels step through it one element at a time), or None."""
    if v is not None and v.shape != (dm,):
        raise ValueError(f"{name} must be [Dm] = {(dm,)}, got {tuple(v.shape)}")
    return None if v is None else v.contiguous()


def _check_flat(name, v, nt, dm):
    if v.shape != (nt, dm):
        raise ValueError(f"{name} must be [B * T, Dm] = {(nt, dm)}, got {tuple(v.shape)}")


def tokens_forward(u, delta, bias=None, softplus=False):
    """(x, step) fp32 ``[B * T, Dm]`` contiguous: u and ``softplus(delta + bias)`` (softplus when asked) token by
    token, for u, delta ``[B, Dm, T]`` in any float dtype and strides, bias ``[Dm]`` or None."""
    _check_inputs(u, delta)
    b, dm, t = u.shape
    bias = _vector("bias", bias, dm)
    x = torch.empty(b * t, dm, dtype=torch.float32, device=u.device)
    step = torch.empty_like(x)
    if x.numel() == 0:
        return x, step
    args = (u, delta, u if bias is None else bias, x, step, b * t, dm, t, *u.stride(), *delta.stride())
    launch(_tokens_forward_kernel, _glue_grid(b * t, dm), *args, HAS_BIAS=bias is not None, SOFTPLUS=bool(softplus),
           BT=_BT, BC=_BC, num_warps=4)  # fmt: skip
    return x, step


def output_forward(y, x, D=None, z=None, *, dtype):
    """The op's output ``[B * T, Dm]`` in ``dtype``: ``(y + D x) * silu(z)`` in fp32, for the scan's y and x fp32
    ``[B * T, Dm]`` contiguous, D ``[Dm]`` or None, z ``[B, Dm, T]`` (any strides) or None."""
    nt, dm = x.shape
    _check_flat("y", y, nt, dm)
    D = _vector("D", D, dm)
    if z is not None:
        _check_inputs(z)
        if z.shape[0] * z.shape[2] != nt or z.shape[1] != dm:
            raise ValueError(f"z must be [B, Dm, T] with B * T = {nt} and Dm = {dm}, got {tuple(z.shape)}")
    out = torch.empty(nt, dm, dtype=dtype, device=x.device)
    if out.numel() == 0:
        return out
    t = z.shape[2] if z is not None else 1
    args = (y, x, x if D is None else D, x if z is None else z, out, nt, dm, t, *_strides3(z))
    launch(_output_forward_kernel, _glue_grid(nt, dm), *args, HAS_D=D is not None, HAS_Z=z is not None, BT=_BT,
           BC=_BC, num_warps=4)  # fmt: skip
    return out


def output_backward(dout, y, x, D, z, t):
    """(dys fp32 ``[B * T, Dm]``: the gradient of the scan's y; dz ``[B, Dm, T]`` in z's dtype; dD fp32 ``[Dm]``)
    of ``output_forward`` for its output's gradient dout ``[B * T, Dm]`` (any strides) and its inputs (y: the
    scan's output, read only with z); T the tokens per row. Without D or z their gradients are empty."""
    nt, dm = x.shape
    _check_flat("dout", dout, nt, dm)
    D = _vector("D", D, dm)
    if z is not None:
        if y is None:
            raise ValueError("y must be given with z (z's gradient reads the output before the gate)")
        _check_flat("y", y, nt, dm)
    dys = torch.empty(nt, dm, dtype=torch.float32, device=x.device)
    dz = torch.empty(z.shape, dtype=z.dtype, device=x.device) if z is not None else x.new_empty(0)
    grid = _glue_grid(nt, dm)
    dD = torch.empty(grid[0], dm, dtype=torch.float32, device=x.device) if D is not None else x.new_empty(0)
    if nt * dm == 0:
        return dys, dz, dD.sum(0) if D is not None else dD
    args = (dout, x if y is None else y, x, x if D is None else D, x if z is None else z, dys)
    args = (*args, dz if z is not None else x, dD if D is not None else x, nt, dm, t, *dout.stride(), *_strides3(z))
    launch(_output_backward_kernel, grid, *args, HAS_D=D is not None, HAS_Z=z is not None, BT=_BT, BC=_BC,
           num_warps=8)  # fmt: skip
    return dys, dz, dD.sum(0) if D is not None else dD


def tokens_backward(du, ddelta, dys, D, delta, bias=None, softplus=False, *, u_dtype):
    """(du in ``u_dtype``, ddelta in delta's dtype, both ``[B, Dm, T]`` contiguous; dbias fp32 ``[Dm]`` or empty)
    of ``tokens_forward`` and D's skip, for the scan's gradients du, ddelta fp32 ``[B * T, Dm]`` contiguous, dys
    (the scan output's gradient, read with D) and delta, bias, softplus as given to ``tokens_forward``."""
    _check_inputs(delta)
    b, dm, t = delta.shape
    _check_flat("du", du, b * t, dm)
    _check_flat("ddelta", ddelta, b * t, dm)
    D = _vector("D", D, dm)
    bias = _vector("bias", bias, dm)
    du_out = torch.empty(b, dm, t, dtype=u_dtype, device=du.device)
    ddelta_out = torch.empty(b, dm, t, dtype=delta.dtype, device=du.device)
    grid = _glue_grid(b * t, dm)
    dbias = torch.empty(grid[0], dm, dtype=torch.float32, device=du.device) if bias is not None else du.new_empty(0)
    if du.numel() == 0:
        return du_out, ddelta_out, dbias.sum(0) if bias is not None else dbias
    args = (du, ddelta, du if D is None else dys, du if D is None else D, delta, du if bias is None else bias)
    args = (*args, du_out, ddelta_out, dbias if bias is not None else du, b * t, dm, t, *delta.stride())
    launch(_tokens_backward_kernel, grid, *args, HAS_D=D is not None, HAS_BIAS=bias is not None,
           SOFTPLUS=bool(softplus), BT=_BT, BC=_BC, num_warps=4)  # fmt: skip
    return du_out, ddelta_out, dbias.sum(0) if bias is not None else dbias


def _strides3(v):
    return (0, 0, 0) if v is None else tuple(v.stride())
