"""The specification of ``fastft.balance``: documents to ``world_size`` ranks x ``accumulation`` micro-batches,
in plain Python (lists and ints; the op is a faster version that returns the same plan).

1. Cost of a document of ``n`` tokens: ``n * (attention_tokens + n)`` (``n + n**2 / attention_tokens`` in units of
   ``1 / attention_tokens``: its linear layers plus attention's quadratic term), or ``n`` when
   ``attention_tokens`` is 0 (tokens only). Integers: the plan never depends on rounding.
2. LPT: documents by decreasing cost (ties: lower index first), each into the bin of least load (ties: lower
   bin first), over ``k = world_size * accumulation`` bins.
3. Refinement: while the heaviest bin ``M`` and the lightest bin ``m`` (ties: lower bin) differ by ``gap``,
   the move of one document of cost ``x`` from ``M`` to ``m``, or the swap of ``x`` in ``M`` with ``y`` in ``m``,
   whose transfer ``d`` (``x`` or ``x - y``) has ``0 < d < gap`` and the least ``|2 d - gap|`` is made (ties: a
   move before a swap, then the lower document index in ``M``, then in ``m``); at most ``MAX_ROUNDS`` of them.
   Each lowers the pair's larger load and raises its smaller one, so the heaviest bin never grows.
4. Bins by decreasing load (ties: lower bin first); slot ``a`` takes the next ``world_size`` of them, the
   heaviest to rank 0 in even slots and to the last rank in odd ones. Each bin lists its documents in
   ascending index order.
"""

from __future__ import annotations

MAX_ROUNDS = 1000  # refinement steps at most (each strictly lowers the sum of squared loads)


def costs(lengths: list[int], attention_tokens: int) -> list[int]:
    return [n * (attention_tokens + n) if attention_tokens else n for n in lengths]


def balance(lengths: list[int], world_size: int, accumulation: int, attention_tokens: int) -> list[list[list[int]]]:
    """``plan[rank][slot]``: the ascending indices of the documents of that rank's micro-batch ``slot``."""
    cost = costs(lengths, attention_tokens)
    k = world_size * accumulation
    bins: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for i in sorted(range(len(cost)), key=lambda i: (-cost[i], i)):
        b = min(range(k), key=lambda b: (load[b], b))
        bins[b].append(i)
        load[b] += cost[i]
    for _ in range(MAX_ROUNDS):
        heavy = min(range(k), key=lambda b: (-load[b], b))
        light = min(range(k), key=lambda b: (load[b], b))
        gap = load[heavy] - load[light]
        candidates = []  # (score, kind, document in heavy, document in light or -1)
        for i in bins[heavy]:
            for j, kind in [(-1, 0)] + [(j, 1) for j in bins[light]]:
                d = cost[i] - (cost[j] if j >= 0 else 0)
                if 0 < d < gap:
                    candidates.append((abs(2 * d - gap), kind, i, j))
        if not candidates:
            break
        _, _, i, j = min(candidates)
        bins[heavy].remove(i)
        bins[light].append(i)
        load[heavy] -= cost[i]
        load[light] += cost[i]
        if j >= 0:
            bins[light].remove(j)
            bins[heavy].append(j)
            load[light] -= cost[j]
            load[heavy] += cost[j]
    order = sorted(range(k), key=lambda b: (-load[b], b))
    plan = [[[] for _ in range(accumulation)] for _ in range(world_size)]
    for position, b in enumerate(order):
        slot, place = divmod(position, world_size)
        rank = place if slot % 2 == 0 else world_size - 1 - place
        plan[rank][slot] = sorted(bins[b])
    return plan
