"""When fastft's CUDA graphs (``fastft.graphs``) capture: a call's signature, and what a layer decided.

- Signature: the tensors' shapes, dtypes, devices and ``requires_grad``; the other arguments' values; a
  ``PackedSeqInfo`` as its token count and two bounds that only grow (sequence count and longest sequence,
  powers of two, at most the token count), which its graph sees it padded to.
- ``policy="auto"``: layers are captured only where their eager forwards are launch-bound: the host took at
  least ``LAUNCH_BOUND`` of the GPU's time on their second calls (the first compiles; both run eagerly). The
  layers of one kind (class and parameter shapes) timed together decide together, on their summed times: a
  stack of like layers is graphed whole or not at all, since one eager layer beside the graphed ones holds its
  working set in the allocator's cache beside the graph pool's copy of it, raising the peak memory
  (docs/benchmarks.md has the measurement).
"""

from __future__ import annotations

import itertools
import time
import weakref

import torch

from ..kernels._launch import next_power_of_2
from ..packing import PackedSeqInfo
from . import memory

LAUNCH_BOUND = 0.7  # policy="auto": graphs where a layer's eager forward takes the host >= this much of the GPU's
POLICIES = ("always", "auto")
_timed: dict = {}  # layer kind (class, parameter shapes) -> [(weakref to LayerGraphs, Probe)] timed and undecided


class LayerGraphs:
    """A graphed layer's graphs by signature, its bounds on packed batches, and what it decided."""

    def __init__(self) -> None:
        self.graphs: dict = {}  # signature -> fastft.graphs.capture.Graphs
        self.warned: set = set()  # reasons already warned about
        self.off: str | None = None  # why this layer runs eagerly from now on
        self.bounds = (1, 1)  # (sequence count, longest sequence) bounds so far, see bounds()
        self.calls = 0  # calls that could replay a graph
        self.captures = 0  # this layer's captures
        self.probe = None  # policy="auto": None, "timed" (after the first eager call), a Probe, or "decided"
        self.eager = False  # policy="auto": the layer is GPU-bound, it runs eagerly
        self.kind = None  # policy="auto": its kind (``kind``), once timed
        memory.watch(self)

    def may_replay(self) -> bool:
        """Whether a later call may still replay graphs (it was not sent to the eager path for good)."""
        return self.off is None and not self.eager


def bounds(state: LayerGraphs, info: PackedSeqInfo) -> tuple[int, int]:
    """(sequence count, longest sequence) bounds of ``info`` for the layer: powers of two that only grow,
    capped at the token count."""
    seqs, longest = state.bounds
    seqs, longest = max(seqs, next_power_of_2(info.num_seqs)), max(longest, next_power_of_2(info.max_seqlen))
    state.bounds = (seqs, longest)
    t = info.num_tokens
    return min(seqs, t), min(longest, t)


def describe(leaf, state: LayerGraphs):
    """A hashable description of one argument for the signature; ``TypeError`` if there is none. An info's:
    ``("info", num_tokens, shape, device, sequence-count bound, longest-sequence bound)``."""
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    if isinstance(leaf, PackedSeqInfo):
        return ("info", leaf.num_tokens, leaf.shape, leaf.device, *bounds(state, leaf))
    hash(leaf)
    return ("value", type(leaf), leaf)


def identity(module: torch.nn.Module) -> tuple:
    """What a captured graph reads of the layer: where each parameter and buffer lives, which train."""
    return tuple((t.data_ptr(), t.requires_grad) for t in itertools.chain(module.parameters(), module.buffers()))


class Probe:
    """Host and GPU time of one eager forward (``policy="auto"``); ``gpu_ms()`` once the GPU is done."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.stream = torch.cuda.current_stream(device)  # the layer's device, not the current one
            self.start.record(self.stream)
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        self.host_ms = (time.perf_counter() - self.t0) * 1000
        if self.cuda:
            self.end.record(self.stream)

    def gpu_ms(self) -> float | None:
        """The call's GPU time (its host time without a GPU), or None while the GPU is not done."""
        if not self.cuda:
            return self.host_ms
        if not self.end.query():
            return None
        return self.start.elapsed_time(self.end)


def kind(module: torch.nn.Module) -> tuple:
    """The layers that decide together under ``policy="auto"``: one class and parameter shapes."""
    return (type(module), tuple((tuple(p.shape), p.dtype) for p in module.parameters()))


def launch_bound(state: LayerGraphs) -> bool:
    """``policy="auto"``: whether the layer's kind was launch-bound when timed (False until known). Decided
    once every layer of its kind timed so far has its GPU time: on their summed host and GPU times."""
    if state.eager:
        return False
    if isinstance(state.probe, Probe):
        cohort = [(ref(), probe) for ref, probe in _timed.get(state.kind, ())]
        times = [(probe.host_ms, probe.gpu_ms()) for _, probe in cohort]
        if all(gpu is not None for _, gpu in times):
            host, gpu = sum(h for h, _ in times), sum(g for _, g in times)
            eager = host / max(gpu, 1e-6) < LAUNCH_BOUND
            for layer, _ in cohort:
                if layer is not None:
                    layer.eager, layer.probe = eager, "decided"
            _timed.pop(state.kind, None)
    return state.probe == "decided" and not state.eager


def timed_eager(state: LayerGraphs, module: torch.nn.Module, device, eager):
    """``policy="auto"`` before the layer is known launch-bound: ``eager()``, timed on the layer's second call."""
    if state.probe == "timed":
        probe = Probe(device)
        out = eager()
        probe.stop()
        state.probe, state.kind = probe, kind(module)
        cohort = [(ref, p) for ref, p in _timed.get(state.kind, ()) if ref() is not None]  # a dropped model's go
        _timed[state.kind] = [*cohort, (weakref.ref(state), probe)]
        return out
    if state.probe is None:
        state.probe = "timed"  # the first call compiles: time the next one
    return eager()
