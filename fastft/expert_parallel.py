"""Expert parallelism on torch.distributed: each rank of a process group keeps its own tokens and owns a
contiguous slice of the experts; an MoE layer sends every routed (token, expert) row to the rank that owns
the expert and brings the result back (two all-to-alls), in a fixed order.

    out = fastft.moe_expert_parallel(hidden, topk_ids, topk_weights, local_experts, num_experts=E, group=g)

Rank ``r`` of a group of ``W`` owns experts ``[r * E/W, (r + 1) * E/W)`` (transformers' expert-parallel plan
splits the same way). Steps: ``moe_route`` over the ``E`` global experts (slots expert-major, so rank-major)
-> ``moe_permute`` -> all-to-all of the per-expert counts -> **one host sync** (the split sizes of the row
all-to-all; the only one of the layer) -> all-to-all of the rows -> ``local_experts(rows, local_ids)`` on the
rows this rank received -> all-to-all back -> ``moe_unpermute`` weighted by the router (fp32, ascending k).
Backward runs the same all-to-alls in reverse with the split sizes kept from forward (no sync).

Gradients: each rank's experts receive the gradients of every rank's loss (their sum). ``DistributedDataParallel``
averages the other parameters' gradients over ranks, so ``fastft.integrations.transformers.use_expert_parallel``
divides the expert gradients by ``W`` to give the same mean-of-losses gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._checks import int_arg
from .routing import moe_permute, moe_route, moe_unpermute

__all__ = ["moe_expert_parallel"]


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    import torch.distributed as dist

    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows ``send[i]`` go to rank ``i``, rows ``recv[i]`` come from rank ``i``; backward is the reverse."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def group_rank_size(group) -> tuple[int, int]:
    """(rank, size) of ``group`` (None: the default group); ``ValueError`` if torch.distributed is not set up."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("expert parallelism needs torch.distributed initialised (init_process_group)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the expert-parallel group")
    return rank, dist.get_world_size(group)


def moe_expert_parallel(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    num_experts: int,
    group=None,
) -> torch.Tensor:
    """``[T, H_out]``: ``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t])`` where each expert
    runs on the rank of ``group`` that owns it (see the module docstring).

    ``hidden`` ``[T, H]`` and ``topk_ids``/``topk_weights`` ``[T, K]`` are this rank's tokens, with global
    expert ids; ids outside ``[0, num_experts)`` contribute nothing. ``local_experts(rows, ids)`` gets the
    ``[N, H]`` rows sent to this rank and ``ids`` ``[N, 1]`` int64, the local expert (``0 <= id < E/W``) of
    each, and returns ``[N, H_out]`` floating (e.g. ``fastft.experts.routed_experts`` with the local expert
    weights). Every rank of ``group`` must call it, in the same order (it is a collective). A rank where
    ``local_experts`` raises (out of memory) takes no part in the all-to-all back, so the others wait there
    until the group's timeout (``init_process_group(timeout=...)``; NCCL aborts them): let the exception end
    the process, as torchrun then stops the other ranks, rather than catch it and go on.

    ``TypeError`` for a non-tensor ``hidden``/``topk_ids``, a ``local_experts`` that is not callable or
    returns other than a floating tensor; ``ValueError`` for wrong shapes, ``num_experts`` < 1 or not
    divisible by the group's size, or torch.distributed not set up (``group_rank_size``)."""
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden must be a [T, H] tensor, got {type(hidden).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be a [T, H] tensor, got shape {tuple(hidden.shape)}")
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a [T, K] tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids must be [T={hidden.shape[0]}, K], got {tuple(topk_ids.shape)}")
    if not callable(local_experts):
        raise TypeError(f"local_experts must be callable, got {type(local_experts).__name__}")
    num_experts = int_arg("num_experts", num_experts, minimum=1)
    rank, world = group_rank_size(group)
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} must be divisible by the group's {world} ranks")
    local = num_experts // world

    routing = moe_route(topk_ids, num_experts)  # checks the ids' dtype; weights are checked by moe_unpermute
    counts = _all_to_all(routing.counts, [local] * world, [local] * world, group)  # [W * local], source-major
    sizes = torch.cat([routing.counts.view(world, local).sum(1), counts.view(world, local).sum(1)]).tolist()
    send, recv = sizes[:world], sizes[world:]  # the layer's one host sync

    rows = moe_permute(hidden, routing)[: sum(send)]  # routed slots first, in expert (so rank) order
    received = _AllToAll.apply(rows, send, recv, group)
    ids = torch.arange(local, device=hidden.device).repeat(world)
    ids = torch.repeat_interleave(ids, counts.long(), output_size=sum(recv))[:, None]
    out = local_experts(received, ids)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        what = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"local_experts must return a floating-point [N, H_out] tensor (its rows' outputs), got {what}")
    if out.dim() != 2 or out.shape[0] != received.shape[0]:
        raise ValueError(f"local_experts must return [N={received.shape[0]}, H_out], got {tuple(out.shape)}")
    back = _AllToAll.apply(out, recv, send, group)
    back = F.pad(back, (0, 0, 0, routing.capacity - back.shape[0]))  # unrouted slots: zero rows
    return moe_unpermute(back, routing, topk_weights)
