"""Torch reference for MoE token routing: the specification the Triton kernels are tested against.

Sync-free: every shape depends only on (T, K, E_local, block_size), so it also runs under CUDA graphs.

Pairs are ``p = t * K + k``. A pair is routed iff ``0 <= topk_ids[t, k] < num_experts`` and, with an
``expert_map``, its mapped id is in ``[0, num_local_experts)``. Slots are expert-major; inside an expert
they follow ascending ``p``; each expert's slots start at ``padded_offsets[e]``, a multiple of
``block_size``.
"""

from __future__ import annotations

import torch


def capacity(num_pairs: int, num_local_experts: int, block_size: int) -> int:
    """Slots needed for any routing of ``num_pairs`` pairs: the tight bound on the padded total."""
    n, e, b = num_pairs, num_local_experts, block_size
    if n == 0:
        return 0
    if b == 1:
        return n
    return b * (n if n <= e else e - 1 + -(-(n - e + 1) // b))


def local_expert_ids(topk_ids: torch.Tensor, num_experts: int, expert_map, num_local_experts: int) -> torch.Tensor:
    """int64 ``[T*K]``: each pair's local expert, or ``num_local_experts`` when it is not routed."""
    flat = topk_ids.reshape(-1).long()
    routed = (flat >= 0) & (flat < num_experts)
    if expert_map is not None:
        flat = expert_map.long()[flat.clamp(0, num_experts - 1)]
        routed &= (flat >= 0) & (flat < num_local_experts)
    return torch.where(routed, flat, num_local_experts)


def route(topk_ids: torch.Tensor, num_experts: int, block_size: int, expert_map, num_local_experts: int):
    """(counts, offsets, padded_offsets, sorted_pair, inverse, expert_of_block), all int32."""
    t, k = topk_ids.shape
    n = t * k
    e = num_local_experts
    dev = topk_ids.device
    cap = capacity(n, e, block_size)
    key = local_expert_ids(topk_ids, num_experts, expert_map, e)
    routed = key < e

    counts = torch.zeros(e + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:e]
    zero = counts.new_zeros(1)
    offsets = torch.cat([zero, counts.cumsum(0)])
    padded_offsets = torch.cat([zero, ((counts + block_size - 1) // block_size * block_size).cumsum(0)])

    order = torch.argsort(key, stable=True)  # sorted rank -> pair
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=dev))  # pair -> sorted rank
    slot = torch.where(routed, padded_offsets[key] + rank - offsets[key], -1)  # key == e reads a dropped value

    # Unrouted pairs scatter into one spare slot past the end, which is cut off.
    sorted_pair = torch.full((cap + 1,), -1, dtype=torch.int64, device=dev)
    sorted_pair = sorted_pair.scatter_(0, torch.where(routed, slot, cap), torch.arange(n, device=dev))[:cap]

    block_start = torch.arange(0, cap, block_size, device=dev)
    expert = torch.searchsorted(padded_offsets, block_start, right=True) - 1
    expert_of_block = torch.where(block_start < padded_offsets[-1], expert, -1)

    i32 = torch.int32
    return (
        counts.to(i32),
        offsets.to(i32),
        padded_offsets.to(i32),
        sorted_pair.to(i32),
        slot.view(t, k).to(i32),
        expert_of_block.to(i32),
    )


def permute(x: torch.Tensor, sorted_pair: torch.Tensor, top_k: int) -> torch.Tensor:
    """``out[s] = x[sorted_pair[s] // top_k]``; rows of padding slots (-1) are 0."""
    used = sorted_pair >= 0
    rows = (
        x[(sorted_pair.clamp(min=0) // top_k).long()] if x.shape[0] else x.new_zeros(sorted_pair.shape[0], x.shape[1])
    )
    return torch.where(used[:, None], rows, torch.zeros((), dtype=x.dtype, device=x.device))


def gather_sum(ys: torch.Tensor, inverse: torch.Tensor, weights) -> torch.Tensor:
    """``y[t] = sum_k w[t, k] * ys[inverse[t, k]]`` over routed k, in fp32, k ascending; ``ys.dtype`` out."""
    t, k = inverse.shape
    acc = torch.zeros(t, ys.shape[1], dtype=torch.float32, device=ys.device)
    if ys.shape[0] == 0:
        return acc.to(ys.dtype)
    for j in range(k):
        idx = inverse[:, j]
        row = ys[idx.clamp(min=0).long()].float()
        if weights is not None:
            row = weights[:, j, None].float() * row
        acc = acc + torch.where((idx >= 0)[:, None], row, 0.0)
    return acc.to(ys.dtype)


def unpermute_backward(
    dy: torch.Tensor, ys: torch.Tensor, sorted_pair: torch.Tensor, top_k: int, weights: torch.Tensor
):
    """(dys, dweights) of ``gather_sum(ys, inverse, weights)`` (without weights the backward is ``permute``):
    ``dys[s] = w[p] * dy[p // K]`` for the pair ``p`` in slot ``s`` (0 on padding);
    ``dweights[t, k] = <dy[t], ys[inverse[t, k]]>`` in fp32."""
    used = (sorted_pair >= 0)[:, None]
    p = sorted_pair.clamp(min=0).long()
    dy_rows = dy[p // top_k].float() if dy.shape[0] else dy.new_zeros(p.shape[0], dy.shape[1], dtype=torch.float32)
    w = weights.reshape(-1).float()[p] if weights.numel() else torch.zeros_like(p, dtype=torch.float32)
    dys = torch.where(used, w[:, None] * dy_rows, 0.0).to(ys.dtype)
    dots = torch.where(used[:, 0], (dy_rows * ys.float()).sum(1), 0.0)
    # Each routed pair owns exactly one slot; unused slots scatter into a spare entry that is cut off.
    n = weights.numel()
    dw = torch.zeros(n + 1, dtype=torch.float32, device=ys.device)
    dw.scatter_(0, torch.where(used[:, 0], p, n), dots)
    return dys, dw[:n].view_as(weights).to(weights.dtype)


def expert_rows(table: torch.Tensor, sorted_pair: torch.Tensor, expert_of_block: torch.Tensor, block_size: int):
    """``out[s] = table[expert of slot s]``; 0 on padding slots."""
    expert = expert_of_block.repeat_interleave(block_size)  # capacity is a multiple of block_size
    used = (sorted_pair >= 0)[:, None]
    rows = table[expert.clamp(min=0).long()]
    return torch.where(used, rows, torch.zeros((), dtype=table.dtype, device=table.device))


def expert_rows_backward(
    dout: torch.Tensor, counts: torch.Tensor, padded_offsets: torch.Tensor, num_local_experts: int
):
    """``dtable[e] = sum of dout`` over expert e's used slots, in fp32, slots ascending."""
    e = num_local_experts
    cap, f = dout.shape
    slot = torch.arange(cap, device=dout.device)
    expert = torch.searchsorted(padded_offsets, slot, right=True) - 1
    expert = expert.clamp(max=e - 1)
    used = (slot - padded_offsets[expert] < counts[expert]) & (slot < padded_offsets[-1])
    acc = torch.zeros(e + 1, f, dtype=torch.float32, device=dout.device)
    acc.index_add_(0, torch.where(used, expert, e), dout.float())
    return acc[:e].to(dout.dtype)
