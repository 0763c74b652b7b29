"""Triton kernels for the sequential part of fastft.ssd's chunked scan: the state carried from chunk to chunk.

``state_scan(local, decay, first, ...)`` computes what ``fastft.ssd.scan_states`` computes (its
specification): for each head, chunk after chunk, the state entering the chunk (zeroed where ``first``) and the
state leaving it, ``state * decay + local``, where ``local`` is the state the chunk leaves from a zero entering
state. Every element of the state evolves alone (the decay is a scalar per head and chunk, or one per element),
so one program owns a block of ``BLOCK`` elements of one head's state for the whole scan.

``state_scan_backward`` runs the chunks in reverse, carrying ``dT``, the gradient of the state leaving a chunk
(0 after the last chunk, and 0 leaving a chunk whose next one starts a document): for chunk i, with ``S`` its
entering state,

    dlocal  = dT
    ddecay  = S * dT                   (summed over the block for a per-chunk decay)
    dT_prev = dstates + decay * dT     (0 where chunk i starts a document)

fp32 throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch


@triton.jit
def _state_scan_kernel(
    local_ptr, decay_ptr, first_ptr, states_ptr, NC, E, PER_ELEMENT: tl.constexpr, BLOCK: tl.constexpr
):
    i_h = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    state = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(NC):
        chunk = i_h * NC + c
        first = tl.load(first_ptr + c)
        state = tl.where(first != 0, 0.0, state)
        tl.store(states_ptr + chunk * E + offs, state, mask=mask)
        local = tl.load(local_ptr + chunk * E + offs, mask=mask, other=0.0)
        if PER_ELEMENT:
            decay = tl.load(decay_ptr + chunk * E + offs, mask=mask, other=0.0)
        else:
            decay = tl.load(decay_ptr + chunk)
        state = state * decay + local


@triton.jit
def _state_scan_backward_kernel(
    decay_ptr,
    first_ptr,
    states_ptr,
    dstates_ptr,
    dlocal_ptr,
    ddecay_ptr,
    H,
    NC,
    E,
    PER_ELEMENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_h = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    offs = i_b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    dT = tl.zeros([BLOCK], dtype=tl.float32)  # the gradient of the state leaving the chunk
    for r in range(NC):
        c = NC - 1 - r
        chunk = i_h * NC + c
        tl.store(dlocal_ptr + chunk * E + offs, dT, mask=mask)
        state = tl.load(states_ptr + chunk * E + offs, mask=mask, other=0.0)
        if PER_ELEMENT:
            decay = tl.load(decay_ptr + chunk * E + offs, mask=mask, other=0.0)
            tl.store(ddecay_ptr + chunk * E + offs, state * dT, mask=mask)
        else:
            decay = tl.load(decay_ptr + chunk)
            tl.store(ddecay_ptr + i_b * H * NC + chunk, tl.sum(state * dT))
        dstate = tl.load(dstates_ptr + chunk * E + offs, mask=mask, other=0.0)
        dT = dstate + decay * dT
        # The state entering a document's first chunk is 0, whatever the chunk before it left.
        first = tl.load(first_ptr + c)
        dT = tl.where(first != 0, 0.0, dT)


def state_scan(
    local: torch.Tensor, decay: torch.Tensor, first: torch.Tensor, *, BLOCK: int = 1024, num_warps: int = 4
) -> torch.Tensor:
    """states ``[H, NC, E]`` fp32: the state entering each chunk, for fp32 local ``[H, NC, E]``, decay
    ``[H, NC]`` (one per chunk) or ``[H, NC, E]`` (one per element) and bool first ``[NC]``."""
    h, nc, e = local.shape
    local, decay = local.float().contiguous(), decay.float().contiguous()
    states = local.new_empty(h, nc, e)
    if h * nc * e == 0:
        return states
    launch(
        _state_scan_kernel,
        (h, cdiv(e, BLOCK)),
        local,
        decay,
        first.to(torch.int8).contiguous(),
        states,
        nc,
        e,
        PER_ELEMENT=decay.dim() == 3,
        BLOCK=BLOCK,
        num_warps=num_warps,
    )
    return states


def state_scan_backward(
    decay: torch.Tensor,
    first: torch.Tensor,
    states: torch.Tensor,
    dstates: torch.Tensor,
    *,
    BLOCK: int = 1024,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dlocal ``[H, NC, E]``, ddecay of decay's shape) fp32 for ``state_scan``'s decay and first, its output
    states and their gradient dstates."""
    h, nc, e = states.shape
    decay, states, dstates = (x.float().contiguous() for x in (decay, states, dstates))
    dlocal = states.new_empty(h, nc, e)
    if h * nc * e == 0:
        return dlocal, decay.new_zeros(decay.shape)
    blocks = cdiv(e, BLOCK)
    per_element = decay.dim() == 3
    ddecay = states.new_empty(h, nc, e) if per_element else states.new_empty(blocks, h, nc)
    launch(
        _state_scan_backward_kernel,
        (h, blocks),
        decay,
        first.to(torch.int8).contiguous(),
        states,
        dstates,
        dlocal,
        ddecay,
        h,
        nc,
        e,
        PER_ELEMENT=per_element,
        BLOCK=BLOCK,
        num_warps=num_warps,
    )
    return dlocal, ddecay if per_element else ddecay.sum(0)
