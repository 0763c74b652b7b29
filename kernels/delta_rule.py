"""Triton kernels for the sequential part of fastft.delta_rule's chunked gated delta rule: the scan over chunks.

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
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2


@functools.cache
def _dot_precision(device: torch.device) -> str:
    """``tl.dot``'s fp32 precision on ``device``: 3xTF32 where tensor cores take TF32 (CUDA, sm80 on), IEEE fp32
    elsewhere (Triton's interpreter, older GPUs, ROCm)."""
    if device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 0):
        return "tf32x3"
    return "ieee"


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
        DOT=_dot_precision(w.device),
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
        DOT=_dot_precision(w.device),
        BC=bc,
        BK=bk,
        BV=bv,
        num_warps=num_warps,
    )
    return ds, du
