"""Memory plan: for each checkpointed layer, keep, selective, recompute or offload, chosen from the first
step's measured bytes and times to fit a memory budget in the least time.

    planner = fastft.memory_plan.MemoryPlanner("auto", max_tokens=16384)
    layer_fn = planner.layer_function(i, fastft.offloaded_checkpoint)   # each layer's checkpoint function
    planner.begin_step(tokens, device)                                  # at every training forward's start

(``fastft.integrations.transformers.apply(model, memory_budget=...)`` does both.)

Choices, from most memory and least time to least memory and most time:

- ``keep``: no checkpoint; the layer's forward saves what autograd needs (norms, casts, activations...).
- ``selective``: checkpointed, and selective activation checkpointing inside (torch's design, fastft's two
  dispatch modes, ``selective_context``): the results of the GEMMs (matmuls whose reduction dim is at least
  an eighth of their output width: not LoRA's rank-r up projection; an in-place GEMM such as ``addmm_``
  too, its result written back in recomputation), of attention without dropout and of fastft's delta-rule
  scan are saved, the cheap rest recomputed. A result something writes into later in the layer (an
  in-place op, or a kernel autograd does not see) is found on the first step and recomputed instead.
- ``recompute``: checkpointed, its input kept on the device.
- ``offload``: checkpointed, its input in pinned host memory (``fastft.offloaded_checkpoint``); where the
  input is not offloaded (a CPU tensor, a small input, ``OffloadConfig(enabled=False)``) it is
  ``recompute``. Every layer at ``offload`` (else ``recompute``) is *full recompute*, the floor: the plan
  never needs more memory than a step of it.

Measurement (the first training step, which runs at the floor): each planned layer's forward runs once more,
its results discarded (the random state restored, so the step computes what full recompute does), under a
saved-tensor hook that counts the bytes the layer would save without checkpoint (parameters excluded, each
storage once, in the CUDA allocator's 512-byte blocks; held until the forward ends, as its recomputation in
backward holds them) and a dispatch mode that counts the bytes, times and copies the results selective
saves (a copy that differs at the end shows a result written into later). The floor call
is timed too (CUDA events, read at planning). Device memory: the bytes held when the step starts and the
peak through its backward (the peak counter is reset once, at the first step's start); held again when the
second step starts (optimizer state now included). Everything per token: the plan is made for
``max(max_tokens, tokens of every step seen)`` and made again when a larger step comes.

Cost model, per layer (``T`` tokens; ``f``: forward time, ``s``: time of the ops selective saves, both the
fastest of the layers of one kind, which drops one-time costs such as compiling kernels):

- added time: keep 0; selective ``max(f - s, f / 20)``; recompute ``f``; offload ``f`` plus the part of the
  input's copy (at ``host_bandwidth``) longer than ``f``, plus ``f / 100`` (recompute wins where both fit);
- device bytes held from forward to backward: keep and selective as measured (selective: saved outputs plus
  the input unless it is offloaded); recompute the input; offload none.
- expected peak: the floor's (held at the second step's start, plus the first step's peak above what it held
  then, times ``T`` over the first step's tokens) plus every layer's bytes above its floor's.

The plan is the least added time whose expected peak fits the budget (a multiple-choice knapsack, solved
exactly over the budget in ``RESOLUTION`` steps, each layer's bytes rounded up). Budget: bytes (an int), a
fraction of the device's memory (a float in (0, 1]), or ``"auto"``: what the process can reach (free plus
what torch holds) less ``max(1 GiB, AUTO_MARGIN of the device)`` for fragmentation. With
``torch.distributed`` initialized every rank plans from the largest numbers of all ranks (one all-reduce,
at the second step's start), so that every rank makes the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
import time
import warnings

import numpy as np
import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from ._checks import int_arg, is_int
from .offload import OffloadConfig, check_offload_config, offloaded_checkpoint, offloader_for

__all__ = [
    "KEEP",
    "SELECTIVE",
    "RECOMPUTE",
    "OFFLOAD",
    "CHOICES",
    "MemoryPlanner",
    "MemoryPlan",
    "LayerChoice",
    "LayerCost",
    "plan_memory",
    "check_memory_budget",
]

KEEP, SELECTIVE, RECOMPUTE, OFFLOAD = "keep", "selective", "recompute", "offload"
CHOICES = (KEEP, SELECTIVE, RECOMPUTE, OFFLOAD)  # most memory, least time first
RESOLUTION = 4096  # steps the knapsack splits the available bytes into
AUTO_MARGIN = 0.08  # of the device's memory, kept free by memory_budget="auto" (at least 1 GiB)
HOST_BANDWIDTH = 16e9  # bytes/s of a device-host copy, for offload's cost
_GIB = 1 << 30
_log = logging.getLogger(__name__)

# ---- selective checkpointing -------------------------------------------------------------------------------

_MATMULS = {  # op -> positions of its two operands
    "aten::mm": (0, 1),
    "aten::bmm": (0, 1),
    "aten::addmm": (1, 2),
    "aten::addmm_": (1, 2),
    "aten::baddbmm": (1, 2),
    "aten::baddbmm_": (1, 2),
    "aten::_scaled_mm": (0, 1),
    "aten::_grouped_mm": (0, 1),
}
_IN_PLACE = {"aten::addmm_", "aten::baddbmm_"}  # write their result into their first argument
_SAVED = {  # attention forwards and fastft's scans: saved unless they draw random numbers
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "torch_attn::_varlen_attn",
    "fastft::delta_rule_chunk_scan",
}


def saved_by_selective(func, args, kwargs=None) -> bool:
    """Whether selective checkpointing saves the result of op ``func`` called with ``args``/``kwargs`` (see the
    module docstring). Never an op with dropout: skipping it in the recomputation would shift the random
    numbers every later op draws; never one that writes into an argument, but an in-place GEMM (``addmm_``)."""
    schema = func._schema
    name = schema.name
    if name in _SAVED:
        for i, arg in enumerate(schema.arguments):
            if arg.name == "dropout_p":
                p = (kwargs or {}).get("dropout_p", args[i] if i < len(args) else 0.0)
                return not p
        return True
    operands = _MATMULS.get(name)
    if operands is None or (schema.is_mutable and name not in _IN_PLACE):
        return False
    a, b = args[operands[0]], args[operands[1]]
    return 8 * a.shape[-1] >= b.shape[-1]


class _Selective(TorchDispatchMode):
    """Selective checkpointing, as two dispatch modes sharing ``store``: in the forward (``replay=False``) the
    results of the ops ``saved_by_selective`` picks (but the calls in ``skip``: something writes into their
    results later in the layer) are kept; in the recomputation those ops return them instead of running (an
    in-place GEMM writes its kept result into its argument). A kept result modified in place after all is a
    ``RuntimeError`` in the recomputation."""

    def __init__(self, store: dict, replay: bool, skip: frozenset) -> None:
        super().__init__()
        self.store, self.replay, self.skip = store, replay, skip
        self.counts: dict = {}
        self.pending: list = []  # kept results whose versions are read at the next op (autograd bumps an
        # in-place op's version after this mode returns)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        while self.pending:
            tensors = self.pending.pop()
            tensors[:] = [(t, t._version) for t, _ in tensors]
        if not saved_by_selective(func, args, kwargs):
            return func(*args, **kwargs)
        key = (func, self.counts.get(func, 0))
        self.counts[func] = key[1] + 1
        if key in self.skip:
            return func(*args, **kwargs)
        if not self.replay:
            out = func(*args, **kwargs)
            tensors = [(t.detach(), None) for t in _tensors(out)]
            self.store[key] = tensors, out
            self.pending.append(tensors)
            return out
        kept = self.store.pop(key, None)
        if kept is None:  # recomputed a second time (backward with retain_graph): run it
            return func(*args, **kwargs)
        tensors, out = kept
        if any(v is not None and t._version != v for t, v in tensors):
            raise RuntimeError(
                f"fastft selective checkpointing: the result of {func} was modified in place after it was saved"
            )
        if func._schema.name in _IN_PLACE:
            return args[0].copy_(tensors[0][0])
        return out


def _tensors(out) -> list:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def selective_context(skip: frozenset = frozenset()):
    """A checkpoint ``context_fn``: selective checkpointing (see ``_Selective``); ``skip``: op calls
    (``(op, nth call)``) not to save."""
    store: dict = {}
    return _Selective(store, False, skip), _Selective(store, True, skip)


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


# ---- measurement ------------------------------------------------------------------------------------------


class Clock:
    """Times spans of work on a device: CUDA events on a GPU (read, with one sync, when planning), the host's
    clock elsewhere. ``start(device, label)`` -> token, ``stop(token)`` -> span, ``seconds(span)``; ``label``
    names what is timed (``"forward"``, ``"saved_op"``), for clocks that tests inject."""

    def start(self, device: torch.device, label: str):
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return device, event
        return device, time.perf_counter()

    def stop(self, token):
        device, begin = token
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return begin, event
        return begin, time.perf_counter()

    def seconds(self, span) -> float:
        begin, end = span
        if isinstance(end, torch.cuda.Event):
            end.synchronize()
            return begin.elapsed_time(end) / 1e3
        return end - begin


class CudaMemory:
    """A CUDA device's memory as the planner reads it (tests inject an object with these methods)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        """Bytes held by tensors now."""
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        """The most bytes held by tensors since ``reset_peak``."""
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def capacity(self) -> tuple[int, int]:
        """(bytes this process can hold: the device's free memory plus what torch's allocator reserved, the
        device's total memory)."""
        free, total = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device), total


class _SavedOps(TorchDispatchMode):
    """Records the results of the ops selective checkpointing saves (and a copy of each), and times them."""

    def __init__(self, clock: Clock, device: torch.device) -> None:
        super().__init__()
        self.clock, self.device = clock, device
        self.calls: list = []  # (key, [(result tensor, its copy)], span)
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not saved_by_selective(func, args, kwargs):
            return func(*args, **kwargs)
        key = (func, self.counts.get(func, 0))
        self.counts[func] = key[1] + 1
        token = self.clock.start(self.device, "saved_op")
        out = func(*args, **kwargs)
        span = self.clock.stop(token)
        self.calls.append((key, [(t, t.clone()) for t in _tensors(out)], span))
        return out

    def result(self) -> tuple[int, list, frozenset]:
        """(bytes selective keeps, the spans of the ops it skips in recomputation, the calls it must not save:
        their results were written into later, by an op or a kernel that autograd does not see)."""
        pairs = [(key, t, copy) for key, outs, _ in self.calls for t, copy in outs]
        changed = []
        if pairs:
            changed = torch.stack([(t != copy).any() for _, t, copy in pairs]).tolist()  # one sync
        skip = frozenset(key for (key, _, _), c in zip(pairs, changed) if c)
        kept = [(outs, span) for key, outs, span in self.calls if key not in skip]
        storages = {
            t.untyped_storage().data_ptr(): allocated_bytes(t.untyped_storage().nbytes())
            for outs, _ in kept
            for t, _ in outs
        }
        return sum(storages.values()), [span for _, span in kept], skip


@dataclasses.dataclass
class _Sample:
    """One layer's first-step measurement, in bytes and unread spans."""

    tokens: int
    keep: int  # bytes its forward saves without checkpoint
    saved: int  # bytes of the results selective keeps
    skip: frozenset  # selective's op calls not to save
    input: int  # bytes of its input
    offloadable: bool  # whether its input goes to host memory at the floor
    spans: list  # forward spans: the floor call's and the measurement forward's
    saved_spans: list  # the saved ops' spans


def allocated_bytes(nbytes: int) -> int:
    """What a storage of ``nbytes`` takes from torch's CUDA caching allocator (blocks of 512 bytes)."""
    return -(-nbytes // 512) * 512


def _storages(module) -> set:
    """The data pointers of a module's parameters and buffers (skipping sharded ``DTensor`` ones: FSDP2 swaps
    in the unsharded ones for its forward)."""
    found = set()
    for t in (*module.parameters(), *module.buffers()) if module is not None else ():
        try:
            found.add(t.untyped_storage().data_ptr())
        except RuntimeError:
            continue
    return found


def _measure(function, args, kwargs, module, clock: Clock, device: torch.device) -> tuple[int, tuple, object]:
    """Run ``function(*args, **kwargs)`` once more and drop its result: (bytes it saves for backward,
    ``_SavedOps.result()``, its forward span). At its end it holds what one recomputation in backward holds."""
    exclude: list = []  # read in the forward: FSDP2 (transformers < 5.24) unshards inside ``function``
    seen: set = set()
    total = [0]

    def pack(t):
        if not exclude:
            exclude.append(_storages(module))
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude[0] and ptr not in seen:
            seen.add(ptr)
            total[0] += allocated_bytes(storage.nbytes())
        return t  # kept until the forward's result is dropped, so that no storage is counted at a reused address

    devices = [device] if device.type == "cuda" else []
    meter = _SavedOps(clock, device)
    with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token = clock.start(device, "forward")
        with meter:
            out = function(*args, **kwargs)
        span = clock.stop(token)
    result = meter.result()
    del out, meter
    return total[0], result, span


# ---- planning ---------------------------------------------------------------------------------------------


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


def _size(n: float) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
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
            f"fastft memory plan for {self.tokens} tokens: budget {_size(self.budget)}, expected peak "
            f"{_size(self.peak)} (full recompute {_size(self.floor_peak)}); recompute per step "
            f"{self.seconds * 1e3:.1f} ms (full recompute {self.floor_seconds * 1e3:.1f} ms)",
            f"{'layer':>5}  {'choice':<9}  {'held':>10}  {'added ms':>8}",
        ]
        lines += [f"{c.layer:>5}  {c.choice:<9}  {_size(c.bytes):>10}  {c.seconds * 1e3:>8.2f}" for c in self.layers]
        return "\n".join(lines)


def plan_memory(
    costs, *, tokens: int, budget: int, floor_peak: int, host_bandwidth: float = HOST_BANDWIDTH
) -> MemoryPlan:
    """The plan of least added time for ``tokens`` per step whose expected peak (``floor_peak`` plus each
    layer's bytes above its floor's) is at most ``budget``; ``ValueError`` when ``floor_peak`` exceeds it."""
    costs = list(costs)
    tokens = int_arg("tokens", tokens, minimum=1)
    if floor_peak > budget:
        raise ValueError(f"the budget ({_size(budget)}) is below full recompute's expected peak ({_size(floor_peak)})")
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


# ---- the planner ------------------------------------------------------------------------------------------

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
        self.choices = _choices_arg(choices)
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
        self._samples: dict[int, _Sample] = {}
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
        self._layers[layer] = (_choices_arg(choices), kind)
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
        keep, (saved, saved_spans, skip), span = _measure(function, args, kwargs, module, self.clock, x.device)
        token = self.clock.start(x.device, "forward")
        out = run_choice(floor, checkpoint, function, *args, offload_config=config, **kwargs)
        self._samples[layer] = _Sample(
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
                f"memory_budget={self.memory_budget} ({_size(self.memory_budget)}) is not above the "
                f"{_size(held)} the model already holds on its device"
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
        agreed = _agree(head + row)
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
                f"memory_budget={self.memory_budget!r} ({_size(budget)}) is below what full recompute needs for "
                f"{target} tokens per step: {_size(floor_peak)} (measured on the first step: {_size(held)} held "
                f"outside a step, {_size(above * self._tokens)} more at its peak for {self._tokens} tokens)"
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
        return int(reachable - max(_GIB, AUTO_MARGIN * total))

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


def _choices_arg(choices) -> tuple:
    if isinstance(choices, str) or not all(isinstance(c, str) for c in choices):
        raise TypeError(f"choices must be a sequence of strings among {CHOICES}, got {choices!r}")
    bad = [c for c in choices if c not in CHOICES]
    if bad:
        raise ValueError(f"choices must be among {CHOICES}, got {bad}")
    return tuple(choices)


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


def _agree(values: list) -> list:
    """``values`` as every rank's largest (``torch.distributed`` initialized with several ranks), else as is."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return values
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
