"""Triton kernels for fastft.ssd's chunked scan: the state carried from chunk to chunk (its sequential part) and
the intra-chunk part.

``state_scan(local, decay, first, ...)`` computes what ``fastft.ssd.scan_states`` computes (its
specification): for each head, chunk after chunk, the state entering the chunk (zeroed where ``first``) and the
state leaving it, ``state * decay + local``, where ``local`` is the state the chunk leaves from a zero entering
state. Every element of the state evolves alone (the decay is a scalar per head and chunk, or one per element),
so one program owns a block of ``BLOCK`` elements of one head's state for the whole scan, its loads issued
``stages - 1`` chunks ahead (software pipelining).

``state_scan_backward`` runs the chunks in reverse, carrying ``dT``, the gradient of the state leaving a chunk
(0 after the last chunk, and 0 leaving a chunk whose next one starts a document): for chunk i, with ``S`` its
entering state,

    dlocal  = dT
    ddecay  = S * dT                   (summed over the block for a per-chunk decay)
    dT_prev = dstates + decay * dT     (0 where chunk i starts a document)

``intra_forward`` / ``intra_backward`` compute, for every chunk (of at most 64 tokens) at once, the chunk's
output from within itself (``C B^T`` masked by the decays, times ``x * dt``), the state it leaves from a zero
entering state and its decay, and their backward. A program owns a group's chunk and some of its heads (``C B^T``
computed once for them) or a block of the state's columns (B's and C's gradients, summed over the group's heads),
and walks the state's columns in blocks. The decays over ranges of tokens are summed as such (a masked
cumulative sum over the chunk), not as differences of cumulative sums.

``output_forward`` / ``output_backward`` add the output's share from each chunk's entering state, ``exp(cum) *
(C states^T)`` with ``cum`` the cumulative log decay over the chunk (summed in the kernels), and take its
backward: ``dstates = (dy * exp(cum))^T C`` a program per head's chunk; C's gradient ``(dy * exp(cum)) states``
summed over the group's heads, and cum's, a program per group's chunk, slice of its heads and block of the
state's columns (partial sums over slices and blocks added after, no atomics).

``pack_forward`` / ``unpack_forward`` move the tokens into the chunk layout's slots and back (the layout of
``fastft.delta_rule.ChunkTable``: ``token_index`` gives each slot's token, ``slot`` each token's slot): x in its
own dtype times the step (discretized there from dt: bias, softplus, clamp), and ``step * A``, into the slots, 0
in the empty ones (``bc_pack_forward``: B and C, a program per group); the output back to the tokens
with the skip ``D x`` and the gate ``silu(z)`` applied, in x's dtype; and their backwards. ``pack_forward`` and
``unpack_backward`` walk the slots (the empty ones get their zeros there), ``pack_backward`` and
``unpack_forward`` the tokens; a program owns a block of rows of one head, its share of the sums over tokens
(dA, dD) added after (no atomics).

fp32 math throughout; the intra-chunk products on tensor cores in 3xTF32 where the GPU has them (sm80 on).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._launch import cdiv, dot_precision, launch, next_power_of_2, unit_inner


@triton.jit
def _state_scan_kernel(
    local_ptr,
    decay_ptr,
    first_ptr,
    states_ptr,
    NC,
    E,
    PER_ELEMENT: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_h = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    state = tl.zeros([BLOCK], dtype=tl.float32)
    for c in tl.range(NC, num_stages=STAGES):
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
    STAGES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_h = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    offs = i_b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    dT = tl.zeros([BLOCK], dtype=tl.float32)  # the gradient of the state leaving the chunk
    for r in tl.range(NC, num_stages=STAGES):
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
    local: torch.Tensor,
    decay: torch.Tensor,
    first: torch.Tensor,
    *,
    BLOCK: int = 1024,
    num_warps: int = 4,
    stages: int = 1,
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
        STAGES=stages,
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
    stages: int = 1,
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
        STAGES=stages,
        BLOCK=BLOCK,
        num_warps=num_warps,
    )
    return dlocal, ddecay if per_element else ddecay.sum(0)


# ---- the intra-chunk part -----------------------------------------------------------------------------------

# Programs own a group and a chunk (and a slice of the group's heads, or a block of the state's columns) and walk
# the state's N columns in blocks of _COLUMNS, so that no tile wider than [C, max(C, P, _COLUMNS)] lives in
# registers (3xTF32 products hold each operand twice).
_COLUMNS = 32


# The intra-chunk and output kernels run 4 warps: on sm90 at Mamba-2's widths 4 ran them faster than 8, spills
# included (docs/benchmarks.md, ssd and selective_scan), and Triton 3.6 builds 8 over 16-wide operands into wrong
# results (seen in kernels/delta_rule.py's intra-chunk kernels).
_WARPS = 4
LOG2E = tl.constexpr(1.4426950408889634)


def _default_head_slices(device: torch.device, programs: int, heads_per_group: int) -> int:
    """How many slices a group's heads are cut into: enough programs for about four per SM on a GPU."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(heads_per_group, cdiv(4 * sms, max(programs, 1))))


@triton.jit
def _segments(a, oc):
    """``[BC, BC]``: ``S[i, j] = a_{j+1} + ... + a_i`` for ``j <= i`` (summed as such, not as a difference of
    cumulative sums), 0 above the diagonal."""
    return tl.cumsum(tl.where(oc[:, None] > oc[None, :], a[:, None], 0.0), 0)


@triton.jit
def _to_end(a, oc, C):
    """``[BC]``: ``a_{j+1} + ... + a_last`` (0 past the chunk)."""
    return tl.sum(tl.where((oc[None, :] > oc[:, None]) & (oc[None, :] < C), a[None, :], 0.0), 1)


@triton.jit
def _exclusive_combine(s1, x1, s2, x2):
    return s1 + x1 + s2, x2


@triton.jit
def _sum_before(v, axis: tl.constexpr):
    """``v_0 + ... + v_{k-1}`` at k along ``axis`` (0 at k = 0), summed as such: a cumulative sum less ``v_k``
    would lose a small sum beside a large ``v_k`` to ``v_k``'s rounding. A scan of (the sum before the last
    element, the last element)."""
    before, _ = tl.associative_scan((tl.zeros_like(v), v), axis, _exclusive_combine)
    return before


@triton.jit
def _tf32_high(v):
    """v cut to TF32 (its sign, exponent and top 10 mantissa bits): ``v - _tf32_high(v)`` is exact in fp32."""
    return (v.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _dot_exact(a, b, acc, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr, DOT: tl.constexpr):
    """``acc + a b``. An operand exact in TF32 (B and C copied from 16-bit inputs: ``EXACT_BC``) needs no split:
    both exact, one TF32 product; one exact, two (the other's high part and its rest), where 3xTF32 takes three."""
    if A_EXACT and B_EXACT:
        return tl.dot(a, b, acc, input_precision="tf32")
    if A_EXACT:
        high = _tf32_high(b)
        return tl.dot(a, high, tl.dot(a, b - high, acc, input_precision="tf32"), input_precision="tf32")
    if B_EXACT:
        high = _tf32_high(a)
        return tl.dot(high, b, tl.dot(a - high, b, acc, input_precision="tf32"), input_precision="tf32")
    return tl.dot(a, b, acc, input_precision=DOT)


@triton.jit
def _c_bt(b_ptr, c_ptr, rows, oc, mc, N, DOT: tl.constexpr, EXACT_BC: tl.constexpr, BC: tl.constexpr, BN: tl.constexpr):
    """``C B^T`` ``[BC, BC]`` of one group's chunk (rows at ``rows``), the state's columns ``BN`` at a time."""
    cb = tl.zeros((BC, BC), dtype=tl.float32)
    for n0 in range(0, N, BN):
        on = n0 + tl.arange(0, BN)
        m = mc[:, None] & (on[None, :] < N)
        bb = tl.load(b_ptr + rows + oc[:, None] * N + on[None, :], mask=m, other=0.0)
        cc = tl.load(c_ptr + rows + oc[:, None] * N + on[None, :], mask=m, other=0.0)
        cb = _dot_exact(cc, tl.trans(bb), cb, EXACT_BC, EXACT_BC, DOT)
    return cb


@triton.jit
def _intra_forward_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    y_ptr,
    local_ptr,
    decay_ptr,
    NC,
    C,
    P,
    N,
    HG,
    HS,
    DOT: tl.constexpr,
    EXACT_BC: tl.constexpr,
    BC: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # over G * NC * slices
    slices = (HG + HS - 1) // HS
    group_chunk, part = pid // slices, pid % slices
    group, chunk = group_chunk // NC, group_chunk % NC
    oc, op = tl.arange(0, BC), tl.arange(0, BP)
    mc = oc < C
    cp = mc[:, None] & (op[None, :] < P)
    rows = group_chunk * C * N
    cb = _c_bt(b_ptr, c_ptr, rows, oc, mc, N, DOT, EXACT_BC, BC, BN)
    for hh in range(part * HS, tl.minimum(part * HS + HS, HG)):
        hc = (group * HG + hh) * NC + chunk  # this head's chunk
        a = tl.load(a_ptr + hc * C + oc, mask=mc, other=0.0)
        a2 = a * LOG2E  # exp(v) as exp2(v log2 e): one instruction
        x = tl.load(x_ptr + hc * C * P + oc[:, None] * P + op[None, :], mask=cp, other=0.0)
        scores = tl.where(oc[:, None] >= oc[None, :], cb * tl.exp2(_segments(a2, oc)), 0.0)
        tl.store(y_ptr + hc * C * P + oc[:, None] * P + op[None, :], tl.dot(scores, x, input_precision=DOT), mask=cp)
        xe = tl.trans(x * tl.exp2(_to_end(a2, oc, C))[:, None])  # [BP, BC]
        for n0 in range(0, N, BN):
            on = n0 + tl.arange(0, BN)
            bb = tl.load(b_ptr + rows + oc[:, None] * N + on[None, :], mask=mc[:, None] & (on[None, :] < N), other=0.0)
            local = _dot_exact(xe, bb, None, False, EXACT_BC, DOT)  # [BP, BN]
            tl.store(
                local_ptr + hc * P * N + op[:, None] * N + on[None, :],
                local,
                mask=(op[:, None] < P) & (on[None, :] < N),
            )
        tl.store(decay_ptr + hc, tl.exp(tl.sum(a, 0)))


def _exact_bc(device: torch.device, bc_exact: bool) -> bool:
    """Whether the kernels take B and C as exact in TF32: asked, and the products are 3xTF32 (or fp32 in Triton's
    interpreter, where the shortened products run too)."""
    return bool(bc_exact) and (device.type == "cpu" or dot_precision(device) == "tf32x3")


def _check_intra(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    h, nc, cs, _ = x.shape
    if a.shape != (h, nc, cs) or b.dim() != 4 or c.shape != b.shape or b.shape[1:3] != (nc, cs) or h % b.shape[0]:
        raise ValueError(
            f"expected x [H, NC, C, P], a [H, NC, C], b and c [G, NC, C, N] with G dividing H, got x "
            f"{tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)}"
        )


def intra_forward(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    head_slices: int | None = None,
    bc_exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The intra-chunk part of the chunked SSD scan, per head and chunk (heads grouped as ``[G, H // G]``): for
    fp32 x ``[H, NC, C, P]`` (x * dt), a ``[H, NC, C]`` (the log decays dt * A) and B, C ``[G, NC, C, N]``,
    with ``seg[i, j] = a_{j+1} + ... + a_i``: (y ``[H, NC, C, P]`` = ``((C B^T) * exp(seg) on j <= i) x``, the
    state each chunk leaves from a zero entering state ``[H, NC, P, N]`` = ``(x * exp(seg[last, j]))^T B``, the
    chunk's decay ``[H, NC]`` = ``exp(sum(a))``), fp32. ``head_slices``: how many programs share a group's heads
    per chunk (launch parameter; default: about four programs per SM). ``bc_exact``: B and C hold values exact
    in TF32 (copied from bf16 or fp16 inputs), so their products skip 3xTF32's split (if they are not, the
    results are only TF32-accurate)."""
    _check_intra(x, a, b, c)
    h, nc, cs, p = x.shape
    g, n = b.shape[0], b.shape[-1]
    x, a, b, c = (v.float().contiguous() for v in (x, a, b, c))
    y = x.new_empty(h, nc, cs, p)
    local = x.new_empty(h, nc, p, n)
    decay = x.new_empty(h, nc)
    if h * nc == 0:
        return y, local, decay
    hg = h // g
    per_slice = cdiv(hg, head_slices or _default_head_slices(x.device, g * nc, hg))
    launch(
        _intra_forward_kernel,
        (g * nc * cdiv(hg, per_slice),),
        x,
        a,
        b,
        c,
        y,
        local,
        decay,
        nc,
        cs,
        p,
        n,
        hg,
        per_slice,
        DOT=dot_precision(x.device),
        EXACT_BC=_exact_bc(x.device, bc_exact),
        BC=max(16, next_power_of_2(cs)),
        BP=max(16, next_power_of_2(p)),
        BN=_COLUMNS,
        num_warps=_WARPS,
    )
    return y, local, decay


@triton.jit
def _intra_backward_dx_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    dy_ptr,
    dlocal_ptr,
    ddecay_ptr,
    dcum_ptr,
    dx_ptr,
    da_ptr,
    NC,
    C,
    P,
    N,
    HG,
    HS,
    DOT: tl.constexpr,
    EXACT_BC: tl.constexpr,
    BC: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    """dx of each head of the slice, and the share of da that does not go through ``scores`` (``da`` is written
    here and completed by ``_intra_backward_dcb_kernel``). ``BP``: the P columns of x, dy and dx taken at a time."""
    pid = tl.program_id(0).to(tl.int64)  # over G * NC * slices
    slices = (HG + HS - 1) // HS
    group_chunk, part = pid // slices, pid % slices
    group, chunk = group_chunk // NC, group_chunk % NC
    oc = tl.arange(0, BC)
    mc = oc < C
    rows = group_chunk * C * N
    cb = _c_bt(b_ptr, c_ptr, rows, oc, mc, N, DOT, EXACT_BC, BC, BN)
    for hh in range(part * HS, tl.minimum(part * HS + HS, HG)):
        hc = (group * HG + hh) * NC + chunk
        a = tl.load(a_ptr + hc * C + oc, mask=mc, other=0.0)
        # y = scores x, scores = (C B^T) * exp(seg) on j <= i
        scores = tl.where(oc[:, None] >= oc[None, :], cb * tl.exp(_segments(a, oc)), 0.0)
        # local = (x * e_end)^T B, e_end_j = exp(a_{j+1} + ... + a_last): B dlocal^T [BC, BP], N columns in blocks
        e_end = tl.exp(_to_end(a, oc, C))
        dto_end = tl.zeros((BC,), dtype=tl.float32)
        for p0 in range(0, P, BP):
            op = p0 + tl.arange(0, BP)
            m = mc[:, None] & (op[None, :] < P)
            xp = hc * C * P + oc[:, None] * P + op[None, :]
            x = tl.load(x_ptr + xp, mask=m, other=0.0)
            dy = tl.load(dy_ptr + xp, mask=m, other=0.0)
            b_dl = tl.zeros((BC, BP), dtype=tl.float32)
            for n0 in range(0, N, BN):
                on = n0 + tl.arange(0, BN)
                bb = tl.load(
                    b_ptr + rows + oc[:, None] * N + on[None, :], mask=mc[:, None] & (on[None, :] < N), other=0.0
                )
                dl = tl.load(
                    dlocal_ptr + hc * P * N + op[:, None] * N + on[None, :],
                    mask=(op[:, None] < P) & (on[None, :] < N),
                    other=0.0,
                )
                b_dl = _dot_exact(bb, tl.trans(dl), b_dl, EXACT_BC, False, DOT)
            tl.store(dx_ptr + xp, tl.dot(tl.trans(scores), dy, e_end[:, None] * b_dl, input_precision=DOT), mask=m)
            dto_end += e_end * tl.sum(x * b_dl, 1)
        # da_k: to_end_j holds a_k for j < k; the chunk's decay and cum_i (the output's share from the entering
        # state, dcum) every a_k with k <= i.
        da = _sum_before(dto_end, 0)
        da += tl.load(ddecay_ptr + hc) * tl.exp(tl.sum(a, 0))
        da += tl.cumsum(tl.load(dcum_ptr + hc * C + oc, mask=mc, other=0.0), 0, reverse=True)
        tl.store(da_ptr + hc * C + oc, da, mask=mc)


@triton.jit
def _intra_backward_dcb_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    dy_ptr,
    da_ptr,
    dcb_ptr,
    NC,
    C,
    P,
    N,
    HG,
    HS,
    DOT: tl.constexpr,
    EXACT_BC: tl.constexpr,
    BC: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    """The gradient of ``C B^T`` summed over the slice's heads (``dcb``, per slice), and each head's share of da
    through ``scores``, added to what ``_intra_backward_dx_kernel`` wrote."""
    pid = tl.program_id(0).to(tl.int64)  # over G * NC * slices
    slices = (HG + HS - 1) // HS
    group_chunk, part = pid // slices, pid % slices
    group, chunk = group_chunk // NC, group_chunk % NC
    oc = tl.arange(0, BC)
    mc = oc < C
    lower = oc[:, None] >= oc[None, :]
    rows = group_chunk * C * N
    cb = _c_bt(b_ptr, c_ptr, rows, oc, mc, N, DOT, EXACT_BC, BC, BN)
    dcb = tl.zeros((BC, BC), dtype=tl.float32)
    for hh in range(part * HS, tl.minimum(part * HS + HS, HG)):
        hc = (group * HG + hh) * NC + chunk
        a = tl.load(a_ptr + hc * C + oc, mask=mc, other=0.0)
        decays = tl.where(lower, tl.exp(_segments(a, oc)), 0.0)
        dscores = tl.zeros((BC, BC), dtype=tl.float32)  # dy x^T, P in blocks
        for p0 in range(0, P, BP):
            op = p0 + tl.arange(0, BP)
            m = mc[:, None] & (op[None, :] < P)
            x = tl.load(x_ptr + hc * C * P + oc[:, None] * P + op[None, :], mask=m, other=0.0)
            dy = tl.load(dy_ptr + hc * C * P + oc[:, None] * P + op[None, :], mask=m, other=0.0)
            dscores = tl.dot(dy, tl.trans(x), dscores, input_precision=DOT)
        dscores = tl.where(lower, dscores, 0.0)
        dcb += dscores * decays
        dseg = dscores * (cb * decays)
        # da_k: seg[i, j] holds a_k for j < k <= i
        before = _sum_before(dseg, 1)  # [i, k]: the sum of dseg[i, j] over j < k
        da = tl.load(da_ptr + hc * C + oc, mask=mc, other=0.0) + tl.sum(tl.where(lower, before, 0.0), 0)
        tl.store(da_ptr + hc * C + oc, da, mask=mc)
    tl.store(dcb_ptr + pid * BC * BC + oc[:, None] * BC + oc[None, :], dcb)


@triton.jit
def _intra_backward_state_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    dlocal_ptr,
    dcb_ptr,
    db_ptr,
    dc_ptr,
    NC,
    C,
    P,
    N,
    HG,
    DOT: tl.constexpr,
    EXACT_BC: tl.constexpr,
    BC: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    """B's and C's gradients, a block of the state's columns per program: through ``C B^T`` (``dcb``, summed over
    the group's heads) and, for B, through every head's local state."""
    pid = tl.program_id(0).to(tl.int64)  # over G * NC * column blocks
    blocks = (N + BN - 1) // BN
    group_chunk, block = pid // blocks, pid % blocks
    group, chunk = group_chunk // NC, group_chunk % NC
    oc, op, on = tl.arange(0, BC), tl.arange(0, BP), block * BN + tl.arange(0, BN)
    mc = oc < C
    cp = mc[:, None] & (op[None, :] < P)
    cn = mc[:, None] & (on[None, :] < N)
    bn = group_chunk * C * N + oc[:, None] * N + on[None, :]
    dcb = tl.load(dcb_ptr + group_chunk * BC * BC + oc[:, None] * BC + oc[None, :])
    tl.store(dc_ptr + bn, _dot_exact(dcb, tl.load(b_ptr + bn, mask=cn, other=0.0), None, False, EXACT_BC, DOT), mask=cn)
    db = _dot_exact(tl.trans(dcb), tl.load(c_ptr + bn, mask=cn, other=0.0), None, False, EXACT_BC, DOT)
    for hh in range(0, HG):
        hc = (group * HG + hh) * NC + chunk
        a = tl.load(a_ptr + hc * C + oc, mask=mc, other=0.0)
        x = tl.load(x_ptr + hc * C * P + oc[:, None] * P + op[None, :], mask=cp, other=0.0)
        dl = tl.load(
            dlocal_ptr + hc * P * N + op[:, None] * N + on[None, :],
            mask=(op[:, None] < P) & (on[None, :] < N),
            other=0.0,
        )
        db += tl.dot(x * tl.exp(_to_end(a, oc, C))[:, None], dl, input_precision=DOT)
    tl.store(db_ptr + bn, db, mask=cn)


def intra_backward(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    dy: torch.Tensor,
    dlocal: torch.Tensor,
    ddecay: torch.Tensor,
    dcum: torch.Tensor,
    *,
    head_slices: int | None = None,
    bc_exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``intra_forward``'s backward, with the log decays' other share: from its inputs x, a, b, c, the gradients
    of its outputs y, local and decay, and ``dcum`` ``[H, NC, C]`` (the gradient of ``cum_i = a_0 + ... + a_i``
    from the rest of the op), returns fp32 (dx, db ``[G, NC, C, N]``, dc ``[G, NC, C, N]``, da). ``head_slices``
    and ``bc_exact`` as in ``intra_forward``."""
    _check_intra(x, a, b, c)
    h, nc, cs, p = x.shape
    g, n = b.shape[0], b.shape[-1]
    f = [v.float().contiguous() for v in (x, a, b, c, dy, dlocal, ddecay, dcum)]
    dx, da = f[0].new_empty(h, nc, cs, p), f[0].new_empty(h, nc, cs)
    db, dc = f[0].new_empty(g, nc, cs, n), f[0].new_empty(g, nc, cs, n)
    if h * nc == 0:
        return dx, db.zero_(), dc.zero_(), da
    hg = h // g
    per_slice = cdiv(hg, head_slices or _default_head_slices(x.device, g * nc, hg))
    slices = cdiv(hg, per_slice)
    bc, bp = max(16, next_power_of_2(cs)), max(16, next_power_of_2(p))
    dcb = f[0].new_empty(g, nc, slices, bc, bc)
    meta = dict(DOT=dot_precision(x.device), BC=bc, BP=bp, BN=_COLUMNS, num_warps=_WARPS)
    meta["EXACT_BC"] = _exact_bc(x.device, bc_exact)
    # per head two kernels, P 32 columns at a time: fewer live tiles, fewer spills (faster on sm90)
    heads_meta = {**meta, "BP": min(bp, 32)}
    launch(_intra_backward_dx_kernel, (g * nc * slices,), *f, dx, da, nc, cs, p, n, hg, per_slice, **heads_meta)
    x_, a_, b_, c_, dy_, dlocal_, *_ = f
    launch(
        _intra_backward_dcb_kernel,
        (g * nc * slices,),
        x_,
        a_,
        b_,
        c_,
        dy_,
        da,
        dcb,
        nc,
        cs,
        p,
        n,
        hg,
        per_slice,
        **heads_meta,
    )
    dcb = dcb.sum(2) if slices > 1 else dcb.view(g, nc, bc, bc)
    launch(
        _intra_backward_state_kernel,
        (g * nc * cdiv(n, _COLUMNS),),
        x_,
        a_,
        b_,
        c_,
        dlocal_,
        dcb,
        db,
        dc,
        nc,
        cs,
        p,
        n,
        hg,
        **meta,
    )
    return dx, db, dc, da


# ---- the output's share from each chunk's entering state -------------------------------------------------------


@triton.jit
def _output_forward_kernel(
    y_ptr,
    a_ptr,
    c_ptr,
    states_ptr,
    out_ptr,
    NC,
    C,
    P,
    N,
    HG,
    DOT: tl.constexpr,
    EXACT_BC: tl.constexpr,
    BC: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    """``out = y + exp(cum) * (C S^T)`` for one head's chunk and a block of its columns."""
    pid = tl.program_id(0).to(tl.int64)  # over H * NC * column blocks
    blocks = (P + BP - 1) // BP
    hc, block = pid // blocks, pid % blocks  # hc: this head's chunk
    group_chunk = (hc // NC // HG) * NC + hc % NC
    oc, op = tl.arange(0, BC), block * BP + tl.arange(0, BP)
    mc, mp = oc < C, op < P
    cum = tl.cumsum(tl.load(a_ptr + hc * C + oc, mask=mc, other=0.0), 0)
    acc = tl.zeros((BC, BP), dtype=tl.float32)
    for n0 in range(0, N, BN):
        on = n0 + tl.arange(0, BN)
        mn = on < N
        cc = tl.load(
            c_ptr + group_chunk * C * N + oc[:, None] * N + on[None, :], mask=mc[:, None] & mn[None, :], other=0.0
        )
        st = tl.load(states_ptr + hc * P * N + op[:, None] * N + on[None, :], mask=mp[:, None] & mn[None, :], other=0.0)
        acc = _dot_exact(cc, tl.trans(st), acc, EXACT_BC, False, DOT)
    yp = hc * C * P + oc[:, None] * P + op[None, :]
    cp = mc[:, None] & mp[None, :]
    tl.store(out_ptr + yp, tl.load(y_ptr + yp, mask=cp, other=0.0) + acc * tl.exp(cum)[:, None], mask=cp)


@triton.jit
def _output_backward_states_kernel(
    dy_ptr,
    a_ptr,
    c_ptr,
    dstates_ptr,
    NC,
    C,
    P,
    N,
    HG,
    DOT: tl.constexpr,
    EXACT_BC: tl.constexpr,
    BC: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    """``dstates = (dy * exp(cum))^T C`` for one head's chunk and a block of its rows, the state's columns ``BN`` at
    a time."""
    pid = tl.program_id(0).to(tl.int64)  # over H * NC * column blocks of P
    blocks = (P + BP - 1) // BP
    hc, block = pid // blocks, pid % blocks  # hc: this head's chunk
    group_chunk = (hc // NC // HG) * NC + hc % NC
    oc, op = tl.arange(0, BC), block * BP + tl.arange(0, BP)
    mc, mp = oc < C, op < P
    cum = tl.cumsum(tl.load(a_ptr + hc * C + oc, mask=mc, other=0.0), 0)
    dy = tl.load(dy_ptr + hc * C * P + oc[:, None] * P + op[None, :], mask=mc[:, None] & mp[None, :], other=0.0)
    dye_t = tl.trans(dy * tl.exp(cum)[:, None])  # [BP, BC]
    for n0 in range(0, N, BN):
        on = n0 + tl.arange(0, BN)
        mn = on < N
        cc = tl.load(
            c_ptr + group_chunk * C * N + oc[:, None] * N + on[None, :], mask=mc[:, None] & mn[None, :], other=0.0
        )
        ds = _dot_exact(dye_t, cc, None, False, EXACT_BC, DOT)
        tl.store(dstates_ptr + hc * P * N + op[:, None] * N + on[None, :], ds, mask=mp[:, None] & mn[None, :])


@triton.jit
def _output_backward_c_kernel(
    dy_ptr,
    a_ptr,
    c_ptr,
    states_ptr,
    dcum_ptr,
    dc_ptr,
    H,
    NC,
    C,
    P,
    N,
    HG,
    HS,
    DOT: tl.constexpr,
    BC: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    """For a group's chunk, a slice of its heads and a block of the state's columns, with ``dye = dy * exp(cum)``:
    C's gradient ``dye S`` summed over the slice's heads (per slice) and each head's ``dcum = rowsum(C * (dye
    S))`` over the block's columns (per block)."""
    pid = tl.program_id(0).to(tl.int64)  # over G * NC * slices * column blocks
    blocks = (N + BN - 1) // BN
    slices = (HG + HS - 1) // HS
    block = pid % blocks
    part = (pid // blocks) % slices
    group_chunk = pid // blocks // slices
    group, chunk = group_chunk // NC, group_chunk % NC
    oc, on = tl.arange(0, BC), block * BN + tl.arange(0, BN)
    mc, mn = oc < C, on < N
    cc = tl.load(c_ptr + group_chunk * C * N + oc[:, None] * N + on[None, :], mask=mc[:, None] & mn[None, :], other=0.0)
    dc = tl.zeros((BC, BN), dtype=tl.float32)
    for hh in range(part * HS, tl.minimum(part * HS + HS, HG)):
        hc = (group * HG + hh) * NC + chunk  # this head's chunk
        cum = tl.cumsum(tl.load(a_ptr + hc * C + oc, mask=mc, other=0.0), 0)
        dye_s = tl.zeros((BC, BN), dtype=tl.float32)  # (dy * exp(cum)) S, P in blocks
        for p0 in range(0, P, BP):
            op = p0 + tl.arange(0, BP)
            mp = op < P
            dy = tl.load(dy_ptr + hc * C * P + oc[:, None] * P + op[None, :], mask=mc[:, None] & mp[None, :], other=0.0)
            st = tl.load(
                states_ptr + hc * P * N + op[:, None] * N + on[None, :], mask=mp[:, None] & mn[None, :], other=0.0
            )
            dye_s += tl.dot(dy, st, input_precision=DOT)
        dye_s *= tl.exp(cum)[:, None]
        dc += dye_s
        tl.store(dcum_ptr + (block * H * NC + hc) * C + oc, tl.sum(cc * dye_s, 1), mask=mc)
    # per slice: [G, NC, slices, C, N]
    tl.store(dc_ptr + (pid // blocks) * C * N + oc[:, None] * N + on[None, :], dc, mask=mc[:, None] & mn[None, :])


def _check_output(y: torch.Tensor, a: torch.Tensor, c: torch.Tensor, states: torch.Tensor) -> None:
    h, nc, cs, p = y.shape
    if a.shape != (h, nc, cs) or c.dim() != 4 or c.shape[1:3] != (nc, cs) or h % c.shape[0]:
        raise ValueError(
            f"expected y [H, NC, C, P], a [H, NC, C], c [G, NC, C, N] with G dividing H, got y {tuple(y.shape)}, "
            f"a {tuple(a.shape)}, c {tuple(c.shape)}"
        )
    if states.shape != (h, nc, p, c.shape[-1]):
        raise ValueError(f"expected states [H, NC, P, N] = {(h, nc, p, c.shape[-1])}, got {tuple(states.shape)}")


def output_forward(
    y: torch.Tensor, a: torch.Tensor, c: torch.Tensor, states: torch.Tensor, *, bc_exact: bool = False
) -> torch.Tensor:
    """The chunked SSD scan's output, per head and chunk (heads grouped as ``[G, H // G]``): fp32 ``y + exp(cum)
    * (C states^T)`` ``[H, NC, C, P]`` for fp32 y ``[H, NC, C, P]`` (the intra-chunk part), a ``[H, NC, C]``
    (the log decays, ``cum`` their cumulative sum over the chunk), C ``[G, NC, C, N]`` and the states entering
    each chunk ``[H, NC, P, N]``. ``bc_exact`` as in ``intra_forward`` (for C)."""
    _check_output(y, a, c, states)
    h, nc, cs, p = y.shape
    g, n = c.shape[0], c.shape[-1]
    y, a, c, states = (v.float().contiguous() for v in (y, a, c, states))
    out = y.new_empty(h, nc, cs, p)
    if h * nc == 0:
        return out
    bc, bp = max(16, next_power_of_2(cs)), max(16, min(64, next_power_of_2(p)))
    launch(
        _output_forward_kernel,
        (h * nc * cdiv(p, bp),),
        y,
        a,
        c,
        states,
        out,
        nc,
        cs,
        p,
        n,
        h // g,
        DOT=dot_precision(y.device),
        EXACT_BC=_exact_bc(y.device, bc_exact),
        BC=bc,
        BP=bp,
        BN=_COLUMNS,
        num_warps=_WARPS,
    )
    return out


def output_backward(
    dy: torch.Tensor,
    a: torch.Tensor,
    c: torch.Tensor,
    states: torch.Tensor,
    *,
    head_slices: int | None = None,
    bc_exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``output_forward``'s backward but for y's gradient (dy itself): fp32 (dcum ``[H, NC, C]``, the gradient
    of ``cum``; dstates ``[H, NC, P, N]``; dc ``[G, NC, C, N]``, summed over the group's heads) from the output's
    gradient dy and ``output_forward``'s a, c and states. ``head_slices`` and ``bc_exact`` as in ``intra_forward``."""
    _check_output(dy, a, c, states)
    h, nc, cs, p = dy.shape
    g, n = c.shape[0], c.shape[-1]
    dy, a, c, states = (v.float().contiguous() for v in (dy, a, c, states))
    dstates = dy.new_empty(h, nc, p, n)
    if h * nc == 0:
        return dy.new_zeros(h, nc, cs), dstates, dy.new_zeros(g, nc, cs, n)
    hg = h // g
    blocks = cdiv(n, _COLUMNS)
    per_slice = cdiv(hg, head_slices or _default_head_slices(dy.device, g * nc * blocks, hg))
    slices = cdiv(hg, per_slice)
    dcum, dc = dy.new_empty(blocks, h, nc, cs), dy.new_empty(g, nc, slices, cs, n)
    bc, bp = max(16, next_power_of_2(cs)), max(16, min(64, next_power_of_2(p)))
    meta = dict(DOT=dot_precision(dy.device), BC=bc, BP=bp, BN=_COLUMNS, num_warps=_WARPS)
    exact = _exact_bc(dy.device, bc_exact)
    launch(
        _output_backward_states_kernel,
        (h * nc * cdiv(p, bp),),
        dy,
        a,
        c,
        dstates,
        nc,
        cs,
        p,
        n,
        hg,
        EXACT_BC=exact,
        **meta,
    )
    # dy's and the states' P columns 32 at a time here: 64 spills registers (sm90, 3xTF32)
    bp = max(16, min(_COLUMNS, bp))
    meta.update(BP=bp)
    launch(
        _output_backward_c_kernel,
        (g * nc * slices * blocks,),
        dy,
        a,
        c,
        states,
        dcum,
        dc,
        h,
        nc,
        cs,
        p,
        n,
        hg,
        per_slice,
        **meta,
    )
    return (
        dcum.sum(0) if blocks > 1 else dcum.view(h, nc, cs),
        dstates,
        dc.sum(2) if slices > 1 else dc.view(g, nc, cs, n),
    )


# ---- the tokens into the chunk layout's slots and back ------------------------------------------------------

# Rows (tokens or slots) of one head per program, 16 to 64: about 2048 elements in each [rows, P] tile (8 KB in
# fp32; the backward of the gate holds several tiles and their 64-bit offsets at once).
_TILE = 2048


def _rows(p_block: int) -> int:
    return max(16, min(64, _TILE // p_block))


@triton.jit
def _step(dt_ptr, bias_ptr, tok, h, H, mask, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, low, high):
    """(the step ``clamp(softplus(dt + bias), low, high)`` fp32, d step / d dt) of tokens ``tok`` of head h, as
    ``fastft.reference.ssd.discretize`` and its autograd: softplus is x past 20 (gradient 1), else
    ``log1p(exp(x))`` (gradient ``e / (e + 1)``); the clamp passes the gradient where low <= step <= high."""
    v = tl.load(dt_ptr + tok * H + h, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias_ptr + h).to(tl.float32)
    grad = tl.full(v.shape, 1.0, tl.float32)
    if SOFTPLUS:
        e = tl.exp(tl.minimum(v, 20.0))
        u = 1.0 + e
        # log1p(e) to an ulp or two: log(u) * e / (u - 1) (Kahan), e itself where 1 + e rounds to 1
        ones = u == 1.0
        sp = tl.where(ones, e, tl.log(u) * (e / tl.where(ones, 1.0, u - 1.0)))
        grad = tl.where(v > 20.0, 1.0, e / (e + 1.0))
        v = tl.where(v > 20.0, v, sp)
    grad = tl.where((v >= low) & (v <= high), grad, 0.0)
    return tl.minimum(tl.maximum(v, low), high), grad


@triton.jit
def _pack_forward_kernel(
    x_ptr,
    dt_ptr,
    bias_ptr,
    A_ptr,
    index_ptr,
    xdt_ptr,
    a_ptr,
    N,
    S,
    H,
    P,
    stride_xt,
    stride_xh,
    low,
    high,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    BS: tl.constexpr,
    BP: tl.constexpr,
):
    """A block of one head's slots: with each slot's token's step (``_step``), ``x_dt = x * step`` and ``a = step
    * A``, 0 where empty."""
    i_s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    os, op = i_s * BS + tl.arange(0, BS), tl.arange(0, BP)
    ms, mp = os < S, op < P
    tok = tl.load(index_ptr + os, mask=ms, other=N)
    full = tok < N
    step, _ = _step(dt_ptr, bias_ptr, tok, h, H, full, HAS_BIAS, SOFTPLUS, low, high)
    step = tl.where(full, step, 0.0)
    x = tl.load(
        x_ptr + tok[:, None] * stride_xt + h * stride_xh + op[None, :], mask=full[:, None] & mp[None, :], other=0.0
    ).to(tl.float32)
    tl.store(xdt_ptr + (h * S + os)[:, None] * P + op[None, :], x * step[:, None], mask=ms[:, None] & mp[None, :])
    tl.store(a_ptr + h * S + os, step * tl.load(A_ptr + h), mask=ms)


@triton.jit
def _pack_backward_kernel(
    x_ptr,
    dt_ptr,
    bias_ptr,
    A_ptr,
    slot_ptr,
    dxdt_ptr,
    da_ptr,
    dskip_ptr,
    dx_ptr,
    ddt_ptr,
    dA_ptr,
    dbias_ptr,
    N,
    S,
    H,
    P,
    stride_xt,
    stride_xh,
    low,
    high,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BT: tl.constexpr,
    BP: tl.constexpr,
):
    """A block of one head's tokens: dx (plus the skip's share, fp32, rounded once to x's dtype), ddt (through the
    step's discretization, in dt's dtype), and the block's shares of dA and of the bias's gradient."""
    i_t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ot, op = i_t * BT + tl.arange(0, BT), tl.arange(0, BP)
    mt, mp = ot < N, op < P
    m = mt[:, None] & mp[None, :]
    slot = tl.load(slot_ptr + ot, mask=mt, other=0)
    step, dstep_ddt = _step(dt_ptr, bias_ptr, ot, h, H, mt, HAS_BIAS, SOFTPLUS, low, high)
    step = tl.where(mt, step, 0.0)
    dxdt = tl.load(dxdt_ptr + (h * S + slot)[:, None] * P + op[None, :], mask=m, other=0.0)
    x = tl.load(x_ptr + ot[:, None] * stride_xt + h * stride_xh + op[None, :], mask=m, other=0.0).to(tl.float32)
    dx = dxdt * step[:, None]
    tp = (ot[:, None] * H + h) * P + op[None, :]  # [N, H, P] contiguous
    if HAS_SKIP:
        dx += tl.load(dskip_ptr + tp, mask=m, other=0.0)
    tl.store(dx_ptr + tp, dx.to(dx_ptr.dtype.element_ty), mask=m)
    da = tl.load(da_ptr + h * S + slot, mask=mt, other=0.0)
    ddt = (tl.sum(dxdt * x, 1) + da * tl.load(A_ptr + h)) * dstep_ddt
    tl.store(ddt_ptr + ot * H + h, ddt.to(ddt_ptr.dtype.element_ty), mask=mt)
    tl.store(dA_ptr + i_t * H + h, tl.sum(da * step, 0))
    if HAS_BIAS:
        tl.store(dbias_ptr + i_t * H + h, tl.sum(tl.where(mt, ddt, 0.0), 0))


@triton.jit
def _unpack_forward_kernel(
    y_ptr,
    x_ptr,
    slot_ptr,
    D_ptr,
    z_ptr,
    out_ptr,
    N,
    S,
    H,
    P,
    stride_xt,
    stride_xh,
    stride_zt,
    stride_zh,
    HAS_D: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_Z: tl.constexpr,
    BT: tl.constexpr,
    BP: tl.constexpr,
):
    """A block of one head's tokens: ``(y[slot] + D x) * silu(z)`` in out's dtype."""
    i_t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    ot, op = i_t * BT + tl.arange(0, BT), tl.arange(0, BP)
    mt, mp = ot < N, op < P
    m = mt[:, None] & mp[None, :]
    slot = tl.load(slot_ptr + ot, mask=mt, other=0)
    y = tl.load(y_ptr + (h * S + slot)[:, None] * P + op[None, :], mask=m, other=0.0)
    if HAS_D:
        x = tl.load(x_ptr + ot[:, None] * stride_xt + h * stride_xh + op[None, :], mask=m, other=0.0).to(tl.float32)
        if PER_CHANNEL:
            y += x * tl.load(D_ptr + h * P + op, mask=mp, other=0.0)[None, :]
        else:
            y += x * tl.load(D_ptr + h)
    if HAS_Z:
        z = tl.load(z_ptr + ot[:, None] * stride_zt + h * stride_zh + op[None, :], mask=m, other=0.0).to(tl.float32)
        y *= z * tl.sigmoid(z)
    tl.store(out_ptr + (ot[:, None] * H + h) * P + op[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _unpack_backward_kernel(
    dout_ptr,
    y_ptr,
    x_ptr,
    index_ptr,
    D_ptr,
    z_ptr,
    dy_ptr,
    dskip_ptr,
    dD_ptr,
    dz_ptr,
    N,
    S,
    H,
    P,
    stride_ot,
    stride_oh,
    stride_xt,
    stride_xh,
    stride_zt,
    stride_zh,
    HAS_D: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_Z: tl.constexpr,
    BS: tl.constexpr,
    BP: tl.constexpr,
):
    """A block of one head's slots, with ``g = dout * silu(z)`` of each slot's token: ``dy = g`` (0 where empty)
    and, for the slot's token, D's share of dx ``g D`` (fp32), ``dz = dout (y + D x) silu'(z)``, and the block's
    share of dD ``sum g x`` (per channel)."""
    i_s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    os, op = i_s * BS + tl.arange(0, BS), tl.arange(0, BP)
    ms, mp = os < S, op < P
    tok = tl.load(index_ptr + os, mask=ms, other=N)
    m = (tok < N)[:, None] & mp[None, :]
    g = tl.load(dout_ptr + tok[:, None] * stride_ot + h * stride_oh + op[None, :], mask=m, other=0.0).to(tl.float32)
    sp = (h * S + os)[:, None] * P + op[None, :]  # [H, S, P]
    tp = (tok[:, None] * H + h) * P + op[None, :]  # [N, H, P] contiguous
    if HAS_D:
        x = tl.load(x_ptr + tok[:, None] * stride_xt + h * stride_xh + op[None, :], mask=m, other=0.0).to(tl.float32)
        if PER_CHANNEL:
            d = tl.load(D_ptr + h * P + op, mask=mp, other=0.0)[None, :]
        else:
            d = tl.load(D_ptr + h)
    if HAS_Z:
        z = tl.load(z_ptr + tok[:, None] * stride_zt + h * stride_zh + op[None, :], mask=m, other=0.0).to(tl.float32)
        sig = tl.sigmoid(z)
        pre = tl.load(y_ptr + sp, mask=m, other=0.0)  # the output before the gate
        if HAS_D:
            pre += x * d
        tl.store(dz_ptr + tp, (g * pre * sig * (1 + z * (1 - sig))).to(dz_ptr.dtype.element_ty), mask=m)
        g *= z * sig
    tl.store(dy_ptr + sp, g, mask=ms[:, None] & mp[None, :])
    if HAS_D:
        tl.store(dskip_ptr + tp, g * d, mask=m)
        tl.store(dD_ptr + (i_s * H + h) * P + op, tl.sum(g * x, 0), mask=mp)


@triton.jit
def _bc_pack_forward_kernel(
    b_ptr,
    c_ptr,
    index_ptr,
    bs_ptr,
    cs_ptr,
    N,
    S,
    NS,
    stride_bt,
    stride_bg,
    stride_ct,
    stride_cg,
    BS: tl.constexpr,
    BN: tl.constexpr,
):
    """A block of one group's slots: each slot's token's B and C in fp32, 0 where the slot is empty."""
    i_s = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1).to(tl.int64)
    os, on = i_s * BS + tl.arange(0, BS), tl.arange(0, BN)
    ms, mn = os < S, on < NS
    tok = tl.load(index_ptr + os, mask=ms, other=N)
    m = (tok < N)[:, None] & mn[None, :]
    b = tl.load(b_ptr + tok[:, None] * stride_bt + grp * stride_bg + on[None, :], mask=m, other=0.0)
    c = tl.load(c_ptr + tok[:, None] * stride_ct + grp * stride_cg + on[None, :], mask=m, other=0.0)
    sp = (grp * S + os)[:, None] * NS + on[None, :]
    tl.store(bs_ptr + sp, b.to(tl.float32), mask=ms[:, None] & mn[None, :])
    tl.store(cs_ptr + sp, c.to(tl.float32), mask=ms[:, None] & mn[None, :])


@triton.jit
def _bc_pack_backward_kernel(db_ptr, dc_ptr, slot_ptr, dB_ptr, dC_ptr, N, S, G, NS, BT: tl.constexpr, BN: tl.constexpr):
    """A block of one group's tokens: B's and C's gradients from their slots', in dB's and dC's dtypes ([N, G,
    NS] contiguous)."""
    i_t = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1).to(tl.int64)
    ot, on = i_t * BT + tl.arange(0, BT), tl.arange(0, BN)
    mt = ot < N
    m = mt[:, None] & (on < NS)[None, :]
    slot = tl.load(slot_ptr + ot, mask=mt, other=0)
    sp = (grp * S + slot)[:, None] * NS + on[None, :]
    tp = (ot[:, None] * G + grp) * NS + on[None, :]
    tl.store(dB_ptr + tp, tl.load(db_ptr + sp, mask=m, other=0.0).to(dB_ptr.dtype.element_ty), mask=m)
    tl.store(dC_ptr + tp, tl.load(dc_ptr + sp, mask=m, other=0.0).to(dC_ptr.dtype.element_ty), mask=m)


def _check_tokens(x: torch.Tensor, dt: torch.Tensor | None = None, A: torch.Tensor | None = None) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [N, H, P], got shape {tuple(x.shape)}")
    n, h, _ = x.shape
    if dt is not None and dt.shape != (n, h):
        raise ValueError(f"dt must be [N, H] = {(n, h)}, got {tuple(dt.shape)}")
    if A is not None and A.shape != (h,):
        raise ValueError(f"A must be [H] = {(h,)}, got {tuple(A.shape)}")


def _check_discretization(h: int, dt_bias: torch.Tensor | None, dt_limit) -> tuple[float, float]:
    if dt_bias is not None and dt_bias.shape != (h,):
        raise ValueError(f"dt_bias must be [H] = {(h,)}, got {tuple(dt_bias.shape)}")
    low, high = (float(v) for v in dt_limit)
    if not low <= high:
        raise ValueError(f"dt_limit must have low <= high, got {dt_limit!r}")
    return low, high


def _check_slots(name: str, v: torch.Tensor, x: torch.Tensor) -> None:
    h, p = x.shape[1:]
    if v.dim() != 4 or v.shape[0] != h or v.shape[3] != p:
        raise ValueError(f"{name} must be [H, NC, C, P] with x's H, P = {(h, p)}, got {tuple(v.shape)}")


def _check_skip(x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> None:
    h, p = x.shape[1:]
    if D is not None and tuple(D.shape) not in ((h,), (h, p)):
        raise ValueError(f"D must be [H] = {(h,)} or [H, P] = {(h, p)}, got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must be x's shape {tuple(x.shape)}, got {tuple(z.shape)}")


def pack_forward(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    token_index: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens into the chunk layout's slots (``fastft.delta_rule.ChunkTable``): for x ``[N, H, P]`` (any
    floating dtype, read as is), dt ``[N, H]`` (any floating dtype), A ``[H]`` and ``token_index`` ``[NC, C]``
    (each slot's token, N where empty), with each token's step ``clamp(softplus(dt + dt_bias), *dt_limit)``
    (softplus with ``dt_softplus``; ``fastft.reference.ssd.discretize``), fp32 (x_dt ``[H, NC, C, P]`` = ``x *
    step``, a ``[H, NC, C]`` = ``step * A``) of each slot's token, 0 in the empty slots."""
    _check_tokens(x, dt, A)
    if token_index.dim() != 2:
        raise ValueError(f"token_index must be [NC, C], got shape {tuple(token_index.shape)}")
    n, h, p = x.shape
    low, high = _check_discretization(h, dt_bias, dt_limit)
    nc, cs = token_index.shape
    x = unit_inner(x)
    x_dt = x.new_empty(h, nc, cs, p, dtype=torch.float32)
    a = x.new_empty(h, nc, cs, dtype=torch.float32)
    if h * nc * cs == 0:
        return x_dt, a
    bp = next_power_of_2(p)
    bs = _rows(bp)
    dt = dt.contiguous()
    launch(
        _pack_forward_kernel,
        (cdiv(nc * cs, bs), h),
        x,
        dt,
        dt if dt_bias is None else dt_bias.contiguous(),  # dt stands in for an absent bias (not read)
        A.float().contiguous(),
        token_index.contiguous(),
        x_dt,
        a,
        n,
        nc * cs,
        h,
        p,
        x.stride(0),
        x.stride(1),
        low,
        high,
        HAS_BIAS=dt_bias is not None,
        SOFTPLUS=bool(dt_softplus),
        BS=bs,
        BP=bp,
        num_warps=4,
    )
    return x_dt, a


def pack_backward(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    slot: torch.Tensor,
    dx_dt: torch.Tensor,
    da: torch.Tensor,
    dx_skip: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_forward``'s backward, with ``slot`` ``[N]`` (each token's slot, chunk * C + j): from the slots'
    gradients dx_dt ``[H, NC, C, P]`` and da ``[H, NC, C]``, (dx ``[N, H, P]`` in x's dtype, ddt ``[N, H]`` in
    dt's dtype (through the discretization), dA ``[H]`` fp32, dt_bias's gradient ``[H]`` fp32, empty without
    one). ``dx_skip`` (fp32 ``[N, H, P]`` or None): x's gradient from elsewhere, added to dx before the one
    rounding to x's dtype."""
    _check_tokens(x, dt, A)
    _check_slots("dx_dt", dx_dt, x)
    n, h, p = x.shape
    low, high = _check_discretization(h, dt_bias, dt_limit)
    nc, cs = dx_dt.shape[1:3]
    if slot.shape != (n,):
        raise ValueError(f"slot must be [N] = {(n,)}, got {tuple(slot.shape)}")
    if da.shape != dx_dt.shape[:3]:
        raise ValueError(f"da must be [H, NC, C] = {tuple(dx_dt.shape[:3])}, got {tuple(da.shape)}")
    if dx_skip is not None and dx_skip.shape != x.shape:
        raise ValueError(f"dx_skip must be x's shape {tuple(x.shape)}, got {tuple(dx_skip.shape)}")
    x = unit_inner(x)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ddt = torch.empty(dt.shape, dtype=dt.dtype, device=dt.device)
    no_bias = x.new_empty(0, dtype=torch.float32)
    if n * h == 0:
        dbias = no_bias if dt_bias is None else x.new_zeros(h, dtype=torch.float32)
        return dx, ddt, x.new_zeros(h, dtype=torch.float32), dbias
    bp = next_power_of_2(p)
    bt = _rows(bp)
    blocks = cdiv(n, bt)
    dA = x.new_empty(blocks, h, dtype=torch.float32)
    dbias = x.new_empty((blocks, h) if dt_bias is not None else (0,), dtype=torch.float32)
    dt = dt.contiguous()
    launch(
        _pack_backward_kernel,
        (blocks, h),
        x,
        dt,
        dt if dt_bias is None else dt_bias.contiguous(),
        A.float().contiguous(),
        slot.contiguous(),
        dx_dt.float().contiguous(),
        da.float().contiguous(),
        dA if dx_skip is None else dx_skip.float().contiguous(),  # dA stands in for an absent skip (not read)
        dx,
        ddt,
        dA,
        dbias,
        n,
        nc * cs,
        h,
        p,
        x.stride(0),
        x.stride(1),
        low,
        high,
        HAS_BIAS=dt_bias is not None,
        SOFTPLUS=bool(dt_softplus),
        HAS_SKIP=dx_skip is not None,
        BT=bt,
        BP=bp,
        num_warps=4,
    )
    return dx, ddt, dA.sum(0), dbias.sum(0) if dt_bias is not None else no_bias


def unpack_forward(
    y: torch.Tensor,
    x: torch.Tensor,
    slot: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
) -> torch.Tensor:
    """The slots back to the tokens, with the skip and the gate: out ``[N, H, P]`` in x's dtype = ``(y[slot] +
    D x) * silu(z)`` in fp32, for y ``[H, NC, C, P]`` (the scan's output per slot), x ``[N, H, P]``, ``slot``
    ``[N]`` (each token's slot, chunk * C + j), D ``[H]`` or ``[H, P]`` or None, z like x or None."""
    _check_tokens(x)
    _check_slots("y", y, x)
    _check_skip(x, D, z)
    n, h, p = x.shape
    if slot.shape != (n,):
        raise ValueError(f"slot must be [N] = {(n,)}, got {tuple(slot.shape)}")
    x = unit_inner(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n * h == 0:
        return out
    gate = x if z is None else unit_inner(z)  # x stands in for an absent z (not read)
    bp = next_power_of_2(p)
    bt = _rows(bp)
    launch(
        _unpack_forward_kernel,
        (cdiv(n, bt), h),
        y.float().contiguous(),
        x,
        slot.contiguous(),
        y if D is None else D.float().contiguous(),
        gate,
        out,
        n,
        y.shape[1] * y.shape[2],
        h,
        p,
        x.stride(0),
        x.stride(1),
        gate.stride(0),
        gate.stride(1),
        HAS_D=D is not None,
        PER_CHANNEL=D is not None and D.dim() == 2,
        HAS_Z=z is not None,
        BT=bt,
        BP=bp,
        num_warps=4,
    )
    return out


def unpack_backward(
    dout: torch.Tensor,
    y: torch.Tensor | None,
    x: torch.Tensor,
    token_index: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``unpack_forward``'s backward, with ``token_index`` ``[NC, C]`` (each slot's token, N where empty): from
    out's gradient dout ``[N, H, P]``, (dy ``[H, NC, C, P]`` fp32, 0 in the empty slots; D's share of x's
    gradient ``dout * silu(z) * D`` ``[N, H, P]`` fp32; dD in D's shape, fp32; dz in z's dtype). Without D the
    second and third, without z the fourth, are empty (0 elements). ``y``: ``unpack_forward``'s, read for dz
    only (None without z)."""
    _check_tokens(x)
    _check_skip(x, D, z)
    if dout.shape != x.shape:
        raise ValueError(f"dout must be x's shape {tuple(x.shape)}, got {tuple(dout.shape)}")
    if token_index.dim() != 2:
        raise ValueError(f"token_index must be [NC, C], got shape {tuple(token_index.shape)}")
    n, h, p = x.shape
    nc, cs = token_index.shape
    if z is not None:
        if y is None:
            raise ValueError("y must be given with z (dz reads it)")
        _check_slots("y", y, x)
        if y.shape[1:3] != (nc, cs):
            raise ValueError(f"y must be [H, NC, C, P] with token_index's [NC, C] = {(nc, cs)}, got {tuple(y.shape)}")
    x, dout = unit_inner(x), unit_inner(dout)
    f32 = torch.float32
    dy = x.new_empty(h, nc, cs, p, dtype=f32)
    dx = x.new_empty(x.shape if D is not None else (0,), dtype=f32)
    dz = x.new_empty(x.shape if z is not None else (0,), dtype=f32 if z is None else z.dtype)
    bp = next_power_of_2(p)
    bs = _rows(bp)
    blocks = cdiv(nc * cs, bs)
    dD = x.new_empty((blocks, h, p) if D is not None else (0,), dtype=f32)
    if h * nc * cs == 0:
        return dy, dx, x.new_zeros(D.shape if D is not None else (0,), dtype=f32), dz
    gate = x if z is None else unit_inner(z)  # x stands in for an absent z (not read)
    launch(
        _unpack_backward_kernel,
        (blocks, h),
        dout,
        dy if y is None else y.float().contiguous(),  # dy stands in for y without z (not read)
        x,
        token_index.contiguous(),
        dy if D is None else D.float().contiguous(),
        gate,
        dy,
        dx,
        dD,
        dz,
        n,
        nc * cs,
        h,
        p,
        dout.stride(0),
        dout.stride(1),
        x.stride(0),
        x.stride(1),
        gate.stride(0),
        gate.stride(1),
        HAS_D=D is not None,
        PER_CHANNEL=D is not None and D.dim() == 2,
        HAS_Z=z is not None,
        BS=bs,
        BP=bp,
        num_warps=4,
    )
    if D is not None:
        dD = dD.sum(0) if D.dim() == 2 else dD.sum((0, 2))
    return dy, dx, dD, dz


def bc_pack_forward(B: torch.Tensor, C: torch.Tensor, token_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B and C into the chunk layout's slots: for B, C ``[N, G, NS]`` (any floating dtypes, read as they are) and
    ``token_index`` ``[NC, C]`` (each slot's token, N where empty), fp32 ``[G, NC, C, NS]`` each, 0 in the empty
    slots."""
    if B.dim() != 3 or C.shape != B.shape:
        raise ValueError(f"B and C must be [N, G, NS] alike, got {tuple(B.shape)} and {tuple(C.shape)}")
    if token_index.dim() != 2:
        raise ValueError(f"token_index must be [NC, C], got shape {tuple(token_index.shape)}")
    n, g, ns = B.shape
    nc, cs = token_index.shape
    B, C = unit_inner(B), unit_inner(C)
    b, c = (B.new_empty(g, nc, cs, ns, dtype=torch.float32) for _ in range(2))
    if g * nc * cs == 0:
        return b, c
    bn = next_power_of_2(ns)
    bs = _rows(bn)
    launch(
        _bc_pack_forward_kernel,
        (cdiv(nc * cs, bs), g),
        B,
        C,
        token_index.contiguous(),
        b,
        c,
        n,
        nc * cs,
        ns,
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        BS=bs,
        BN=bn,
        num_warps=4,
    )
    return b, c


def bc_pack_backward(
    db: torch.Tensor, dc: torch.Tensor, slot: torch.Tensor, b_dtype: torch.dtype, c_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``bc_pack_forward``'s backward, with ``slot`` ``[N]`` (each token's slot, chunk * C + j): from the slots'
    gradients ``[G, NC, C, NS]``, B's and C's ``[N, G, NS]`` (contiguous) in ``b_dtype`` and ``c_dtype``."""
    if db.dim() != 4 or dc.shape != db.shape:
        raise ValueError(f"db and dc must be [G, NC, C, NS] alike, got {tuple(db.shape)} and {tuple(dc.shape)}")
    if slot.dim() != 1:
        raise ValueError(f"slot must be [N], got shape {tuple(slot.shape)}")
    g, nc, cs, ns = db.shape
    n = slot.shape[0]
    dB = db.new_empty(n, g, ns, dtype=b_dtype)
    dC = db.new_empty(n, g, ns, dtype=c_dtype)
    if n * g == 0:
        return dB, dC
    bn = next_power_of_2(ns)
    bt = _rows(bn)
    launch(
        _bc_pack_backward_kernel,
        (cdiv(n, bt), g),
        db.float().contiguous(),
        dc.float().contiguous(),
        slot.contiguous(),
        dB,
        dC,
        n,
        nc * cs,
        g,
        ns,
        BT=bt,
        BN=bn,
        num_warps=4,
    )
    return dB, dC
