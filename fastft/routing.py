"""MoE token routing without host syncs: group a router's top-k (token, expert) pairs by expert.

    routing = fastft.moe_route(topk_ids, num_experts, block_size=128)
    xs = fastft.moe_permute(hidden, routing)                 # [capacity, H], expert-major
    ys = my_grouped_expert_mlp(xs, routing.offsets[1:])      # e.g. torch._grouped_mm(..., offs=...)
    out = fastft.moe_unpermute(ys, routing, topk_weights)    # [T, H]

Rules (the torch reference in ``fastft/reference/routing.py`` is the specification):
- pair ``p = t * K + k``; it is routed iff ``0 <= topk_ids[t, k] < num_experts`` and, with ``expert_map``,
  ``0 <= expert_map[id] < num_local_experts``. Unrouted pairs get no slot, are not counted, and have
  ``inverse == -1``;
- slots are expert-major, ascending ``p`` inside an expert (``torch.argsort(ids, stable=True)``), and
  expert ``e``'s slots start at ``padded_offsets[e]``, a multiple of ``block_size``;
- every shape depends only on (T, K, local experts, block_size): nothing syncs, CUDA graphs can capture it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from typing import Optional

import torch

from . import autotune, dispatch
from ._checks import int_arg
from ._custom_op import custom_op
from .reference import routing as reference

# the user verbs; the *_op layer below stays importable for the tests and benchmarks
__all__ = ["MoERouting", "moe_route", "moe_permute", "moe_unpermute", "moe_expert_rows"]

OP_ROUTE = dispatch.register("routing.route")
OP_PERMUTE = dispatch.register("routing.permute")
OP_UNPERMUTE = dispatch.register("routing.unpermute")
OP_EXPERT_ROWS = dispatch.register("routing.expert_rows")
# Launch parameters only; dispatched with the forward op. The row ops (permute, unpermute and the backwards)
# look their parameters up by row width H, the rest by element count. Permute's backward is the unweighted
# gather-sum (the kernel of moe_unpermute without weights), tuned apart from the weighted one.
OP_PERMUTE_BACKWARD = "routing.permute_backward"
OP_UNPERMUTE_BACKWARD = "routing.unpermute_backward"
OP_EXPERT_ROWS_BACKWARD = "routing.expert_rows_backward"

_WIDTHS = (2048, 2880, 7168)  # row widths tuned: Qwen3-30B-A3B, gpt-oss, DeepSeek-V3
_ROWS_CPU = {"ROWS": 64, "BLOCK_H": 32}
autotune.register(
    OP_ROUTE,
    autotune.Tunable(
        {"BLOCK": 1024, "SLOT_BLOCK": 1024, "SCAN_E": 64, "num_warps": 8},
        (32768, 131072, 524288),
        {"BLOCK": [512, 1024, 2048], "SLOT_BLOCK": [1024, 4096], "SCAN_E": [64, 128], "num_warps": [4, 8]},
        {"BLOCK": 64, "SLOT_BLOCK": 64},
    ),
)
autotune.register(
    OP_PERMUTE,
    autotune.Tunable(
        {"ROWS": 2, "BLOCK_H": 1024, "PAD_ROWS": 256, "num_warps": 4},
        _WIDTHS,
        {"ROWS": [1, 2, 4], "BLOCK_H": [1024, 2048, 4096], "PAD_ROWS": [256], "num_warps": [4, 8]},
        {**_ROWS_CPU, "PAD_ROWS": 128},
    ),
)
autotune.register(
    OP_UNPERMUTE,
    autotune.Tunable(
        {"ROWS": 1, "BLOCK_H": 1024, "num_warps": 4},
        _WIDTHS,
        {"ROWS": [1, 2, 4], "BLOCK_H": [256, 512, 1024, 2048], "num_warps": [4, 8]},
        _ROWS_CPU,
    ),
)
autotune.register(
    OP_PERMUTE_BACKWARD,
    autotune.Tunable(
        {"ROWS": 1, "BLOCK_H": 1024, "num_warps": 4},
        _WIDTHS,
        {"ROWS": [1, 2, 4], "BLOCK_H": [256, 512, 1024, 2048], "num_warps": [4, 8]},
        _ROWS_CPU,
    ),
)
autotune.register(
    OP_UNPERMUTE_BACKWARD,
    autotune.Tunable(
        {"ROWS": 1, "BLOCK_H": 2048, "PAD_ROWS": 256, "num_warps": 4},
        _WIDTHS,
        {"ROWS": [1, 2], "BLOCK_H": [1024, 2048, 4096], "PAD_ROWS": [256], "num_warps": [4, 8]},
        {**_ROWS_CPU, "PAD_ROWS": 128},
    ),
)
autotune.register(OP_EXPERT_ROWS, autotune.Tunable({"ROWS": 2, "BLOCK_H": 1024, "num_warps": 4}, interpreter=_ROWS_CPU))
autotune.register(
    OP_EXPERT_ROWS_BACKWARD, autotune.Tunable({"ROWS": 16, "BLOCK_H": 256, "num_warps": 4}, interpreter=_ROWS_CPU)
)

_INT32_MAX = 2**31 - 1


@functools.cache
def _kernels():
    from .kernels import routing

    return routing


# ---- custom ops ---------------------------------------------------------------------------------------


def _layout(t: int, k: int, e: int, block_size: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(capacity, sizes, starts) of a packed routing buffer: the sizes of its pieces in order (counts, offsets,
    padded_offsets, sorted_pair, expert_of_block, inverse) and the element offset of each piece after counts.
    Not memoized: under torch.compile with dynamic shapes its arguments are SymInts, which do not hash."""
    cap = reference.capacity(t * k, e, block_size)
    sizes = (e, e + 1, e + 1, cap, cap // block_size, t * k)
    ends = tuple(itertools.accumulate(sizes))  # piece i ends at ends[i]
    return cap, sizes, ends[:-1]


def route_buffer(t: int, k: int, e: int, block_size: int, device) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """An empty packed routing buffer, the element offsets of its pieces after counts (which is at 0), and
    the capacity."""
    cap, sizes, starts = _layout(t, k, e, block_size)
    return torch.empty(starts[-1] + sizes[-1], dtype=torch.int32, device=device), starts, cap


def _pack(pieces) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in pieces])


@custom_op("fastft::moe_route")
def route_op(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    expert_map: Optional[torch.Tensor],
    num_local_experts: int,
    backend: str,
) -> torch.Tensor:
    """One int32 buffer holding the six routing tensors (see ``_layout``): one allocation, one output."""
    t, k = topk_ids.shape
    n = t * k
    if backend == "torch" or n == 0:
        counts, offsets, padded, sorted_pair, inverse, expert_of_block = reference.route(
            topk_ids, num_experts, block_size, expert_map, num_local_experts
        )
        return _pack([counts, offsets, padded, sorted_pair, expert_of_block, inverse])
    packed, offsets, cap = route_buffer(t, k, num_local_experts, block_size, topk_ids.device)
    cfg = autotune.params(OP_ROUTE, topk_ids.device, n)
    # Every scatter program reads the whole (blocks x experts) histogram; past 2**17 entries fewer, larger
    # blocks win (docs/benchmarks.md).
    if cfg["BLOCK"] < 2048 and -(-n // cfg["BLOCK"]) * num_local_experts > 2**17:
        cfg["BLOCK"] = 2048
    _kernels().route(topk_ids, num_experts, block_size, expert_map, num_local_experts, cap, packed, offsets, **cfg)
    return packed


@route_op.register_fake
def _(topk_ids, num_experts, block_size, expert_map, num_local_experts, backend):
    t, k = topk_ids.shape
    return topk_ids.new_empty(sum(_layout(t, k, num_local_experts, block_size)[1]), dtype=torch.int32)


@custom_op("fastft::moe_permute")
def permute_op(x: torch.Tensor, sorted_pair: torch.Tensor, inverse: torch.Tensor, backend: str) -> torch.Tensor:
    top_k = inverse.shape[1]
    if backend == "torch":
        return reference.permute(x, sorted_pair, top_k)
    cfg = autotune.params(OP_PERMUTE, x.device, x.shape[1])
    return _kernels().permute(x, sorted_pair, inverse, **cfg)


@permute_op.register_fake
def _(x, sorted_pair, inverse, backend):
    return x.new_empty((sorted_pair.shape[0], x.shape[1]))


@custom_op("fastft::moe_unpermute")
def unpermute_op(
    ys: torch.Tensor, sorted_pair: torch.Tensor, inverse: torch.Tensor, weights: Optional[torch.Tensor], backend: str
) -> torch.Tensor:
    if backend == "torch":
        return reference.gather_sum(ys, inverse, weights)
    cfg = autotune.params(OP_UNPERMUTE if weights is not None else OP_PERMUTE_BACKWARD, ys.device, ys.shape[1])
    return _kernels().gather_sum(ys, inverse, weights, **cfg)


@unpermute_op.register_fake
def _(ys, sorted_pair, inverse, weights, backend):
    return ys.new_empty((inverse.shape[0], ys.shape[1]))


@custom_op("fastft::moe_unpermute_backward")
def unpermute_backward_op(
    dy: torch.Tensor,
    ys: torch.Tensor,
    sorted_pair: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "torch":
        return reference.unpermute_backward(dy, ys, sorted_pair, weights.shape[1], weights)
    cfg = autotune.params(OP_UNPERMUTE_BACKWARD, ys.device, ys.shape[1])
    return _kernels().unpermute_backward(dy, ys, sorted_pair, inverse, weights, **cfg)


@unpermute_backward_op.register_fake
def _(dy, ys, sorted_pair, inverse, weights, backend):
    return torch.empty_like(ys), torch.empty_like(weights)


@custom_op("fastft::moe_expert_rows")
def expert_rows_op(
    table: torch.Tensor,
    sorted_pair: torch.Tensor,
    expert_of_block: torch.Tensor,
    counts: torch.Tensor,
    padded_offsets: torch.Tensor,
    block_size: int,
    backend: str,
) -> torch.Tensor:
    if backend == "torch":
        return reference.expert_rows(table, sorted_pair, expert_of_block, block_size)
    cfg = autotune.params(OP_EXPERT_ROWS, table.device, sorted_pair.numel() * table.shape[1])
    return _kernels().expert_rows(table, sorted_pair, expert_of_block, block_size, **cfg)


@expert_rows_op.register_fake
def _(table, sorted_pair, expert_of_block, counts, padded_offsets, block_size, backend):
    return table.new_empty((sorted_pair.shape[0], table.shape[1]))


@custom_op("fastft::moe_expert_rows_backward")
def expert_rows_backward_op(
    dout: torch.Tensor, counts: torch.Tensor, padded_offsets: torch.Tensor, backend: str
) -> torch.Tensor:
    e = counts.shape[0]
    if backend == "torch" or dout.shape[0] == 0:
        return reference.expert_rows_backward(dout, counts, padded_offsets, e)
    cfg = autotune.params(OP_EXPERT_ROWS_BACKWARD, dout.device, dout.numel())
    return _kernels().expert_rows_backward(dout, counts, padded_offsets, e, **cfg)


@expert_rows_backward_op.register_fake
def _(dout, counts, padded_offsets, backend):
    return dout.new_empty((counts.shape[0], dout.shape[1]))


# ---- autograd: the backward of each op is another registered op (traceable), run on the same backend -----


def _save_backend(ctx, inputs, output):
    ctx.backend = inputs[-1]


def _permute_setup(ctx, inputs, output):
    _save_backend(ctx, inputs, output)
    ctx.save_for_backward(inputs[1], inputs[2])


def _permute_backward(ctx, grad):
    sorted_pair, inverse = ctx.saved_tensors
    return unpermute_op(grad.contiguous(), sorted_pair, inverse, None, ctx.backend), None, None, None


def _unpermute_setup(ctx, inputs, output):
    _save_backend(ctx, inputs, output)
    ys, sorted_pair, inverse, weights, _ = inputs
    ctx.save_for_backward(ys if weights is not None else None, sorted_pair, inverse, weights)


def _unpermute_backward(ctx, grad):
    ys, sorted_pair, inverse, weights = ctx.saved_tensors
    grad = grad.contiguous()
    if weights is None:
        return permute_op(grad, sorted_pair, inverse, ctx.backend), None, None, None, None
    dys, dweights = unpermute_backward_op(grad, ys, sorted_pair, inverse, weights, ctx.backend)
    return dys, None, None, dweights, None


def _expert_rows_setup(ctx, inputs, output):
    _save_backend(ctx, inputs, output)
    ctx.save_for_backward(inputs[3], inputs[4])


def _expert_rows_backward(ctx, grad):
    counts, padded_offsets = ctx.saved_tensors
    return expert_rows_backward_op(grad.contiguous(), counts, padded_offsets, ctx.backend), *(None,) * 6


permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)
unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)
expert_rows_op.register_autograd(_expert_rows_backward, setup_context=_expert_rows_setup)


# ---- public API ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoERouting:
    """The grouping of one batch's (token, expert) pairs by local expert. int32 tensors on one device:

      counts          [E]      routed pairs per local expert.
      offsets         [E + 1]  exclusive prefix of counts; ``offsets[1:]`` is ``torch._grouped_mm``'s ``offs``.
      padded_offsets  [E + 1]  exclusive prefix of counts rounded up to ``block_size``.
      sorted_pair     [capacity]  pair index ``t * K + k`` in each slot, -1 for padding/unused slots.
      inverse         [T, K]   slot of each pair, -1 if not routed.
      expert_of_block [capacity // block_size]  local expert of each block of slots, -1 if unused.

    Host ints: ``num_tokens`` (T), ``top_k`` (K), ``num_experts`` (ids accepted), ``num_local_experts`` (E),
    ``block_size``, ``capacity`` (rows of a permuted tensor). ``backend`` is the caller's override
    (None: ``FASTFT_BACKEND``/auto), also used by the ops that take this routing.
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    padded_offsets: torch.Tensor
    sorted_pair: torch.Tensor
    inverse: torch.Tensor
    expert_of_block: torch.Tensor
    num_tokens: int
    top_k: int
    num_experts: int
    num_local_experts: int
    block_size: int
    capacity: int
    backend: Optional[str] = None
    # The tensors' version counter at routing (-1: inference tensors, which have none).
    _version: int = dataclasses.field(default=-1, repr=False, compare=False)

    def __post_init__(self):
        if not getattr(_making, "route", False):
            raise TypeError(
                "MoERouting is made by fastft.moe_route only: the routing ops index memory with its slots, "
                "which moe_route guarantees to be in range"
            )

    @property
    def device(self) -> torch.device:
        return self.inverse.device


_making = threading.local()  # .route is True while moe_route builds a MoERouting


def moe_route(
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    block_size: int = 1,
    expert_map: torch.Tensor | None = None,
    num_local_experts: int | None = None,
    backend: str | None = None,
) -> MoERouting:
    """Group the pairs of ``topk_ids`` (``[T, K]`` int32/int64, any strides) by expert. See the module rules.

    ``expert_map`` (int32/int64 ``[num_experts]``, on ``topk_ids``' device) maps a global expert id to a
    local one or -1 (expert parallelism); ``num_local_experts`` is then required. ``block_size`` pads each
    expert's slots to a multiple of it (grouped GEMM tiles). ``backend``: ``auto``, ``triton`` or ``torch``.
    """
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    num_experts = int_arg("num_experts", num_experts, minimum=1)
    block_size = int_arg("block_size", block_size, minimum=1)
    if expert_map is None:
        if num_local_experts is not None:
            raise ValueError("num_local_experts is only taken with expert_map")
        num_local = num_experts
    else:
        if not isinstance(expert_map, torch.Tensor):
            raise TypeError(f"expert_map must be a tensor, got {type(expert_map).__name__}")
        if expert_map.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"expert_map must be int32 or int64, got {expert_map.dtype}")
        if expert_map.shape != (num_experts,):
            raise ValueError(f"expert_map must have shape ({num_experts},), got {tuple(expert_map.shape)}")
        if expert_map.device != topk_ids.device:
            raise ValueError(f"expert_map is on {expert_map.device}, topk_ids on {topk_ids.device}")
        if num_local_experts is None:
            raise ValueError("num_local_experts is required with expert_map")
        num_local = int_arg("num_local_experts", num_local_experts, minimum=1)
        expert_map = expert_map.contiguous()
    t, k = topk_ids.shape
    n = t * k
    cap, sizes, _ = _layout(t, k, num_local, block_size)
    if n > _INT32_MAX or cap > _INT32_MAX:
        raise ValueError(f"T*K={n} pairs need {cap} slots; int32 slot indices allow at most {_INT32_MAX}")
    # The routing buffer and the kernels' (pair blocks x experts) histograms, in int32 entries.
    implied = sum(sizes) + 2 * num_local * -(-n // 1024)
    if implied > _INT32_MAX:
        name = "num_local_experts" if expert_map is not None else "num_experts"
        raise ValueError(
            f"{name}={num_local} with T*K={n} pairs implies {implied} int32 routing entries; at most {_INT32_MAX}"
        )
    chosen = dispatch.backend_for(OP_ROUTE, topk_ids.device, backend)
    packed = route_op(topk_ids.detach(), num_experts, block_size, expert_map, num_local, chosen)
    counts, offsets, padded, sorted_pair, expert_of_block, inverse = packed.split_with_sizes(sizes)
    _making.route = True
    try:
        return MoERouting(
            counts,
            offsets,
            padded,
            sorted_pair,
            inverse.view(t, k),
            expert_of_block,
            t,
            k,
            num_experts,
            num_local,
            block_size,
            cap,
            backend,
            -1 if torch.compiler.is_compiling() or packed.is_inference() else packed._version,
        )
    finally:
        _making.route = False


def _check_routing(routing) -> None:
    if not isinstance(routing, MoERouting):
        raise TypeError(f"routing must be a MoERouting from moe_route, got {type(routing).__name__}")
    if routing._version >= 0 and not torch.compiler.is_compiling() and routing.inverse._version != routing._version:
        raise ValueError("routing's tensors were changed in place after moe_route; route again")


def _check_differentiable(name: str, x: torch.Tensor) -> None:
    if x.requires_grad and torch.is_grad_enabled() and not x.is_floating_point():
        raise TypeError(f"{name} requires grad but is {x.dtype}: gradients need a real floating dtype")


def _check_rows(name: str, x, rows: int, rows_name: str, device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[0] != rows:
        raise ValueError(f"{name} must be [{rows_name}={rows}, H], got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, the routing on {device}")


def _unit_columns(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()


def moe_permute(x: torch.Tensor, routing: MoERouting, *, backend: str | None = None) -> torch.Tensor:
    """``[capacity, H]``: slot ``s`` holds ``x[sorted_pair[s] // K]``; padding rows are exactly 0.

    A bit copy: any dtype (fp8, integers, bool, complex). Differentiable for real floating ``x``:
    ``dx[t] = sum_k dxs[inverse[t, k]]``, a deterministic gather-sum in fp32."""
    _check_routing(routing)
    _check_rows("x", x, routing.num_tokens, "T", routing.device)
    _check_differentiable("x", x)
    chosen = dispatch.backend_for(OP_PERMUTE, x.device, backend if backend is not None else routing.backend)
    return permute_op(_unit_columns(x), routing.sorted_pair, routing.inverse, chosen)


def moe_unpermute(
    ys: torch.Tensor, routing: MoERouting, weights: torch.Tensor | None = None, *, backend: str | None = None
) -> torch.Tensor:
    """``[T, H]``: ``y[t] = sum_k weights[t, k] * ys[inverse[t, k]]`` over routed k, accumulated in fp32 in
    ascending k, returned in ``ys.dtype`` (rounded as ``Tensor.to``). ``ys``: any real floating dtype, fp8
    included (widened to fp32 exactly); ``weights``: floating ``[T, K]`` or None (all ones).

    Differentiable: ``dys`` is ``w * dy`` of each slot's token (0 on padding);
    ``dweights[t, k] = <dy[t], ys[inverse[t, k]]>`` in fp32 (0 for unrouted pairs)."""
    _check_routing(routing)
    _check_rows("ys", ys, routing.capacity, "capacity", routing.device)
    if not ys.is_floating_point():
        raise TypeError(f"ys must have a real floating dtype (the combine sums in fp32), got {ys.dtype}")
    if weights is not None:
        if not isinstance(weights, torch.Tensor):
            raise TypeError(f"weights must be a tensor or None, got {type(weights).__name__}")
        if not weights.is_floating_point():
            raise TypeError(f"weights must be floating point, got {weights.dtype}")
        if weights.shape != routing.inverse.shape:
            raise ValueError(f"weights must be [T, K]={tuple(routing.inverse.shape)}, got {tuple(weights.shape)}")
        if weights.device != ys.device:
            raise ValueError(f"weights is on {weights.device}, ys on {ys.device}")
        weights = weights.contiguous()
    chosen = dispatch.backend_for(OP_UNPERMUTE, ys.device, backend if backend is not None else routing.backend)
    return unpermute_op(_unit_columns(ys), routing.sorted_pair, routing.inverse, weights, chosen)


def moe_expert_rows(table: torch.Tensor, routing: MoERouting, *, backend: str | None = None) -> torch.Tensor:
    """``[capacity, F]``: ``table[expert of slot s]``, 0 on padding (e.g. each row's expert bias).
    ``table`` is ``[num_local_experts, F]`` of any dtype (a bit copy). Differentiable for real floating
    ``table`` (a deterministic per-expert sum in fp32)."""
    _check_routing(routing)
    _check_rows("table", table, routing.num_local_experts, "num_local_experts", routing.device)
    _check_differentiable("table", table)
    chosen = dispatch.backend_for(OP_EXPERT_ROWS, table.device, backend if backend is not None else routing.backend)
    return expert_rows_op(
        _unit_columns(table),
        routing.sorted_pair,
        routing.expert_of_block,
        routing.counts,
        routing.padded_offsets,
        routing.block_size,
        chosen,
    )
