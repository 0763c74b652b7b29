"""Memory plan: for each checkpointed layer, keep, selective, recompute or offload, the least added time
whose expected peak fits a memory budget, from the layers' costs per token (``LayerCost``).
``fastft.memory_planner.MemoryPlanner`` measures the costs on the first training step and puts the plan in
force; ``plan_memory`` is the planning alone.

Choices, from most memory and least time to least memory and most time:

- ``keep``: no checkpoint; the layer's forward saves what autograd needs (norms, casts, activations...).
- ``selective``: checkpointed, with selective activation checkpointing inside (``fastft.selective_checkpoint``:
  the results of the GEMMs, attention and fastft's delta-rule scan saved, the cheap rest recomputed).
- ``recompute``: checkpointed, its input kept on the device.
- ``offload``: checkpointed, its input in pinned host memory (``fastft.offloaded_checkpoint``); where the
  input is not offloaded (a CPU tensor, a small input, ``OffloadConfig(enabled=False)``) it is
  ``recompute``. Every layer at ``offload`` (else ``recompute``) is *full recompute*, the floor: the plan
  never needs more memory than a step of it.

Cost model, per layer (``T`` tokens; ``f``: forward time, ``s``: time of the ops selective saves):

- added time: keep 0; selective ``max(f - s, f / 20)``; recompute ``f``; offload ``f`` plus the part of the
  input's copy (at ``host_bandwidth``) longer than ``f``, plus ``f / 100`` (recompute wins where both fit);
- device bytes held from forward to backward: keep and selective as measured (selective: saved outputs plus
  the input unless it is offloaded); recompute the input; offload none.
- expected peak: full recompute's (``floor_peak``) plus every layer's bytes above its floor's.

The plan is the least added time whose expected peak fits the budget (a multiple-choice knapsack, solved
exactly over the budget in ``RESOLUTION`` steps, each layer's bytes rounded up). Budgets
(``check_memory_budget``): bytes (an int), a fraction of the device's memory (a float in (0, 1]), or
``"auto"`` (what the process can reach, less a margin: ``MemoryPlanner`` resolves it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import numpy as np

from ._checks import int_arg, is_int

__all__ = [
    "KEEP",
    "SELECTIVE",
    "RECOMPUTE",
    "OFFLOAD",
    "CHOICES",
    "MemoryPlan",
    "LayerChoice",
    "LayerCost",
    "plan_memory",
    "check_memory_budget",
    "check_choices",
    "format_bytes",
]

KEEP, SELECTIVE, RECOMPUTE, OFFLOAD = "keep", "selective", "recompute", "offload"
CHOICES = (KEEP, SELECTIVE, RECOMPUTE, OFFLOAD)  # most memory, least time first
RESOLUTION = 4096  # steps the knapsack splits the available bytes into
HOST_BANDWIDTH = 16e9  # bytes/s of a device-host copy, for offload's cost


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """What a layer's choices cost, per token."""

    layer: int  # the layer's index (among the model's decoder layers)
    keep_bytes: float  # device bytes per token its forward saves without checkpoint
    selective_bytes: float  # device bytes per token selective holds (saved outputs, plus the input if not offloaded)
    input_bytes: float  # bytes per token of its input (what recompute holds)
    offloadable: bool  # whether its input goes to host memory at the floor (offload is a choice)
    forward_s: float  # seconds per token of its forward
    saved_s: float  # seconds per token of the ops selective saves
    choices: tuple = CHOICES  # the choices it may take

    @property
    def floor(self) -> str:
        return OFFLOAD if self.offloadable else RECOMPUTE

    def options(self) -> tuple:
        """The choices it may take, least memory first (the floor among them)."""
        allowed = set(self.choices) | {self.floor}
        if not self.offloadable:
            allowed.discard(OFFLOAD)
        return tuple(c for c in reversed(CHOICES) if c in allowed)

    def bytes_for(self, choice: str, tokens: int) -> int:
        per_token = {
            KEEP: self.keep_bytes,
            SELECTIVE: self.selective_bytes,
            RECOMPUTE: self.input_bytes,
            OFFLOAD: 0.0 if self.offloadable else self.input_bytes,
        }[choice]
        return math.ceil(per_token * tokens)

    def seconds_for(self, choice: str, tokens: int, host_bandwidth: float = HOST_BANDWIDTH) -> float:
        f = self.forward_s * tokens
        if choice == KEEP:
            return 0.0
        if choice == SELECTIVE:
            return max(f - self.saved_s * tokens, f / 20)
        if choice == RECOMPUTE or not self.offloadable:
            return f
        copy = self.input_bytes * tokens / host_bandwidth
        return f + max(copy - f, 0.0) + f / 100


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """One layer's line of a plan."""

    layer: int  # the layer's index (among the model's decoder layers)
    choice: str  # keep, selective, recompute or offload
    bytes: int  # device bytes it holds from its forward to its backward, at the plan's tokens
    seconds: float  # time it adds to a step (recomputation, copies not hidden), at the plan's tokens


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches (``"1.50 GiB"``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Each planned layer's choice, and what the plan expects of a step; ``str()`` is a table."""

    tokens: int  # the tokens per step it is made for
    budget: int  # bytes a step may peak at
    floor_peak: int  # expected peak of full recompute
    peak: int  # expected peak of this plan
    floor_seconds: float  # time full recompute adds to a step
    seconds: float  # time this plan adds to a step
    layers: tuple  # LayerChoice per planned layer

    def choice(self, layer: int) -> str | None:
        """The choice of layer ``layer`` (None for a layer the plan does not cover)."""
        return self._by_layer.get(layer)

    @functools.cached_property
    def _by_layer(self) -> dict:
        return {c.layer: c.choice for c in self.layers}

    def counts(self) -> dict:
        """How many layers take each choice."""
        return {c: sum(1 for x in self.layers if x.choice == c) for c in CHOICES}

    def __str__(self) -> str:
        lines = [
            f"fastft memory plan for {self.tokens} tokens: budget {format_bytes(self.budget)}, expected peak "
            f"{format_bytes(self.peak)} (full recompute {format_bytes(self.floor_peak)}); recompute per step "
            f"{self.seconds * 1e3:.1f} ms (full recompute {self.floor_seconds * 1e3:.1f} ms)",
            f"{'layer':>5}  {'choice':<9}  {'held':>10}  {'added ms':>8}",
        ]
        lines += [
            f"{c.layer:>5}  {c.choice:<9}  {format_bytes(c.bytes):>10}  {c.seconds * 1e3:>8.2f}" for c in self.layers
        ]
        return "\n".join(lines)


def plan_memory(
    costs, *, tokens: int, budget: int, floor_peak: int, host_bandwidth: float = HOST_BANDWIDTH
) -> MemoryPlan:
    """The plan of least added time for ``tokens`` per step whose expected peak (``floor_peak`` plus each
    layer's bytes above its floor's) is at most ``budget``; ``ValueError`` when ``floor_peak`` exceeds it."""
    costs = list(costs)
    tokens = int_arg("tokens", tokens, minimum=1)
    if floor_peak > budget:
        raise ValueError(
            f"the budget ({format_bytes(budget)}) is below full recompute's expected peak ({format_bytes(floor_peak)})"
        )
    available = budget - floor_peak
    unit = max(available / RESOLUTION, 1.0)
    size = min(RESOLUTION, int(available // unit))
    dp = np.zeros(size + 1)  # dp[b]: least added time of the layers so far within b units
    picks = []
    for cost in costs:
        options = cost.options()
        floor = cost.bytes_for(cost.floor, tokens)
        best = np.full((len(options), size + 1), np.inf)
        for j, choice in enumerate(options):
            w = math.ceil(max(cost.bytes_for(choice, tokens) - floor, 0) / unit)
            if w <= size:
                best[j, w:] = dp[: size + 1 - w] + cost.seconds_for(choice, tokens, host_bandwidth)
        pick = np.argmin(best, axis=0)  # ties: the choice of less memory
        dp = best[pick, np.arange(size + 1)]
        picks.append(pick)
    b, chosen = size, []
    for cost, pick in zip(reversed(costs), reversed(picks)):
        options = cost.options()
        choice = options[pick[b]]
        chosen.append(choice)
        floor = cost.bytes_for(cost.floor, tokens)
        b -= math.ceil(max(cost.bytes_for(choice, tokens) - floor, 0) / unit)
    chosen.reverse()
    layers = tuple(
        LayerChoice(c.layer, ch, c.bytes_for(ch, tokens), c.seconds_for(ch, tokens, host_bandwidth))
        for c, ch in zip(costs, chosen)
    )
    extra = sum(max(x.bytes - c.bytes_for(c.floor, tokens), 0) for c, x in zip(costs, layers))
    return MemoryPlan(
        tokens=tokens,
        budget=int(budget),
        floor_peak=int(floor_peak),
        peak=int(floor_peak + extra),
        floor_seconds=sum(c.seconds_for(c.floor, tokens, host_bandwidth) for c in costs),
        seconds=sum(x.seconds for x in layers),
        layers=layers,
    )


def check_memory_budget(value, name: str = "memory_budget"):
    """``value`` if it is a memory budget: a positive int (bytes), a float in (0, 1] (a fraction of the
    device's memory) or ``"auto"``; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(
                f"{name} must be bytes (an int), a fraction of the device in (0, 1] or 'auto', got {value!r}"
            )
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be bytes (an int), a fraction of the device in (0, 1] or 'auto', got {type(value).__name__}"
        )
    if is_int(value):
        if value <= 0:
            raise ValueError(f"{name} must be a positive number of bytes, got {value}")
        return int(value)
    if not 0 < value <= 1:
        raise ValueError(
            f"{name} as a float is a fraction of the device's memory in (0, 1], got {value!r} "
            "(give bytes as an int, e.g. 60 << 30)"
        )
    return float(value)


def check_choices(choices) -> tuple:
    """``choices`` as a tuple if it is a sequence of plan choices (``CHOICES``); ``TypeError``/``ValueError``
    otherwise."""
    if isinstance(choices, str) or not all(isinstance(c, str) for c in choices):
        raise TypeError(f"choices must be a sequence of strings among {CHOICES}, got {choices!r}")
    bad = [c for c in choices if c not in CHOICES]
    if bad:
        raise ValueError(f"choices must be among {CHOICES}, got {bad}")
    return tuple(choices)
