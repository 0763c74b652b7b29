"""Packed-sequence metadata in plain torch: the specification the Triton kernels must match.

Every function here is sync-free on a GPU (no ``.item()``, no data-dependent shapes), so the torch
backend keeps the same no-sync promise as the Triton one.

Rules (``fastft.packing`` documents them for users):
- a token starts a document if it is the first token of its row, or its position id is not the previous
  token's position id plus one;
- documents are numbered 0, 1, ... over the flattened ``B*T`` stream;
- the attention mask allows query ``q`` to see key ``k`` iff they are in the same document, ``k <= q``
  and, with a window ``w > 0``, ``q - k < w``.
"""

from __future__ import annotations

import einops
import torch
import torch.nn.functional as F


def boundaries_from_position_ids(position_ids: torch.Tensor):
    """(doc_ids int32, positions int64, starts int32 [N+1], summary int32 [2]) for ``[T]`` or ``[B, T]``
    position ids, N >= 1.

    ``starts[d]`` is the flat index of document ``d``'s first token for ``d < n`` and ``N`` for ``d >= n``
    (``starts[:n+1]`` is ``cu_seqlens``). ``summary`` is
    (n, longest document): what the host needs, in one small copy.
    """
    row_len = position_ids.shape[-1]
    flat = position_ids.reshape(-1).long()
    n = flat.numel()
    idx = torch.arange(n, device=flat.device)
    prev = torch.cat([flat[:1], flat[:-1]])
    is_start = (idx % max(row_len, 1) == 0) | (flat != prev + 1)
    doc = torch.cumsum(is_start, 0) - 1
    start_of_token = torch.cummax(torch.where(is_start, idx, 0), 0).values
    starts = torch.full((n + 1,), n, dtype=torch.long, device=flat.device)
    starts.scatter_reduce_(0, doc, idx, reduce="amin")
    positions = idx - start_of_token
    summary = torch.stack([doc[-1] + 1, positions.max() + 1]).to(torch.int32)
    shape = position_ids.shape
    return doc.to(torch.int32).reshape(shape), positions.reshape(shape), starts.to(torch.int32), summary


def boundaries_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int):
    """(doc_ids int32 [N], positions int64 [N]) for strictly increasing ``cu_seqlens`` ending at N."""
    idx = torch.arange(num_tokens, device=cu_seqlens.device)
    cu = cu_seqlens.long()
    doc = torch.searchsorted(cu[1:], idx, right=True)
    return doc.to(torch.int32), idx - cu[doc]


def sdpa_mask(doc_ids: torch.Tensor, window: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, T, T]`` mask from ``[B, T]`` document ids: bool (True = attend) or additive (0 / -inf)."""
    t = doc_ids.shape[-1]
    q = torch.arange(t, device=doc_ids.device)[:, None]
    k = torch.arange(t, device=doc_ids.device)[None, :]
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (k <= q)
    if window > 0:
        allowed = allowed & (q - k < window)
    allowed = allowed[:, None]
    if dtype == torch.bool:
        return allowed
    return torch.zeros((), dtype=dtype, device=doc_ids.device).masked_fill(~allowed, float("-inf"))


def _ordered(dense: torch.Tensor):
    """(count, indices) per row of a 0/1 matrix: set columns ascending, then unset ones ascending."""
    dense = dense.to(torch.int32)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(-1).to(torch.int32), order.to(torch.int32)


def block_mask_tables(doc_ids: torch.Tensor, window: int, block_size: int):
    """FlexAttention BlockMask tables for the document mask of ``[B, T]`` doc ids, as
    ``torch.nn.attention.flex_attention.create_block_mask`` lays them out (each ``[B, 1, ...]``):
    (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
     q_num_blocks, q_indices, full_q_num_blocks, full_q_indices).

    A block is full if every (query, key) pair in it may attend, partial if some but not all may;
    the padding past T counts as masked.
    """
    mask = sdpa_mask(doc_ids, window, torch.bool)
    t = doc_ids.shape[-1]
    pad = -t % block_size
    mask = F.pad(mask, (0, pad, 0, pad))
    sums = einops.reduce(mask.int(), "b h (qb qs) (kb ks) -> b h qb kb", "sum", qs=block_size, ks=block_size)
    full = sums == block_size * block_size
    partial = (sums > 0) & ~full
    return (
        *_ordered(partial),
        *_ordered(full),
        *_ordered(partial.transpose(-2, -1)),
        *_ordered(full.transpose(-2, -1)),
    )
