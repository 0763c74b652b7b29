"""The memory planner: measures the first training step and plans every later one (``fastft.memory_plan``).

    planner = fastft.memory_planner.MemoryPlanner("auto", max_tokens=16384)
    layer_fn = planner.layer_function(i, fastft.offloaded_checkpoint)   # each layer's checkpoint function
    planner.begin_step(tokens, device)                                  # at every training forward's start

(``fastft.integrations.transformers.apply(model, memory_budget=...)`` does both.)

The first training step runs at the floor (full recompute) while ``fastft.memory_measure`` measures each
planned layer; its forward times are the fastest of the layers of one kind (which drops one-time costs such
as compiling kernels). Device memory: the bytes held when the step starts and the peak through its backward
(the peak counter is reset once, at the first step's start); held again when the second step starts
(optimizer state now included). The floor's expected peak for ``T`` tokens is what the second step held plus
the first step's peak above what it held then, times ``T`` over the first step's tokens. Everything per token:
the plan is made for ``max(max_tokens, tokens of every step seen)`` and made again when a larger step comes.

``memory_budget="auto"``: what the process can reach (free plus what torch holds) less
``max(1 GiB, AUTO_MARGIN of the device)`` for fragmentation. With ``torch.distributed`` initialized every rank
plans from the largest numbers of all ranks (one all-reduce, at the second step's start), so that every rank
makes the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import warnings

import torch
import torch.utils.checkpoint

from ._checks import int_arg
from .memory_measure import Clock, CudaMemory, LayerSample, allocated_bytes, measure_layer
from .memory_plan import (
    CHOICES,
    HOST_BANDWIDTH,
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    SELECTIVE,
    LayerCost,
    MemoryPlan,
    check_choices,
    check_memory_budget,
    format_bytes,
    plan_memory,
)
from .offload import OffloadConfig, check_offload_config, offloaded_checkpoint, offloader_for
from .selective_checkpoint import selective_context

__all__ = ["MemoryPlanner", "run_choice", "AUTO_MARGIN"]

AUTO_MARGIN = 0.08  # of the device's memory, kept free by memory_budget="auto" (at least 1 GiB)
_log = logging.getLogger(__name__)


def _no_offload(config: OffloadConfig | None) -> OffloadConfig:
    return dataclasses.replace(config or OffloadConfig(), enabled=False)


def run_choice(
    choice: str,
    checkpoint,
    function,
    *args,
    offload_config: OffloadConfig | None = None,
    skip: frozenset = frozenset(),
    **kwargs,
):
    """``function(*args, **kwargs)`` as ``choice`` runs it, through ``checkpoint`` (``offloaded_checkpoint`` or a
    function taking its arguments, such as ``graphed_checkpoint``) for every choice but ``keep``; ``skip``:
    selective's op calls not to save."""
    if choice == KEEP:
        return function(*args, **kwargs)
    if choice == OFFLOAD:
        return checkpoint(function, *args, offload_config=offload_config, **kwargs)
    if choice == RECOMPUTE:
        return checkpoint(function, *args, offload_config=_no_offload(offload_config), **kwargs)
    if choice == SELECTIVE:
        context = functools.partial(selective_context, skip)
        return checkpoint(function, *args, offload_config=offload_config, context_fn=context, **kwargs)
    raise ValueError(f"choice must be one of {CHOICES}, got {choice!r}")


_NEW, _MEASURING, _PLANNED = "new", "measuring", "planned"


class MemoryPlanner:
    """Measures the first training step and plans every later one (see the module docstring).

    ``memory_budget``: bytes, a fraction of the device, or ``"auto"`` (``check_memory_budget``);
    ``max_tokens``: the most tokens a step will hold (a padding-free stream's token budget; None: plan for
    the largest step seen, planning again when a larger one comes); ``choices``: the ones the plan may take
    (the floor always). For hosts without CUDA (and tests):
    ``device_memory`` (an object with ``CudaMemory``'s methods), ``clock`` (``Clock``'s), ``offloadable``
    (a function of a layer's input: whether the floor offloads it; default: whether
    ``fastft.offload.offloader_for`` gives an offloader)."""

    def __init__(
        self,
        memory_budget="auto",
        *,
        max_tokens: int | None = None,
        choices=CHOICES,
        device_memory=None,
        clock: Clock | None = None,
        offloadable=None,
        host_bandwidth: float = HOST_BANDWIDTH,
    ) -> None:
        self.memory_budget = check_memory_budget(memory_budget)
        self.max_tokens = None if max_tokens is None else int_arg("max_tokens", max_tokens, minimum=1)
        self.choices = check_choices(choices)
        self.device_memory = device_memory
        self.clock = clock or Clock()
        self.offloadable = offloadable
        self.host_bandwidth = host_bandwidth
        self.plan: MemoryPlan | None = None  # the plan in force (None until the second training step)
        self.costs: list[LayerCost] = []  # the measured costs (empty until the second training step)
        self._layers: dict = {}  # layer index -> (allowed choices, kind)
        self._warned: set = set()
        self.reset()

    def reset(self, *, forget_layers: bool = False) -> None:
        """Forget the measurements and the plan: the next training step measures again (at the floor).
        ``forget_layers``: also the layers of ``layer_function`` (before giving the layers new functions)."""
        if forget_layers:
            self._layers.clear()
        self._stage = _NEW
        self._samples: dict[int, LayerSample] = {}
        self._device = None  # the device of the measured step
        self._memory = None
        self._static = self._tokens = 0
        self._backward = [False]  # whether the gradient of a measured forward's first layer input came
        self._watching = False  # whether this forward's first layer input is watched
        self._watched = False  # whether an earlier forward's was
        self._floor = (0, 0.0)  # (bytes held outside a step, bytes per token above them at a step's peak)
        self._budget_bytes = 0
        self.plan, self.costs = None, []

    # -- wiring ---------------------------------------------------------------------------------------------

    def layer_function(
        self,
        layer: int,
        checkpoint=offloaded_checkpoint,
        *,
        offload_config: OffloadConfig | None = None,
        choices=CHOICES,
        module: torch.nn.Module | None = None,
        kind=None,
    ):
        """Layer ``layer``'s checkpoint function (``fn(function, *args, **kwargs)``): measured on the first
        step, then run as the plan says. ``checkpoint``: the floor's checkpoint function (it takes
        ``offload_config`` and, for selective, ``context_fn``); ``choices``: the ones it may take;
        ``module``: the layer (its parameters are not activations); ``kind``: layers of one kind share their
        fastest forward time."""
        int_arg("layer", layer, minimum=0)
        check_offload_config(offload_config)
        self._layers[layer] = (check_choices(choices), kind)
        return functools.partial(self._call, layer, checkpoint, offload_config, module)

    def _call(self, layer, checkpoint, config, module, function, *args, **kwargs):
        if not torch.is_grad_enabled():  # nothing saved: the function just runs, as under the checkpoint
            return function(*args, **kwargs)
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if self._stage == _PLANNED:
            choice = self.plan.choice(layer)
            if choice is None:  # not measured: the floor
                choice = OFFLOAD if x is not None and self._offloadable(x, config) else RECOMPUTE
            skip = self._samples[layer].skip if choice == SELECTIVE else frozenset()
            return run_choice(choice, checkpoint, function, *args, offload_config=config, skip=skip, **kwargs)
        floor = RECOMPUTE
        if x is not None:
            floor = OFFLOAD if self._offloadable(x, config) else RECOMPUTE
        if self._stage == _MEASURING and x is not None and not self._watching and x.requires_grad:
            self._watching = True  # this forward's first layer input: its gradient shows that a backward ran
            seen = self._backward
            x.register_hook(lambda grad: seen.__setitem__(0, True))
        if self._stage != _MEASURING or x is None or layer in self._samples:
            return run_choice(floor, checkpoint, function, *args, offload_config=config, **kwargs)
        keep, (saved, saved_spans, skip), span = measure_layer(function, args, kwargs, module, self.clock, x.device)
        token = self.clock.start(x.device, "forward")
        out = run_choice(floor, checkpoint, function, *args, offload_config=config, **kwargs)
        self._samples[layer] = LayerSample(
            tokens=max(x.numel() // max(x.shape[-1], 1), 1),
            keep=keep,
            saved=saved,
            skip=skip,
            input=allocated_bytes(x.numel() * x.element_size()),
            offloadable=floor == OFFLOAD,
            spans=[self.clock.stop(token), span],
            saved_spans=saved_spans,
        )
        return out

    def _offloadable(self, x, config) -> bool:
        if self.offloadable is not None:
            return bool(self.offloadable(x))
        return offloader_for(x, config) is not None

    # -- steps ----------------------------------------------------------------------------------------------

    def memory(self, device: torch.device):
        """The device memory the planner reads (``device_memory``, else ``CudaMemory``); ``ValueError`` for a
        device without one."""
        if self.device_memory is not None:
            return self.device_memory
        if device.type != "cuda":
            raise ValueError(
                f"memory_budget plans CUDA device memory; this model runs on {device} "
                "(pass a MemoryPlanner with device_memory= to plan another device)"
            )
        return CudaMemory(device)

    def check_held(self, held: int) -> None:
        """``ValueError`` when a budget in bytes is not above ``held`` (what the model holds already)."""
        if isinstance(self.memory_budget, int) and self.memory_budget <= held:
            raise ValueError(
                f"memory_budget={self.memory_budget} ({format_bytes(self.memory_budget)}) is not above the "
                f"{format_bytes(held)} the model already holds on its device"
            )

    def begin_step(self, tokens: int, device: torch.device) -> None:
        """Call at the start of every training forward (``tokens``: the forward's, padding included): starts
        the measurement, makes the plan at the first forward after a backward (the first step spans every
        forward before it: their activations count in its peak), plans again for a larger forward."""
        tokens = int_arg("tokens", tokens, minimum=1)
        if not self._layers:
            return
        if self._stage == _PLANNED:
            if tokens > self.plan.tokens:
                self._replan(tokens)
            return
        if self._stage == _MEASURING:
            self._watched |= self._watching
            self._watching = False
            # no backward yet (several forwards before one), or nothing measured: the step goes on
            self._make_plan(tokens)
            return
        memory = self._memory = self.memory(device)
        self._device = device
        self.check_held(memory.allocated())
        self._samples.clear()
        self._backward, self._watching, self._watched = [False], False, False
        self._static, self._tokens = memory.allocated(), tokens
        memory.reset_peak()
        self._stage = _MEASURING

    def _make_plan(self, tokens: int) -> bool:
        memory = self._memory
        peak, held = memory.peak(), memory.allocated()
        budget = self.resolve_budget(memory)
        layers = sorted(self._layers)
        row = []
        for i in layers:
            s = self._samples.get(i)
            if s is None:
                row += [-1.0] * 7
                continue
            forward = min(self.clock.seconds(span) for span in s.spans)
            saved = sum(self.clock.seconds(span) for span in s.saved_spans)
            row += [s.keep / s.tokens, s.saved / s.tokens, s.input / s.tokens, float(s.offloadable)]
            row += [forward / s.tokens, saved / s.tokens, float(s.tokens)]
        seen = self._backward[0] or not self._watched
        above = (peak - self._static) / self._tokens
        head = [float(held), above, float(-budget), float(not seen), float(-len(self._samples)), float(tokens)]
        agreed = _agree(head + row, self._device)
        held, above, budget = int(agreed[0]), agreed[1], int(-agreed[2])
        if agreed[3] > 0 or agreed[4] == 0:  # a rank saw no backward, or no layer was measured
            return False
        costs = []
        for n, i in enumerate(layers):
            keep, selective, inp, offloadable, forward, saved, _ = agreed[6 + 7 * n : 13 + 7 * n]
            if keep < 0:
                continue
            choices = tuple(c for c in self._layers[i][0] if c in self.choices)
            if not offloadable:
                selective += inp
            costs.append(LayerCost(i, keep, selective, inp, bool(offloadable), forward, saved, choices))
        self.costs = _fastest_of_kind(costs, {i: self._layers[i][1] for i in layers})
        self._floor = (held, above)
        self._budget_bytes = budget
        target = max(self.max_tokens or 0, self._tokens, int(agreed[5]))
        floor_peak = self._floor_peak(target)
        if floor_peak > budget and self.memory_budget != "auto":
            raise ValueError(
                f"memory_budget={self.memory_budget!r} ({format_bytes(budget)}) is below what full recompute needs "
                f"for {target} tokens per step: {format_bytes(floor_peak)} (measured on the first step: "
                f"{format_bytes(held)} held outside a step, {format_bytes(above * self._tokens)} more at its peak "
                f"for {self._tokens} tokens)"
            )
        self.plan = plan_memory(
            self.costs,
            tokens=target,
            budget=max(budget, floor_peak),
            floor_peak=floor_peak,
            host_bandwidth=self.host_bandwidth,
        )
        self._stage = _PLANNED
        _log.info("%s", self.plan)
        return True

    def _floor_peak(self, tokens: int) -> int:
        held, above = self._floor
        return int(held + above * tokens)

    def resolve_budget(self, memory) -> int:
        """The budget in bytes on the device ``memory`` (``CudaMemory``) describes."""
        if isinstance(self.memory_budget, int):
            return self.memory_budget
        reachable, total = memory.capacity()
        if isinstance(self.memory_budget, float):
            return int(self.memory_budget * total)
        return int(reachable - max(1 << 30, AUTO_MARGIN * total))

    def plan_for(self, tokens: int) -> MemoryPlan:
        """The plan for ``tokens`` per step from the measured costs (after the first step), without putting
        it in force; ``ValueError`` when full recompute does not fit the budget there."""
        if not self.costs:
            raise RuntimeError("nothing measured yet: the plan is made at the second training step")
        floor_peak = self._floor_peak(tokens)
        budget = self._budget_bytes
        if self.memory_budget == "auto":
            budget = max(budget, floor_peak)
        return plan_memory(
            self.costs, tokens=tokens, budget=budget, floor_peak=floor_peak, host_bandwidth=self.host_bandwidth
        )

    def _replan(self, tokens: int) -> None:
        try:
            self.plan = self.plan_for(tokens)
        except ValueError:
            self.plan = self.plan_for_floor(tokens)
            if "floor" not in self._warned:
                self._warned.add("floor")
                warnings.warn(
                    f"fastft memory plan: a step of {tokens} tokens needs more than memory_budget="
                    f"{self.memory_budget!r} even with full recompute; running full recompute",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _log.info("%s", self.plan)

    def plan_for_floor(self, tokens: int) -> MemoryPlan:
        """Full recompute for ``tokens`` per step, as a plan."""
        floor_peak = self._floor_peak(tokens)
        return plan_memory(self.costs, tokens=tokens, budget=floor_peak, floor_peak=floor_peak)

    def __repr__(self) -> str:
        return f"MemoryPlanner(memory_budget={self.memory_budget!r}, max_tokens={self.max_tokens!r}, {self._stage})"


def _fastest_of_kind(costs: list, kinds: dict) -> list:
    """``costs`` with each layer's times the fastest of the layers of its kind (``None``: its own)."""
    best: dict = {}
    for c in costs:
        kind = kinds.get(c.layer)
        if kind is not None:
            f, s = best.get(kind, (math.inf, 0.0))
            if c.forward_s < f:
                best[kind] = (c.forward_s, c.saved_s)
    out = []
    for c in costs:
        kind = kinds.get(c.layer)
        if kind is not None:
            f, s = best[kind]
            c = dataclasses.replace(c, forward_s=f, saved_s=min(s, f))
        out.append(c)
    return out


def _agree(values: list, device: torch.device) -> list:
    """``values`` as every rank's largest (``torch.distributed`` initialized with several ranks), else as is;
    under NCCL reduced on ``device``, the one the model trains on (not the current device)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return values
    if dist.get_backend() != "nccl":
        device = torch.device("cpu")
    elif device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
