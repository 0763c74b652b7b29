"""What a layer costs, measured on the first training step (``fastft.memory_planner`` plans from it).

``measure_layer`` runs a layer's forward once more and drops its result (the random state restored, so the
step computes what full recompute does), under a saved-tensor hook that counts the bytes the layer would save
without checkpoint (parameters excluded, each storage once, in the CUDA allocator's 512-byte blocks; held until
the forward ends, as its recomputation in backward holds them) and a dispatch mode (``SavedOps``) that counts
the bytes, times and copies the results selective checkpointing saves (a copy that differs at the end shows a
result written into later). ``Clock`` times spans (CUDA events, read at planning); ``CudaMemory`` reads the
device's memory. Tests inject their own clock and memory.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .selective_checkpoint import op_results, saved_by_selective

__all__ = ["Clock", "CudaMemory", "SavedOps", "LayerSample", "allocated_bytes", "measure_layer"]


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


class SavedOps(TorchDispatchMode):
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
        self.calls.append((key, [(t, t.clone()) for t in op_results(out)], span))
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
class LayerSample:
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


def measure_layer(function, args, kwargs, module, clock: Clock, device: torch.device) -> tuple[int, tuple, object]:
    """Run ``function(*args, **kwargs)`` once more and drop its result: (bytes it saves for backward,
    ``SavedOps.result()``, its forward span). At its end it holds what one recomputation in backward holds."""
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
        # kept until the forward's result is dropped, so that no storage is counted at a reused address; detached,
        # since a node holding its own output (as returned here) would be a cycle no garbage collection frees
        return t.detach()

    devices = [device] if device.type == "cuda" else []
    meter = SavedOps(clock, device)
    with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token = clock.start(device, "forward")
        with meter:
            out = function(*args, **kwargs)
        span = clock.stop(token)
    result = meter.result()
    del out, meter
    return total[0], result, span
