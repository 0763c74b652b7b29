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
``PROGRAMS x chunk x BD x N`` whatever the sequence length). fp32 throughout.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2


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
):
    c = tl.program_id(0).to(tl.int64)
    od = tl.program_id(1) * BD + tl.arange(0, BD)
    on = tl.arange(0, BN)
    md, mn = od < DM, on < N
    mask = md[:, None] & mn[None, :]
    A = tl.load(A_ptr + od[:, None] * N + on[None, :], mask=mask, other=0.0)
    start = tl.load(start_ptr + c).to(tl.int64)
    length = tl.load(length_ptr + c)
    h = tl.zeros([BD, BN], dtype=tl.float32)
    total = tl.zeros([BD], dtype=tl.float32)
    for j in range(length):
        t = start + j
        dt = tl.load(delta_ptr + t * DM + od, mask=md, other=0.0)
        x = tl.load(u_ptr + t * DM + od, mask=md, other=0.0)
        b = tl.load(B_ptr + t * N + on, mask=mn, other=0.0)
        h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * b[None, :]
        total += dt
    offs = (c * DM + od[:, None]) * N + on[None, :]
    tl.store(local_ptr + offs, h, mask=mask)
    tl.store(decay_ptr + offs, tl.exp(A * total[:, None]), mask=mask)


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
):
    c = tl.program_id(0).to(tl.int64)
    od = tl.program_id(1) * BD + tl.arange(0, BD)
    on = tl.arange(0, BN)
    md, mn = od < DM, on < N
    mask = md[:, None] & mn[None, :]
    A = tl.load(A_ptr + od[:, None] * N + on[None, :], mask=mask, other=0.0)
    start = tl.load(start_ptr + c).to(tl.int64)
    length = tl.load(length_ptr + c)
    h = tl.load(states_ptr + (c * DM + od[:, None]) * N + on[None, :], mask=mask, other=0.0)
    for j in range(length):
        t = start + j
        dt = tl.load(delta_ptr + t * DM + od, mask=md, other=0.0)
        x = tl.load(u_ptr + t * DM + od, mask=md, other=0.0)
        b = tl.load(B_ptr + t * N + on, mask=mn, other=0.0)
        cv = tl.load(C_ptr + t * N + on, mask=mn, other=0.0)
        h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * b[None, :]
        tl.store(y_ptr + t * DM + od, tl.sum(h * cv[None, :], 1), mask=md)


@triton.jit
def _chunk_start_grads_kernel(
    delta_ptr, A_ptr, C_ptr, dy_ptr, start_ptr, length_ptr, dstates_ptr, DM, N, BD: tl.constexpr, BN: tl.constexpr
):
    c = tl.program_id(0).to(tl.int64)
    od = tl.program_id(1) * BD + tl.arange(0, BD)
    on = tl.arange(0, BN)
    md, mn = od < DM, on < N
    mask = md[:, None] & mn[None, :]
    A = tl.load(A_ptr + od[:, None] * N + on[None, :], mask=mask, other=0.0)
    start = tl.load(start_ptr + c).to(tl.int64)
    length = tl.load(length_ptr + c)
    carry = tl.zeros([BD, BN], dtype=tl.float32)  # the gradient of h_t from the chunk's later tokens
    for r in range(length):
        t = start + length - 1 - r
        dt = tl.load(delta_ptr + t * DM + od, mask=md, other=0.0)
        dy = tl.load(dy_ptr + t * DM + od, mask=md, other=0.0)
        cv = tl.load(C_ptr + t * N + on, mask=mn, other=0.0)
        carry = tl.exp(dt[:, None] * A) * (carry + dy[:, None] * cv[None, :])
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
        A = tl.load(A_ptr + od[:, None] * N + on[None, :], mask=mask, other=0.0)
        start = tl.load(start_ptr + c).to(tl.int64)
        length = tl.load(length_ptr + c)
        offs = (c * DM + od[:, None]) * N + on[None, :]
        h = tl.load(states_ptr + offs, mask=mask, other=0.0)
        for j in range(length):
            tl.store(scratch + j * BD * BN, h)
            t = start + j
            dt = tl.load(delta_ptr + t * DM + od, mask=md, other=0.0)
            x = tl.load(u_ptr + t * DM + od, mask=md, other=0.0)
            b = tl.load(B_ptr + t * N + on, mask=mn, other=0.0)
            h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * b[None, :]
        tl.debug_barrier()
        carry = tl.load(dT_ptr + offs, mask=mask, other=0.0)  # the gradient of the state the chunk leaves
        dA = tl.zeros([BD, BN], dtype=tl.float32)
        for r in range(length):
            j = length - 1 - r
            t = start + j
            dt = tl.load(delta_ptr + t * DM + od, mask=md, other=0.0)
            x = tl.load(u_ptr + t * DM + od, mask=md, other=0.0)
            dy = tl.load(dy_ptr + t * DM + od, mask=md, other=0.0)
            b = tl.load(B_ptr + t * N + on, mask=mn, other=0.0)
            cv = tl.load(C_ptr + t * N + on, mask=mn, other=0.0)
            h_prev = tl.load(scratch + j * BD * BN)
            a = tl.exp(dt[:, None] * A)
            h = a * h_prev + (dt * x)[:, None] * b[None, :]
            g = carry + dy[:, None] * cv[None, :]  # the gradient of h_t
            gb = tl.sum(g * b[None, :], 1)
            decay_term = tl.where(mask, A * a * h_prev, 0.0)
            tl.store(du_ptr + t * DM + od, dt * gb, mask=md)
            tl.store(ddelta_ptr + t * DM + od, x * gb + tl.sum(g * decay_term, 1), mask=md)
            tl.store(dB_ptr + (i_b * NT + t) * N + on, tl.sum(g * (dt * x)[:, None], 0), mask=mn)
            tl.store(dC_ptr + (i_b * NT + t) * N + on, tl.sum(dy[:, None] * h, 0), mask=mn)
            dA += g * dt[:, None] * a * h_prev
            carry = a * g
        tl.store(dA_ptr + offs, dA, mask=mask)
        tl.debug_barrier()  # the next item's forward rewrites the scratch


def _blocks(dm: int, n: int, BD: int) -> tuple[int, int]:
    return max(2, min(BD, next_power_of_2(dm))), max(2, next_power_of_2(n))


def chunk_ends(u, delta, A, B, start, length, *, BD: int = 64, num_warps: int = 4):
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
    launch(_chunk_ends_kernel, (nc, cdiv(dm, bd)), *args, BD=bd, BN=bn, num_warps=num_warps)
    return local, decay


def chunk_outputs(u, delta, A, B, C, start, length, states, *, BD: int = 64, num_warps: int = 4):
    """y ``[T, Dm]`` fp32: each chunk run from its entering state (``states`` ``[NC, Dm, N]``), ``h_t C_t``."""
    nc, (t, dm), n = start.shape[0], u.shape, A.shape[1]
    y = u.new_zeros(t, dm)
    if nc * dm * n == 0:
        return y
    bd, bn = _blocks(dm, n, BD)
    args = (u, delta, A, B, C, start, length, states, y, dm, n)
    launch(_chunk_outputs_kernel, (nc, cdiv(dm, bd)), *args, BD=bd, BN=bn, num_warps=num_warps)
    return y


def chunk_start_grads(delta, A, C, dy, start, length, *, BD: int = 64, num_warps: int = 4):
    """``[NC, Dm, N]`` fp32: the gradient of each chunk's entering state through its own outputs."""
    nc, dm, n = start.shape[0], delta.shape[1], A.shape[1]
    dstates = delta.new_zeros(nc, dm, n)
    if nc * dm * n == 0:
        return dstates
    bd, bn = _blocks(dm, n, BD)
    args = (delta, A, C, dy, start, length, dstates, dm, n)
    launch(_chunk_start_grads_kernel, (nc, cdiv(dm, bd)), *args, BD=bd, BN=bn, num_warps=num_warps)
    return dstates


def chunk_grads(
    u, delta, A, B, C, dy, start, length, states, dT, chunk_size, *, BD: int = 64, num_warps: int = 4, PROGRAMS=512
):
    """(du, ddelta ``[T, Dm]``, dB, dC ``[T, N]``, dA ``[Dm, N]``) fp32, given each chunk's entering state and
    the gradient of the state it leaves (``dT``), both ``[NC, Dm, N]``."""
    nc, (t, dm), n = start.shape[0], u.shape, A.shape[1]
    du, ddelta = u.new_zeros(t, dm), u.new_zeros(t, dm)
    if nc * dm * n == 0:
        return du, ddelta, u.new_zeros(t, n), u.new_zeros(t, n), u.new_zeros(dm, n)
    bd, bn = _blocks(dm, n, BD)
    blocks = cdiv(dm, bd)
    programs = max(1, min(PROGRAMS, nc * blocks))
    scratch = u.new_empty(programs, chunk_size, bd, bn)
    dB, dC = u.new_zeros(blocks, t, n), u.new_zeros(blocks, t, n)
    dA = u.new_empty(nc, dm, n)
    args = (u, delta, A, B, C, dy, start, length, states, dT, scratch, du, ddelta, dB, dC, dA, nc, dm, n, t, chunk_size)
    args = (*args, programs)
    launch(_chunk_grads_kernel, (programs,), *args, BD=bd, BN=bn, num_warps=num_warps)
    return du, ddelta, dB.sum(0), dC.sum(0), dA.sum(0)
