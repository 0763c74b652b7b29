"""Token-balanced data-parallel packing: a global batch's documents split over ``world_size`` ranks x
``accumulation`` micro-batches of near-equal cost, on the host (no GPU, no sync).

    plan = fastft.balance_documents(lengths, world_size=8, accumulation=4)
    rows = plan.documents[rank]          # this rank's micro-batches: document indices into ``lengths``
    plan.imbalance                       # heaviest micro-batch / mean - 1

Each rank packs its own padding-free row per micro-batch, so ranks wait at every gradient reduction for the
one with the most work; a document's work is its tokens (the linear layers) plus attention's quadratic term.
The cost of a document of ``n`` tokens is ``n * (1 + n / attention_tokens)``: ``attention_tokens`` is the
document length at which attention costs a token as much as the rest of the layer, about ``12 * hidden_size``
for a dense transformer (``2 d n^2`` attention FLOPs against ``24 d^2 n``); default 32768; 0 counts tokens only.

The plan (``fastft/reference/balance.py`` is its specification): LPT (largest document first into the
lightest micro-batch), then moves and swaps between the heaviest and the lightest micro-batch while one
narrows their gap; micro-batches then go to (slot, rank) so that each slot's ``world_size`` micro-batches are
the closest in cost, and each rank alternates heavier and lighter ones. Deterministic: the same lengths give
the same plan (shuffle before, with a seed: ``fastft.integrations.balance.BalancedBatchSampler``).

What is guaranteed, with ``k = world_size * accumulation`` micro-batches and ``c`` the largest document's cost:

- every document is in exactly one micro-batch;
- heaviest - lightest <= ``c``, so heaviest <= mean + (1 - 1/k) ``c``: the heaviest is within ``p`` of the mean
  (``imbalance <= p``) whenever ``c <= p * mean * k / (k - 1)``, i.e. whenever no document is a large part of a
  micro-batch;
- heaviest <= (4/3 - 1/(3k)) x the best plan's heaviest (Graham's bound for LPT; the refinement never raises it).

It cannot be met when one document alone costs more than ``(1 + p)`` x the mean micro-batch (that
micro-batch holds it whatever the plan), and micro-batches are empty when there are fewer documents than
``k``: check ``plan.imbalance`` (the sampler takes at least ``k`` documents per step).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np
import torch

from ._checks import int_arg, is_int
from .reference import balance as reference

__all__ = ["balance_documents", "BalancedPlan", "DEFAULT_ATTENTION_TOKENS", "host_lengths"]

DEFAULT_ATTENTION_TOKENS = 32768
_MAX_LENGTH = 2**31 - 1
_MAX_TOTAL = 2**60  # summed cost at most: the op's int64 arithmetic (2 d - gap) never overflows


@dataclasses.dataclass(frozen=True)
class BalancedPlan:
    """A global batch's documents over ranks and micro-batch slots (``balance_documents``)."""

    documents: tuple  # documents[rank][slot]: ascending indices into the lengths of that rank's micro-batch
    tokens: tuple  # tokens[rank][slot]: the tokens of those documents
    costs: tuple  # costs[rank][slot]: their summed cost, n * (attention_tokens + n) per document (n if 0)
    largest: int  # the largest document's cost: max(costs) - min(costs) <= largest always holds

    @property
    def imbalance(self) -> float:
        """The heaviest micro-batch's cost over the mean one's, minus 1 (0.0 for no cost at all)."""
        flat = [c for rank in self.costs for c in rank]
        total = sum(flat)
        return max(flat) * len(flat) / total - 1.0 if total else 0.0


def host_lengths(lengths) -> np.ndarray:
    """``lengths`` validated as ``balance_documents`` does, as an int64 numpy array (no GPU tensor is read)."""
    if isinstance(lengths, torch.Tensor):
        if lengths.device.type != "cpu":
            raise ValueError(
                f"lengths must be on the host (a list, numpy array or CPU tensor), got a tensor on {lengths.device}: "
                "reading it would make the host wait for the GPU"
            )
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise TypeError(f"lengths must hold integers, got a {lengths.dtype} tensor")
        lengths = lengths.numpy()
    if isinstance(lengths, np.ndarray):
        if lengths.dtype.kind not in "iu":
            raise TypeError(f"lengths must hold integers, got a {lengths.dtype} array")
        if lengths.ndim != 1:
            raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
        if lengths.dtype.kind == "u" and lengths.size and int(lengths.max()) > _MAX_LENGTH:
            raise ValueError(f"lengths holds {int(lengths.max())}, more than {_MAX_LENGTH} tokens")
        values = lengths.astype(np.int64)
    elif isinstance(lengths, Sequence) and not isinstance(lengths, (str, bytes)):
        bad = next((v for v in lengths if not is_int(v)), None)
        if bad is not None:
            raise TypeError(f"lengths must hold integers, got {type(bad).__name__} {bad!r}")
        if any(v > _MAX_LENGTH for v in lengths):
            raise ValueError(f"lengths holds {max(lengths)}, more than {_MAX_LENGTH} tokens")
        values = np.array([int(v) for v in lengths], dtype=np.int64)
    else:
        what = type(lengths).__name__
        raise TypeError(f"lengths must be a list, tuple, numpy array or CPU tensor of ints, got {what}")
    if values.size and values.min() < 0:
        raise ValueError(f"lengths must be >= 0, got {int(values.min())}")
    if values.size and values.max() > _MAX_LENGTH:
        raise ValueError(f"lengths holds {int(values.max())}, more than {_MAX_LENGTH} tokens")
    return values


def balance_documents(
    lengths: Sequence[int] | np.ndarray | torch.Tensor,
    world_size: int,
    accumulation: int = 1,
    *,
    attention_tokens: int = DEFAULT_ATTENTION_TOKENS,
) -> BalancedPlan:
    """The plan of ``lengths`` (document token counts: a list or tuple of ints, a 1-D integer numpy array or
    CPU tensor) over ``world_size`` ranks x ``accumulation`` micro-batches; see the module docstring for the
    cost, the algorithm and the bounds it guarantees.

    ``TypeError`` for lengths of another type or not integers, a non-int ``world_size``, ``accumulation`` or
    ``attention_tokens``; ``ValueError`` for a CUDA tensor, lengths that are not 1-D, negative or past
    2**31 - 1, ``world_size`` or ``accumulation`` < 1, a negative ``attention_tokens``, or costs summing past
    2**60."""
    values = host_lengths(lengths)
    world_size = int_arg("world_size", world_size, minimum=1)
    accumulation = int_arg("accumulation", accumulation, minimum=1)
    attention_tokens = int_arg("attention_tokens", attention_tokens, minimum=0)
    if attention_tokens > _MAX_LENGTH:
        raise ValueError(f"attention_tokens must be at most {_MAX_LENGTH}, got {attention_tokens}")
    cost = values * (attention_tokens + values) if attention_tokens else values.copy()
    total = sum(int(c) for c in cost)  # Python ints: the check itself cannot overflow
    if total > _MAX_TOTAL:
        raise ValueError(f"the documents' costs sum to {total}, past 2**60: lower attention_tokens, or split the batch")
    bins, load = _lpt(cost, world_size * accumulation)
    _refine(bins, load, cost)
    plan = _arrange(bins, load, world_size, accumulation)
    return BalancedPlan(
        documents=plan,
        tokens=tuple(tuple(int(values[list(s)].sum()) for s in rank) for rank in plan),
        costs=tuple(tuple(int(cost[list(s)].sum()) for s in rank) for rank in plan),
        largest=int(cost.max()) if cost.size else 0,
    )


def _lpt(cost: np.ndarray, k: int) -> tuple[list[list[int]], np.ndarray]:
    """Step 2 of the specification: each document, largest first, into the lightest bin (a heap)."""
    order = np.argsort(-cost, kind="stable")  # decreasing cost, ties by index
    bins: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, b) for b in range(k)]
    for i in order.tolist():
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + int(cost[i]), b))
    load = np.zeros(k, dtype=np.int64)
    for value, b in heap:
        load[b] = value
    return bins, load


def _refine(bins: list[list[int]], load: np.ndarray, cost: np.ndarray) -> None:
    """Step 3: the best move or swap between the heaviest and the lightest bin, vectorized over pairs."""
    none = np.iinfo(np.int64).max
    for _ in range(reference.MAX_ROUNDS):
        heavy, light = int(np.argmax(load)), int(np.argmin(load))  # first of equals: the lower bin
        gap = int(load[heavy] - load[light])
        if gap <= 0 or not bins[heavy]:
            return
        hi, lo = np.array(bins[heavy]), np.array(bins[light], dtype=np.int64)
        x, y = cost[hi], cost[lo]
        moves = np.where((x > 0) & (x < gap), np.abs(2 * x - gap), none)
        d = x[:, None] - y[None, :]
        swaps = np.where((d > 0) & (d < gap), np.abs(2 * d - gap), none)
        best = min(int(moves.min()), int(swaps.min()) if swaps.size else none)
        if best == none:
            return
        if int(moves.min()) == best:
            i, j = int(hi[moves == best].min()), -1
        else:
            rows, cols = np.nonzero(swaps == best)
            i = int(hi[rows].min())
            j = int(lo[cols[hi[rows] == i]].min())
        bins[heavy].remove(i)
        bins[light].append(i)
        load[heavy] -= cost[i]
        load[light] += cost[i]
        if j >= 0:
            bins[light].remove(j)
            bins[heavy].append(j)
            load[light] -= cost[j]
            load[heavy] += cost[j]


def _arrange(bins, load: np.ndarray, world_size: int, accumulation: int) -> tuple:
    """Step 4: bins by decreasing load into (slot, rank), alternating which rank takes a slot's heaviest."""
    order = np.argsort(-load, kind="stable").tolist()
    plan = [[()] * accumulation for _ in range(world_size)]
    for position, b in enumerate(order):
        slot, place = divmod(position, world_size)
        rank = place if slot % 2 == 0 else world_size - 1 - place
        plan[rank][slot] = tuple(sorted(bins[b]))
    return tuple(tuple(rank) for rank in plan)
