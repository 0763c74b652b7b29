"""Triton kernels for packed-sequence metadata (spec: fastft/reference/packing.py).

Launch wrappers take explicit launch parameters; choosing them is fastft.packing's job.
All flat indices are int64, so tensors past 2**31 elements address correctly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2
from .common import last_at_most, max_combine


@triton.jit
def _doc_starts(pos_ptr, offs, n, row_len):
    """1 where the token at flat index ``offs`` starts a document (see the reference's rules)."""
    valid = offs < n
    cur = tl.load(pos_ptr + offs, mask=valid, other=0).to(tl.int64)
    prev = tl.load(pos_ptr + offs - 1, mask=valid & (offs > 0), other=0).to(tl.int64)
    return (valid & (((offs % row_len) == 0) | (cur != prev + 1))).to(tl.int32)


@triton.jit(do_not_specialize=["n", "row_len"])
def _boundary_stats_kernel(pos_ptr, count_ptr, last_ptr, starts_ptr, summary_ptr, n, row_len, BLOCK: tl.constexpr):
    # Per block: how many documents start in it, and the flat index of the last start (-1 if none).
    # Also presets starts[] to n (the write kernel then overwrites starts[0..num_docs-1]) and summary[1].
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n_i32 = (n + tl.zeros((), dtype=tl.int64)).to(tl.int32)
    tl.store(starts_ptr + offs, n_i32 + tl.zeros((BLOCK,), dtype=tl.int32), mask=offs < n)
    if pid == 0:
        tl.store(starts_ptr + n, n_i32)
        tl.store(summary_ptr + 1, 0)  # the longest document, maximised by the write kernel
    starts = _doc_starts(pos_ptr, offs, n, row_len)
    tl.store(count_ptr + pid, tl.sum(starts, axis=0))
    tl.store(last_ptr + pid, tl.max(tl.where(starts != 0, offs, -1), axis=0))


@triton.jit(do_not_specialize=["n", "row_len"])
def _boundary_write_kernel(
    pos_ptr,
    count_ptr,
    last_ptr,
    doc_ptr,
    out_pos_ptr,
    starts_ptr,
    summary_ptr,
    n,
    row_len,
    BLOCK: tl.constexpr,
    PREFIX_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    # Exclusive prefix over the earlier blocks' stats: documents before this block, and the last start.
    docs_before = tl.zeros((), dtype=tl.int32)
    last_before = tl.full((), -1, dtype=tl.int64)
    for c in range(0, pid, PREFIX_CHUNK):
        j = c + tl.arange(0, PREFIX_CHUNK)
        m = j < pid
        docs_before += tl.sum(tl.load(count_ptr + j, mask=m, other=0), axis=0)
        last_before = tl.maximum(last_before, tl.max(tl.load(last_ptr + j, mask=m, other=-1), axis=0))

    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    starts = _doc_starts(pos_ptr, offs, n, row_len)
    doc = docs_before + tl.cumsum(starts, axis=0) - 1
    start_of_token = tl.maximum(tl.associative_scan(tl.where(starts != 0, offs, -1), 0, max_combine), last_before)
    position = offs - start_of_token
    tl.store(doc_ptr + offs, doc, mask=valid)
    tl.store(out_pos_ptr + offs, position, mask=valid)
    tl.store(starts_ptr + doc, offs.to(tl.int32), mask=starts != 0)
    tl.atomic_max(summary_ptr + 1, tl.max(tl.where(valid, position + 1, 0), axis=0).to(tl.int32))
    if pid == tl.num_programs(0) - 1:
        num_docs = docs_before + tl.sum(starts, axis=0)
        tl.store(starts_ptr + num_docs, (n + tl.zeros((), dtype=tl.int64)).to(tl.int32))
        tl.store(summary_ptr, num_docs)


def boundaries_from_position_ids(position_ids: torch.Tensor, *, BLOCK: int, num_warps: int):
    """(doc_ids int32, positions int64, starts int32 [N+1], summary int32 [2]) as the reference defines
    them; N >= 1, contiguous int32/int64 input."""
    n = position_ids.numel()
    row_len = position_ids.shape[-1]
    doc = torch.empty(position_ids.shape, dtype=torch.int32, device=position_ids.device)
    pos = torch.empty(position_ids.shape, dtype=torch.int64, device=position_ids.device)
    starts = torch.empty(n + 1, dtype=torch.int32, device=position_ids.device)
    grid = cdiv(n, BLOCK)
    count = torch.empty(grid, dtype=torch.int32, device=position_ids.device)
    last = torch.empty(grid, dtype=torch.int64, device=position_ids.device)
    summary = torch.empty(2, dtype=torch.int32, device=position_ids.device)
    launch(
        _boundary_stats_kernel,
        (grid,),
        position_ids,
        count,
        last,
        starts,
        summary,
        n,
        row_len,
        BLOCK=BLOCK,
        num_warps=num_warps,
    )
    launch(
        _boundary_write_kernel,
        (grid,),
        position_ids,
        count,
        last,
        doc,
        pos,
        starts,
        summary,
        n,
        row_len,
        BLOCK=BLOCK,
        PREFIX_CHUNK=1024,
        num_warps=num_warps,
    )
    return doc, pos, starts, summary


@triton.jit(do_not_specialize=["num_seqs", "n"])
def _from_cu_seqlens_kernel(cu_ptr, num_seqs, doc_ptr, pos_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # Binary search per token: the largest d < num_seqs with cu[d] <= token.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    lo = last_at_most(cu_ptr, offs, valid, num_seqs - 1, STEPS)
    tl.store(doc_ptr + offs, lo, mask=valid)
    tl.store(pos_ptr + offs, offs - tl.load(cu_ptr + lo, mask=valid, other=0), mask=valid)


def boundaries_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int, *, BLOCK: int, num_warps: int):
    """(doc_ids int32 [N], positions int64 [N]) for strictly increasing int32 ``cu_seqlens`` (>= 2 entries)."""
    num_seqs = cu_seqlens.numel() - 1
    doc = torch.empty(num_tokens, dtype=torch.int32, device=cu_seqlens.device)
    pos = torch.empty(num_tokens, dtype=torch.int64, device=cu_seqlens.device)
    steps = max(1, (num_seqs - 1).bit_length())
    launch(
        _from_cu_seqlens_kernel,
        (cdiv(num_tokens, BLOCK),),
        cu_seqlens,
        num_seqs,
        doc,
        pos,
        num_tokens,
        BLOCK=BLOCK,
        STEPS=steps,
        num_warps=num_warps,
    )
    return doc, pos


@triton.jit(do_not_specialize=["window"])  # T specialized: a multiple of 16 lets the row stores vectorize
def _sdpa_mask_kernel(
    doc_ptr, out_ptr, t, window, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, FLOAT: tl.constexpr, PACK: tl.constexpr
):
    # PACK keys per stored element: 4 for a bool mask written as int32 words (wide stores), else 1.
    pid_q = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q = pid_q.to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    w = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)  # stored element (word) index in the row
    q_in = q < t
    row_words = t // PACK
    ptrs = out_ptr + (b * t + q[:, None]) * row_words + w[None, :]
    in_bounds = q_in[:, None] & (w[None, :] < row_words)
    # Doc ids never decrease along a row, so the tile's corners decide whether nothing in it is allowed
    # (all keys after all queries, in other documents, or past the window): then skip the comparisons.
    q0 = pid_q.to(tl.int64) * BLOCK_Q
    q_last = tl.minimum(q0 + BLOCK_Q, t) - 1
    k0 = pid_k.to(tl.int64) * BLOCK_K * PACK
    k_last = tl.minimum(k0 + BLOCK_K * PACK, t) - 1
    row = doc_ptr + b * t
    empty = (k0 > q_last) | (tl.load(row + k_last) < tl.load(row + q0)) | (tl.load(row + k0) > tl.load(row + q_last))
    empty = empty | ((window > 0) & (q0 - k_last >= window))
    if empty:
        if FLOAT:
            tl.store(ptrs, tl.full((BLOCK_Q, BLOCK_K), float("-inf"), dtype=out_ptr.dtype.element_ty), mask=in_bounds)
        else:
            tl.store(ptrs, tl.zeros((BLOCK_Q, BLOCK_K), dtype=out_ptr.dtype.element_ty), mask=in_bounds)
    else:
        doc_q = tl.load(row + q, mask=q_in, other=-1)
        value = tl.zeros((BLOCK_Q, BLOCK_K), dtype=tl.int32)
        for j in tl.static_range(PACK):
            k = w * PACK + j
            doc_k = tl.load(row + k, mask=k < t, other=-2)
            dist = q[:, None] - k[None, :]
            allowed = (doc_q[:, None] == doc_k[None, :]) & (dist >= 0) & ((window <= 0) | (dist < window))
            value = value | (allowed.to(tl.int32) << (8 * j))
        if FLOAT:
            stored = tl.where(value != 0, 0.0, float("-inf")).to(out_ptr.dtype.element_ty)
        else:
            stored = value.to(out_ptr.dtype.element_ty)
        tl.store(ptrs, stored, mask=in_bounds)


def sdpa_mask(doc_ids: torch.Tensor, window: int, dtype: torch.dtype, *, BLOCK_Q: int, BLOCK_K: int, num_warps: int):
    """``[B, 1, T, T]`` mask from contiguous ``[B, T]`` int32 document ids."""
    b, t = doc_ids.shape
    out = torch.empty((b, 1, t, t), dtype=dtype, device=doc_ids.device)
    pack = 4 if dtype == torch.bool and t % 4 == 0 else 1
    view = out.view(torch.int32 if pack == 4 else torch.uint8) if dtype == torch.bool else out
    grid = (cdiv(t, BLOCK_Q), cdiv(t // pack, BLOCK_K), b)
    launch(
        _sdpa_mask_kernel,
        grid,
        doc_ids,
        view,
        t,
        window,
        BLOCK_Q=BLOCK_Q,
        BLOCK_K=BLOCK_K,
        FLOAT=dtype != torch.bool,
        PACK=pack,
        num_warps=num_warps,
    )
    return out


@triton.jit(do_not_specialize=["t", "window", "num_blocks", "batch"])
def _block_tables_kernel(
    doc_ptr, t, window, num_blocks, batch, num_ptr, idx_ptr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr
):
    # One table row: q block `r` against every kv block (side 0: the kv tables), or kv block `r` against
    # every q block (side 1: the q tables). Documents are contiguous runs of one row, so a block's doc ids
    # lie between those of its first and last token: four loads per block pair decide empty/partial/full.
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    side = tl.program_id(2)
    doc_row = doc_ptr + b * t
    # num_ptr: [side, partial/full, B, nb]; idx_ptr: [side, partial/full, B, nb, nb]
    part_num_ptr = num_ptr + (side * 2 * batch + b) * num_blocks + r
    full_num_ptr = part_num_ptr + batch * num_blocks
    part_idx_ptr = idx_ptr + ((side * 2 * batch + b) * num_blocks + r) * num_blocks
    full_idx_ptr = part_idx_ptr + batch * num_blocks * num_blocks
    for sweep in tl.static_range(2):  # sweep 0 counts, sweep 1 writes the ordered indices
        if sweep == 1:
            part_total = part_seen  # noqa: F821  (counted by sweep 0 of this unrolled loop)
            full_total = full_seen  # noqa: F821
        part_seen = tl.zeros((), dtype=tl.int32)
        full_seen = tl.zeros((), dtype=tl.int32)
        for c0 in range(0, num_blocks, CHUNK):
            c = c0 + tl.arange(0, CHUNK)
            c_in = c < num_blocks
            rr = r + tl.zeros_like(c)
            qb = tl.where(side == 0, rr, c)
            kb = tl.where(side == 0, c, rr)
            q0 = qb.to(tl.int64) * BLOCK_SIZE
            k0 = kb.to(tl.int64) * BLOCK_SIZE
            q_last = tl.minimum(q0 + BLOCK_SIZE, t) - 1
            k_last = tl.minimum(k0 + BLOCK_SIZE, t) - 1
            doc_q0 = tl.load(doc_row + q0, mask=c_in, other=0)
            doc_q_last = tl.load(doc_row + q_last, mask=c_in, other=0)
            doc_k0 = tl.load(doc_row + k0, mask=c_in, other=0)
            doc_k_last = tl.load(doc_row + k_last, mask=c_in, other=0)
            below = kb < qb
            # Closest pair (q0, k_last) is in one doc iff any pair is; farthest pair (q_last, k0) bounds the window.
            nonempty = (kb == qb) | (below & (doc_k_last == doc_q0) & ((window <= 0) | (q0 - k_last < window)))
            full = below & (doc_k0 == doc_q_last) & ((window <= 0) | (q_last - k0 < window)) & (q0 + BLOCK_SIZE <= t)
            if BLOCK_SIZE == 1:
                full = full | (kb == qb)
            full = full & c_in
            part = nonempty & ~full & c_in
            part_i = part.to(tl.int32)
            full_i = full.to(tl.int32)
            if sweep == 1:
                # Set blocks first in ascending order, then the unset ones ascending (a stable descending argsort).
                part_rank = part_seen + tl.cumsum(part_i, axis=0) - 1
                part_rest = part_total + (c0 - part_seen) + tl.cumsum(1 - part_i, axis=0) - 1
                tl.store(part_idx_ptr + tl.where(part, part_rank, part_rest), c, mask=c_in)
                full_rank = full_seen + tl.cumsum(full_i, axis=0) - 1
                full_rest = full_total + (c0 - full_seen) + tl.cumsum(1 - full_i, axis=0) - 1
                tl.store(full_idx_ptr + tl.where(full, full_rank, full_rest), c, mask=c_in)
            part_seen += tl.sum(part_i, axis=0)
            full_seen += tl.sum(full_i, axis=0)
    tl.store(part_num_ptr, part_seen)
    tl.store(full_num_ptr, full_seen)


def block_mask_tables(doc_ids: torch.Tensor, window: int, block_size: int, *, num_warps: int):
    """BlockMask tables (see the reference) for contiguous ``[B, T]`` int32 document ids, T >= 1, stacked:
    ``num[2 * side + kind]`` and ``idx[2 * side + kind]``, side 0 = kv / 1 = q tables, kind 0 = partial / 1 = full."""
    b, t = doc_ids.shape
    nb = cdiv(t, block_size)
    num = torch.empty((4, b, 1, nb), dtype=torch.int32, device=doc_ids.device)
    idx = torch.empty((4, b, 1, nb, nb), dtype=torch.int32, device=doc_ids.device)
    launch(
        _block_tables_kernel,
        (nb, b, 2),
        doc_ids,
        t,
        window,
        nb,
        b,
        num,
        idx,
        BLOCK_SIZE=block_size,
        CHUNK=min(next_power_of_2(nb), 1024),
        num_warps=num_warps,
    )
    return num, idx
