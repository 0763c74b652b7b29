"""Triton kernels for MoE token routing (spec: fastft/reference/routing.py).

Routing is two launches over blocks of ``BLOCK`` pairs:
  1. sort: each program sorts its pairs by (local expert, pair) and writes, per sorted position, the
     expert and (rank inside its expert's run, pair offset), plus the block's histogram row;
  2. scatter: each program reduces the histogram itself (counts, offsets, padded offsets, and its own
     block's first slot per expert), then slot = first slot + rank -> sorted_pair and inverse; every
     program also fills its share of the padding slots (-1) and expert_of_block.
Launch wrappers take explicit launch parameters; choosing them is fastft.routing's job. Row addressing
is int64, so tensors past 2**31 elements address correctly. The row kernels let Triton specialize on row
widths and strides (a multiple of 16 lets it vectorize the row loads and stores; docs/benchmarks.md); only
token and pair counts, which change every batch, are not specialized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2
from .common import last_at_most, max_combine


@triton.jit(do_not_specialize=["n", "top_k", "stride_t", "stride_k", "num_experts", "num_local"])
def _route_sort_kernel(
    ids_ptr,
    stride_t,
    stride_k,
    top_k,
    n,
    num_experts,
    map_ptr,
    num_local,
    scratch_ptr,
    rank_off,
    hist_off,
    BLOCK: tl.constexpr,
    E_CHUNK: tl.constexpr,
    HAS_MAP: tl.constexpr,
    KEY64: tl.constexpr,
):
    pid = tl.program_id(0)
    expert_ptr = scratch_ptr
    rank_ptr = scratch_ptr + rank_off
    hist_row = scratch_ptr + hist_off + pid.to(tl.int64) * num_local
    j = tl.arange(0, BLOCK)
    base = pid.to(tl.int64) * BLOCK
    p = base + j
    valid = p < n
    raw = tl.load(ids_ptr + (p // top_k) * stride_t + (p % top_k) * stride_k, mask=valid, other=-1).to(tl.int64)
    routed = valid & (raw >= 0) & (raw < num_experts)
    if HAS_MAP:
        raw = tl.load(map_ptr + raw, mask=routed, other=-1).to(tl.int64)
        routed = routed & (raw >= 0) & (raw < num_local)
    expert = tl.where(routed, raw, num_local)  # num_local: not routed, sorts last
    if KEY64:
        key = tl.sort(expert * BLOCK + j)
    else:
        key = tl.sort((expert * BLOCK + j).to(tl.int32))
    sorted_expert = (key // BLOCK).to(tl.int32)
    pair_offset = (key % BLOCK).to(tl.int32)

    for e0 in range(0, num_local, E_CHUNK):  # zero this block's histogram row
        e = e0 + tl.arange(0, E_CHUNK)
        tl.store(hist_row + e, tl.zeros((E_CHUNK,), dtype=tl.int32), mask=e < num_local)
    tl.store(expert_ptr + p, sorted_expert)
    tl.debug_barrier()  # neighbours' experts and the zeroed row are visible to the whole program
    prev = tl.load(expert_ptr + p - 1, mask=j > 0, other=-1)
    nxt = tl.load(expert_ptr + p + 1, mask=j < BLOCK - 1, other=-1)
    run_start = tl.associative_scan(tl.where(sorted_expert != prev, j, 0), 0, max_combine)
    rank = j - run_start
    tl.store(rank_ptr + p, rank * BLOCK + pair_offset)
    run_end = (sorted_expert != nxt) & (sorted_expert < num_local)
    tl.store(hist_row + sorted_expert, rank + 1, mask=run_end)


@triton.jit(
    do_not_specialize=[
        "n",
        "num_local",
        "capacity",
        "num_blocks",
        "block_size",
        "o_offsets",
        "o_padded",
        "o_sorted",
        "o_eob",
        "o_inverse",
    ]
)
def _route_scatter_kernel(
    scratch_ptr,
    rank_off,
    hist_off,
    first_off,
    out_ptr,
    o_offsets,
    o_padded,
    o_sorted,
    o_eob,
    o_inverse,
    n,
    num_local,
    capacity,
    num_blocks,
    block_size,
    BLOCK: tl.constexpr,
    SLOT_BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
    B_CHUNK: tl.constexpr,
    E_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    expert_ptr = scratch_ptr
    rank_ptr = scratch_ptr + rank_off
    hist_ptr = scratch_ptr + hist_off
    first_row = scratch_ptr + first_off + pid.to(tl.int64) * num_local
    counts_ptr = out_ptr
    offsets_ptr = out_ptr + o_offsets
    padded_ptr = out_ptr + o_padded
    sorted_pair_ptr = out_ptr + o_sorted
    expert_of_block_ptr = out_ptr + o_eob
    inverse_ptr = out_ptr + o_inverse

    # Every program reduces the whole histogram itself (no cross-program dependency, so one launch fewer):
    # counts, offsets and padded offsets, which every program writes (the same values), and for its own
    # block the first slot of each expert: padded_offsets[e] + pairs of expert e in earlier blocks.
    carry = tl.zeros((), dtype=tl.int32)
    carry_padded = tl.zeros((), dtype=tl.int32)
    tl.store(offsets_ptr, 0)
    tl.store(padded_ptr, 0)
    for e0 in range(0, num_local, E_CHUNK):
        e = e0 + tl.arange(0, E_CHUNK)
        e_in = e < num_local
        total = tl.zeros((E_CHUNK,), dtype=tl.int32)
        before = tl.zeros((E_CHUNK,), dtype=tl.int32)
        for b0 in range(0, num_blocks, B_CHUNK):
            b = b0 + tl.arange(0, B_CHUNK)
            m = (b < num_blocks)[:, None] & e_in[None, :]
            tile = tl.load(hist_ptr + b.to(tl.int64)[:, None] * num_local + e[None, :], mask=m, other=0)
            total += tl.sum(tile, axis=0)
            before += tl.sum(tl.where((b < pid)[:, None], tile, 0), axis=0)
        padded = (total + block_size - 1) // block_size * block_size
        padded_end = carry_padded + tl.cumsum(padded, axis=0)
        tl.store(counts_ptr + e, total, mask=e_in)
        tl.store(offsets_ptr + 1 + e, carry + tl.cumsum(total, axis=0), mask=e_in)
        tl.store(padded_ptr + 1 + e, padded_end, mask=e_in)
        if pid < num_blocks:
            tl.store(first_row + e, padded_end - padded + before, mask=e_in)
        carry += tl.sum(total, axis=0)
        carry_padded += tl.sum(padded, axis=0)
    tl.debug_barrier()  # this program's first slots, counts and padded offsets are visible to all its threads

    if pid < num_blocks:
        j = tl.arange(0, BLOCK)
        base = pid.to(tl.int64) * BLOCK
        expert = tl.load(expert_ptr + base + j)
        packed = tl.load(rank_ptr + base + j)
        p = base + packed % BLOCK
        valid = p < n
        routed = valid & (expert < num_local)
        first = tl.load(first_row + expert, mask=routed, other=0)
        slot = first + packed // BLOCK
        tl.store(sorted_pair_ptr + slot, p.to(tl.int32), mask=routed)
        tl.store(inverse_ptr + p, tl.where(routed, slot, -1), mask=valid)

    # Padding slots and expert_of_block: the expert of slot s is the largest e with padded_offsets[e] <= s.
    s = pid.to(tl.int64) * SLOT_BLOCK + tl.arange(0, SLOT_BLOCK)
    s_in = s < capacity
    lo = last_at_most(padded_ptr, s, s_in, num_local, STEPS)
    owned = lo < num_local
    start = tl.load(padded_ptr + lo, mask=s_in, other=0)
    count = tl.load(counts_ptr + lo, mask=s_in & owned, other=0)
    pad = ~owned | (s - start >= count)
    tl.store(sorted_pair_ptr + s, tl.full((SLOT_BLOCK,), -1, dtype=tl.int32), mask=s_in & pad)
    tl.store(expert_of_block_ptr + s // block_size, tl.where(owned, lo, -1), mask=s_in & (s % block_size == 0))


def route(
    topk_ids,
    num_experts,
    block_size,
    expert_map,
    num_local,
    capacity,
    out,
    out_offsets,
    *,
    BLOCK,
    SLOT_BLOCK,
    SCAN_E,
    num_warps,
):
    """Fills ``out``, int32 holding (counts, offsets, padded_offsets, sorted_pair, expert_of_block, inverse)
    from the element offsets ``out_offsets`` of the last five, for ``[T, K]`` ids, T*K >= 1. Two launches."""
    t, k = topk_ids.shape
    n = t * k
    num_blocks = cdiv(n, BLOCK)
    # Scratch, each piece 16-byte aligned (BLOCK % 16 == 0): per sorted position its expert, and (rank in its
    # expert's run) * BLOCK + pair offset; per (block, expert) the histogram, then the first slots.
    hist_size = cdiv(num_blocks * num_local, 16) * 16
    rank_off = num_blocks * BLOCK
    scratch = torch.empty(2 * rank_off + 2 * hist_size, dtype=torch.int32, device=topk_ids.device)
    e_chunk = min(next_power_of_2(num_local), 1024)
    launch(
        _route_sort_kernel,
        (num_blocks,),
        topk_ids,
        topk_ids.stride(0),
        topk_ids.stride(1),
        k,
        n,
        num_experts,
        expert_map if expert_map is not None else topk_ids,
        num_local,
        scratch,
        rank_off,
        2 * rank_off,
        BLOCK=BLOCK,
        E_CHUNK=e_chunk,
        HAS_MAP=expert_map is not None,
        KEY64=(num_local + 1) * BLOCK >= 2**31,
        num_warps=num_warps,
    )
    scan_e = min(e_chunk, SCAN_E)
    launch(
        _route_scatter_kernel,
        (max(num_blocks, cdiv(capacity, SLOT_BLOCK)),),
        scratch,
        rank_off,
        2 * rank_off,
        2 * rank_off + hist_size,
        out,
        *out_offsets,
        n,
        num_local,
        capacity,
        num_blocks,
        block_size,
        BLOCK=BLOCK,
        SLOT_BLOCK=SLOT_BLOCK,
        STEPS=max(1, num_local.bit_length()),
        B_CHUNK=max(1, min(next_power_of_2(num_blocks), 4096 // scan_e)),
        E_CHUNK=scan_e,
        num_warps=num_warps,
    )


# ---- moving rows -----------------------------------------------------------------------------------------

# Row moves are bit copies: any dtype moves as the same-width integer (complex128 as two int64). The
# arithmetic kernels (combine, weighted scatter, segment sum) compute in fp32 and take these dtypes natively;
# any other floating dtype (fp8) is widened to fp32 first (exact) and the result rounded by torch, so the
# numbers are the reference's bit for bit.
_NATIVE_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


def _bits(x):
    """``x`` (``[R, H]``) viewed as integers of its element width (16-byte elements as two int64)."""
    if x.shape[1] > 1 and x.stride(1) != 1 or x.element_size() > 8:
        x = x.contiguous()
    return x.view(_BITS[x.element_size()])


def _wide(x):
    return x if x is None or x.dtype in _NATIVE_FLOATS else x.float()


@triton.jit(do_not_specialize=["t", "top_k", "capacity"])
def _scatter_rows_kernel(
    src_ptr,
    stride_src,
    inverse_ptr,
    top_k,
    sorted_pair_ptr,
    dst_ptr,
    stride_dst,
    t,
    capacity,
    h,
    w_ptr,
    other_ptr,
    stride_other,
    dw_ptr,
    SCALE: tl.constexpr,
    DOT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAD_ROWS: tl.constexpr,
):
    # Token-major, so each source row is read from memory once: dst[inverse[t, k]] = src[t] (* w[t, k]).
    # DOT: dw[t, k] = <src[t], other[inverse[t, k]]> in fp32 (0 if not routed). The programs after the
    # token programs write 0 to the padding slots (sorted_pair == -1), PAD_ROWS slots each.
    pid = tl.program_id(0)
    token_programs = tl.cdiv(t, ROWS)
    if pid < token_programs:
        tok = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        t_in = tok < t
        for k in range(0, top_k):
            slot = tl.load(inverse_ptr + tok * top_k + k, mask=t_in, other=-1).to(tl.int64)
            used = slot >= 0
            if SCALE:
                w = tl.load(w_ptr + tok * top_k + k, mask=used, other=0).to(tl.float32)
            dot = tl.zeros((ROWS,), dtype=tl.float32)
            for h0 in range(0, h, BLOCK_H):
                col = h0 + tl.arange(0, BLOCK_H)
                m = used[:, None] & (col < h)[None, :]
                v = tl.load(src_ptr + tok[:, None] * stride_src + col[None, :], mask=m, other=0)
                if SCALE:
                    out = v.to(tl.float32) * w[:, None]
                else:
                    out = v
                tl.store(dst_ptr + slot[:, None] * stride_dst + col[None, :], out.to(dst_ptr.dtype.element_ty), mask=m)
                if DOT:
                    o = tl.load(
                        other_ptr + slot[:, None] * stride_other + col[None, :],
                        mask=m,
                        other=0,
                        eviction_policy="evict_first",
                    )
                    dot += tl.sum(v.to(tl.float32) * o.to(tl.float32), axis=1)
            if DOT:
                tl.store(dw_ptr + tok * top_k + k, dot.to(dw_ptr.dtype.element_ty), mask=t_in)
    else:
        first = (pid - token_programs).to(tl.int64) * PAD_ROWS
        s_all = first + tl.arange(0, PAD_ROWS)
        pad_all = (tl.load(sorted_pair_ptr + s_all, mask=s_all < capacity, other=0) < 0) & (s_all < capacity)
        if tl.max(pad_all.to(tl.int32), axis=0) > 0:
            for r0 in range(0, PAD_ROWS, ROWS):
                s = first + r0 + tl.arange(0, ROWS)
                pad = (tl.load(sorted_pair_ptr + s, mask=s < capacity, other=0) < 0) & (s < capacity)
                if tl.max(pad.to(tl.int32), axis=0) > 0:
                    for h0 in range(0, h, BLOCK_H):
                        col = h0 + tl.arange(0, BLOCK_H)
                        zero = tl.zeros((ROWS, BLOCK_H), dtype=dst_ptr.dtype.element_ty)
                        tl.store(
                            dst_ptr + s[:, None] * stride_dst + col[None, :],
                            zero,
                            mask=pad[:, None] & (col < h)[None, :],
                        )


def _scatter_rows(
    src, inverse, sorted_pair, out, *, weights=None, other=None, dw=None, ROWS, BLOCK_H, PAD_ROWS, num_warps
):
    t, k = inverse.shape
    cap, h = out.shape
    if cap == 0 or h == 0:
        return
    grid = cdiv(t, ROWS) + cdiv(cap, PAD_ROWS)
    launch(
        _scatter_rows_kernel,
        (grid,),
        src,
        src.stride(0),
        inverse,
        k,
        sorted_pair,
        out,
        out.stride(0),
        t,
        cap,
        h,
        weights if weights is not None else inverse,
        other if other is not None else src,
        other.stride(0) if other is not None else 0,
        dw if dw is not None else inverse,
        SCALE=weights is not None,
        DOT=dw is not None,
        ROWS=ROWS,
        BLOCK_H=BLOCK_H,
        PAD_ROWS=PAD_ROWS,
        num_warps=num_warps,
    )


def permute(x, sorted_pair, inverse, **launch_params):
    """``[capacity, H]``: slot ``inverse[t, k]`` holds ``x[t]``, padding slots 0 (a bit copy, any dtype)."""
    src = _bits(x)
    out = torch.empty((sorted_pair.shape[0], src.shape[1]), dtype=src.dtype, device=x.device)
    _scatter_rows(src, inverse, sorted_pair, out, **launch_params)
    return out.view(x.dtype)


def unpermute_backward(dy, ys, sorted_pair, inverse, weights, **launch_params):
    """(dys, dweights) of the weighted combine; ``weights`` contiguous ``[T, K]``."""
    if ys.dtype not in _NATIVE_FLOATS or weights.dtype not in _NATIVE_FLOATS:
        dys, dw = unpermute_backward(_wide(dy), _wide(ys), sorted_pair, inverse, _wide(weights), **launch_params)
        return dys.to(ys.dtype), dw.to(weights.dtype)
    dys = torch.empty(ys.shape, dtype=ys.dtype, device=ys.device)
    dw = torch.empty(weights.shape, dtype=weights.dtype, device=weights.device)
    if dys.numel() == 0:
        return dys, dw.zero_()
    _scatter_rows(dy, inverse, sorted_pair, dys, weights=weights, other=ys, dw=dw, **launch_params)
    return dys, dw


@triton.jit(do_not_specialize=["rows", "block_size"])
def _expert_rows_kernel(
    src_ptr,
    stride_src,
    sorted_pair_ptr,
    expert_of_block_ptr,
    block_size,
    dst_ptr,
    stride_dst,
    rows,
    h,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # dst[s] = src[expert_of_block[s // block_size]], 0 on padding slots.
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    r_in = r < rows
    used = tl.load(sorted_pair_ptr + r, mask=r_in, other=-1) >= 0
    row = tl.load(expert_of_block_ptr + r // block_size, mask=used, other=0).to(tl.int64)
    for h0 in range(0, h, BLOCK_H):
        col = h0 + tl.arange(0, BLOCK_H)
        c_in = col < h
        v = tl.load(src_ptr + row[:, None] * stride_src + col[None, :], mask=used[:, None] & c_in[None, :], other=0)
        tl.store(dst_ptr + r[:, None] * stride_dst + col[None, :], v, mask=r_in[:, None] & c_in[None, :])


def expert_rows(table, sorted_pair, expert_of_block, block_size, *, ROWS, BLOCK_H, num_warps):
    """``[capacity, F]``: each slot's expert row of ``table``, padding slots 0 (a bit copy, any dtype)."""
    src = _bits(table)
    rows, h = sorted_pair.shape[0], src.shape[1]
    out = torch.empty((rows, h), dtype=src.dtype, device=table.device)
    if rows and h:
        launch(
            _expert_rows_kernel,
            (cdiv(rows, ROWS),),
            src,
            src.stride(0),
            sorted_pair,
            expert_of_block,
            block_size,
            out,
            out.stride(0),
            rows,
            h,
            ROWS=ROWS,
            BLOCK_H=BLOCK_H,
            num_warps=num_warps,
        )
    return out.view(table.dtype)


@triton.jit(do_not_specialize=["t", "top_k"])
def _gather_sum_kernel(
    src_ptr,
    stride_src,
    inverse_ptr,
    top_k,
    w_ptr,
    dst_ptr,
    stride_dst,
    t,
    h,
    HAS_W: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # dst[t] = sum_k w[t, k] * src[inverse[t, k]] over routed k, fp32, k ascending.
    tok = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_in = tok < t
    c_in = col < h
    acc = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
    for k in range(0, top_k):
        slot = tl.load(inverse_ptr + tok * top_k + k, mask=t_in, other=-1).to(tl.int64)
        used = slot >= 0
        v = tl.load(
            src_ptr + slot[:, None] * stride_src + col[None, :],
            mask=used[:, None] & c_in[None, :],
            other=0,
            eviction_policy="evict_first",  # each slot is read once
        ).to(tl.float32)
        if HAS_W:
            v = tl.load(w_ptr + tok * top_k + k, mask=used, other=0).to(tl.float32)[:, None] * v
        acc = acc + v
    tl.store(
        dst_ptr + tok[:, None] * stride_dst + col[None, :],
        acc.to(dst_ptr.dtype.element_ty),
        mask=t_in[:, None] & c_in[None, :],
    )


def gather_sum(ys, inverse, weights, *, ROWS, BLOCK_H, num_warps):
    """``[T, H]`` combine of ``ys`` (unit column stride); ``inverse``/``weights`` contiguous ``[T, K]``."""
    if ys.dtype not in _NATIVE_FLOATS or (weights is not None and weights.dtype not in _NATIVE_FLOATS):
        wide = gather_sum(_wide(ys), inverse, _wide(weights), ROWS=ROWS, BLOCK_H=BLOCK_H, num_warps=num_warps)
        return wide.to(ys.dtype)
    t, k = inverse.shape
    h = ys.shape[1]
    out = torch.empty((t, h), dtype=ys.dtype, device=ys.device)
    if t == 0 or h == 0:
        return out
    # No fused multiply-add: the products round exactly as the reference's separate multiply and add.
    launch(
        _gather_sum_kernel,
        (cdiv(t, ROWS), cdiv(h, BLOCK_H)),
        ys,
        ys.stride(0),
        inverse,
        k,
        weights if weights is not None else inverse,
        out,
        out.stride(0),
        t,
        h,
        HAS_W=weights is not None,
        ROWS=ROWS,
        BLOCK_H=BLOCK_H,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return out


@triton.jit
def _segment_sum_kernel(
    src_ptr, stride_src, counts_ptr, padded_ptr, dst_ptr, f, ROWS: tl.constexpr, BLOCK_F: tl.constexpr
):
    # dst[e] = sum of src rows padded_offsets[e] .. padded_offsets[e] + counts[e] - 1, fp32.
    e = tl.program_id(0)
    col = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    c_in = col < f
    start = tl.load(padded_ptr + e).to(tl.int64)
    count = tl.load(counts_ptr + e)
    acc = tl.zeros((BLOCK_F,), dtype=tl.float32)
    for r0 in range(0, count, ROWS):
        r = r0 + tl.arange(0, ROWS)
        m = (r < count)[:, None] & c_in[None, :]
        acc += tl.sum(
            tl.load(src_ptr + (start + r)[:, None] * stride_src + col[None, :], mask=m, other=0).to(tl.float32), axis=0
        )
    tl.store(dst_ptr + e.to(tl.int64) * f + col, acc.to(dst_ptr.dtype.element_ty), mask=c_in)


def expert_rows_backward(dout, counts, padded_offsets, num_local, *, ROWS, BLOCK_H, num_warps):
    if dout.dtype not in _NATIVE_FLOATS:
        wide = expert_rows_backward(
            dout.float(), counts, padded_offsets, num_local, ROWS=ROWS, BLOCK_H=BLOCK_H, num_warps=num_warps
        )
        return wide.to(dout.dtype)
    f = dout.shape[1]
    out = torch.empty((num_local, f), dtype=dout.dtype, device=dout.device)
    if f:
        launch(
            _segment_sum_kernel,
            (num_local, cdiv(f, BLOCK_H)),
            dout,
            dout.stride(0),
            counts,
            padded_offsets,
            out,
            f,
            ROWS=ROWS,
            BLOCK_F=BLOCK_H,
            num_warps=num_warps,
        )
    return out
