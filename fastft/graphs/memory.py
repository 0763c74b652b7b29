"""The memory of fastft's CUDA graphs (``fastft.graphs``): one graph pool and side stream per device, and one
set of static buffers that every signature and layer shares.

- The pool: every layer's graphs are captured into it. A graph keeps nothing alive in it (its outputs are
  copied into static buffers inside the graph), so the pool holds the largest working set of one capture,
  not a sum. A capture's warm-up allocates from it too (``WARM_UP_IN_POOL``, where torch has the bindings).
- Largest first (``LARGEST_FIRST``): the caching allocator does not merge the pool's blocks across segments,
  so a capture larger than every one before can find the free blocks too small and add new ones beside them.
  Before such a capture every graph on the device is dropped with its pool (captured again when next
  called): the largest working set is laid down first, the smaller ones fit inside it.
- Static buffers: each a power of two of elements (its own storage per shape under ``EXACT_BYTES``); a
  signature's buffers are views of their first elements. One that must grow drops every graph as well. A
  forward's outputs and a backward's input gradients share their buffers (``Statics.outputs``).
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch

from ..kernels._launch import next_power_of_2
from ..packing import PackedSeqInfo

EXACT_BYTES = 1 << 20  # static buffers under this size get one storage per shape (theirs never grow)
WARM_UP_IN_POOL = True  # a capture's warm-up allocates from the graph pool (False: from the allocator's cache)
LARGEST_FIRST = True  # a capture with larger inputs than every one in the pool renews the pool first

_pools: dict = {}  # device -> its graph pool
_held: set = set()  # (device, pool) that fastft holds a reference to (see _routing)
_streams: dict = {}  # device -> the side stream of warm-ups and captures
_layers = weakref.WeakSet()  # every layer's graphs by signature (objects with a ``graphs`` dict), see renew
_epochs: dict = {}  # device -> how many times its graphs were all dropped (graphs of an older epoch are stale)
_largest: dict = {}  # device -> the largest input bytes of a capture since the last renewal
_statics: dict = {}  # (signature, layer class, trainable parameters' shapes) -> Statics of this epoch
_slots: dict = {}  # (device, role, index, dtype[, shape]) -> Slot
_watched = 0  # layers registered by watch and not yet collected


def _indexed(device) -> torch.device:
    """``device`` with its index (``cuda`` is the current CUDA device): one key per device in the tables."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def epoch(device: torch.device) -> int:
    """How many times every graph on ``device`` was dropped (a graph of an older epoch is captured again)."""
    return _epochs.get(_indexed(device), 0)


def watch(layer) -> None:
    """Register a layer's graphs (an object whose ``graphs`` dict holds objects with ``statics``) so that
    ``renew`` drops them, and so that the static buffers and pools go once no such layer is left."""
    global _watched
    _layers.add(layer)
    _watched += 1
    weakref.finalize(layer, _unwatch).atexit = False  # at exit the process gives its memory back anyway


def _unwatch() -> None:
    """A watched layer was collected; after the last one (its model dropped) nothing can replay a graph, so
    the static buffers and graph pools are dropped: their memory goes back to the device at the next
    ``torch.cuda.empty_cache``, as the model's does."""
    global _watched
    _watched -= 1
    if _watched:
        return
    _statics.clear()
    _slots.clear()
    _largest.clear()
    for device in list(_pools):
        _epochs[device] = epoch(device) + 1
        _drop_pool(device)


def pool_and_stream(device: torch.device):
    """The device's graph pool and side stream (``(None, None)`` off CUDA)."""
    device = _indexed(device)
    if device.type != "cuda":
        return None, None
    if device not in _pools:
        torch.cuda.empty_cache()  # the pool grows into what the allocator's cache holds, not beside it
        pool = torch.cuda.graph_pool_handle()
        if _routing(device, pool):  # our reference keeps the pool (and its use count) alive between captures
            _end_routing(device, pool)
            _held.add((device, pool))
        _pools[device] = pool
        _streams.setdefault(device, torch.cuda.Stream(device))
    return _pools[device], _streams[device]


def _end_routing(device: torch.device, pool) -> None:
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or torch._C._cuda_endAllocateCurrentStreamToPool
    end(device.index, pool)


def _routing(device: torch.device, pool) -> bool:
    """Route the device's allocations (any stream, any thread: autograd's too) to ``pool`` and take a
    reference to it, where torch has the bindings (``torch.cuda.use_mem_pool``'s own); whether it did."""
    names = ("_cuda_beginAllocateToPool", "_cuda_releasePool")
    ends = ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")
    if (
        not WARM_UP_IN_POOL
        or not all(hasattr(torch._C, n) for n in names)
        or not any(hasattr(torch._C, n) for n in ends)
    ):
        return False
    try:
        torch._C._cuda_beginAllocateToPool(device.index, pool)
    except RuntimeError:
        return False
    return True


@contextlib.contextmanager
def allocating_to_pool(device: torch.device, pool):
    """Within: the device's allocations come from ``pool`` (a capture's warm-up: one working set, not two),
    where fastft holds the pool alive and torch has the bindings; otherwise from the allocator's cache."""
    routed = (device, pool) in _held and _routing(device, pool)
    try:
        yield
    finally:
        if routed:
            _end_routing(device, pool)
            torch._C._cuda_releasePool(device.index, pool)


def _drop_pool(device: torch.device) -> None:
    """Forget the device's pool: what no graph holds of it goes back to the device at the next empty_cache."""
    pool = _pools.pop(device, None)
    if (device, pool) in _held:
        _held.discard((device, pool))
        torch._C._cuda_releasePool(device.index, pool)


def forget_pool(device: torch.device) -> None:
    """After a failed capture (torch leaves the allocator recording into its pool): later captures take a new
    pool and stream."""
    device = _indexed(device)
    _drop_pool(device)
    _streams.pop(device, None)


def renew(device: torch.device) -> None:
    """Drop every graph on ``device`` and its pool (each is captured again on its next call), so that the pool
    keeps one working set, not one per size."""
    device = _indexed(device)
    _epochs[device] = epoch(device) + 1
    _largest.pop(device, None)
    for layer in list(_layers):
        for key in [k for k, g in layer.graphs.items() if g.statics.device == device]:
            del layer.graphs[key]
    for key in [k for k, s in _statics.items() if s.device == device]:
        del _statics[key]
    if device in _pools:
        _drop_pool(device)
        torch.cuda.empty_cache()  # what the dropped graphs held in the old pool goes back to the device


def make_room(device: torch.device, tensors) -> None:
    """Before a capture with input ``tensors``: renew the device's graphs where these are larger than the
    inputs of every capture since the last renewal (``LARGEST_FIRST``, see the module docstring)."""
    device = _indexed(device)
    size = sum(t.numel() * t.element_size() for t in tensors)
    if LARGEST_FIRST and size > _largest.get(device, size):
        renew(device)
    _largest[device] = max(size, _largest.get(device, 0))


class Slot:
    """The storage of one static buffer, which every signature and layer shares, and (for an input) the
    source last copied into it: (weak reference, version counter, (address, shape) of the copy)."""

    def __init__(self) -> None:
        self.base: torch.Tensor | None = None
        self.last = None


def _slot(device, role: str, index: int, numel: int, dtype, exact_shape=None) -> Slot:
    """Slot ``(role, index, dtype[, exact_shape])`` holding at least ``numel`` elements (a power of two of them,
    or exactly ``numel`` for an exact shape); a slot that must grow renews the device's graphs first."""
    key = (device, role, index, dtype) + ((tuple(exact_shape),) if exact_shape is not None else ())
    slot = _slots.setdefault(key, Slot())
    if slot.base is None or slot.base.numel() < numel:
        if slot.base is not None:
            renew(device)
        size = numel if exact_shape is not None else next_power_of_2(numel)
        slot.base = torch.empty(size, dtype=dtype, device=device)
        slot.last = None
    return slot


def _exact(shape, dtype, exact: bool):
    """The shape a static buffer keys its own storage by, or None where it shares a power-of-two slot."""
    return tuple(shape) if exact or math.prod(shape) * dtype.itemsize < EXACT_BYTES else None


def static(device, role: str, index: int, shape, dtype, requires_grad: bool = False, exact: bool = False):
    """(tensor, slot): a contiguous ``shape`` tensor over the first elements of slot ``(role, index, dtype)``'s
    storage, which holds a power of two of elements (its own storage per shape where ``exact`` or small); a
    slot that must grow renews the device's graphs first."""
    slot = _slot(device, role, index, math.prod(shape), dtype, _exact(shape, dtype, exact))
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    t = torch.empty(0, dtype=dtype, device=device).set_(slot.base.untyped_storage(), 0, tuple(shape), strides)
    return t.requires_grad_(requires_grad), slot


class Statics:
    """The static buffers of one signature (views of the shared slots), used by its layers' graphs.
    ``descs``: the signature's description of each argument (``fastft.graphs.policy.describe``)."""

    def __init__(self, leaves, descs, device) -> None:
        self.device, self.descs = device, descs
        self.inputs, self.slots = [], []
        for i, (leaf, desc) in enumerate(zip(leaves, descs)):
            buf = slot = None
            if isinstance(leaf, torch.Tensor):
                buf, slot = static(device, "in", i, leaf.shape, leaf.dtype, leaf.requires_grad)
            elif isinstance(leaf, PackedSeqInfo):
                buf, slot = static(device, "in", i, (desc[4] + 1,), torch.int32)
            self.inputs.append(buf)
            self.slots.append(slot)
        self.epoch = epoch(device)  # after the slots: one of them may have grown
        self.out = self.grad_out = self.grad_in = self.grad_params = None  # set by the first capture

    def outputs(self, outs, diff_out, inputs, diff_in, params) -> None:
        """The output and gradient buffers, for outputs like ``outs``. The forward's outputs and the backward's
        input gradients share the ``result`` slots: each replay's results are copied out before the next
        replay, and neither graph reads the other's."""
        device = self.device
        results = [(i, o.shape, o.dtype) for i, o in enumerate(outs)]
        results += [(k, inputs[i].shape, inputs[i].dtype) for k, i in enumerate(diff_in)]
        for index, shape, dtype in results:  # grown to the larger of the two first: both views see one storage
            if _exact(shape, dtype, False) is None:
                _slot(device, "result", index, math.prod(shape), dtype)
        self.out = [static(device, "result", i, o.shape, o.dtype)[0] for i, o in enumerate(outs)]
        self.grad_out = [static(device, "grad_out", k, outs[i].shape, outs[i].dtype)[0] for k, i in enumerate(diff_out)]
        self.grad_in = [static(device, "result", k, inputs[i].shape, inputs[i].dtype)[0] for k, i in enumerate(diff_in)]
        self.grad_params = [static(device, "param", k, p.shape, p.dtype, exact=True)[0] for k, p in enumerate(params)]

    def forget(self) -> None:
        """The inputs' contents are unknown (a layer changed them): the next load copies every one."""
        for slot in self.slots:
            if slot is not None:
                slot.last = None

    def load(self, leaves) -> None:
        """Copy ``leaves`` into the static inputs, but for an unchanged source copied last time."""
        with torch.no_grad():
            for i, (leaf, buf, slot) in enumerate(zip(leaves, self.inputs, self.slots)):
                if buf is None:
                    continue
                version = leaf._version if isinstance(leaf, torch.Tensor) else None
                last, where = slot.last, (buf.data_ptr(), buf.shape)
                if last is not None and last[0]() is leaf and last[1] == version and last[2] == where:
                    continue
                if isinstance(leaf, torch.Tensor):
                    buf.copy_(leaf)
                else:
                    leaf.padded(buf.numel() - 1, self.descs[i][5], out=buf)
                slot.last = (weakref.ref(leaf), version, where)

    def call_leaves(self, leaves) -> list:
        """The arguments the layer is called with inside a graph: the static inputs, and a fresh info over
        the static ``cu_seqlens`` per call (what the layer derives from it is derived inside the graph; no
        kernel runs to build it)."""
        out = []
        for leaf, buf, desc in zip(leaves, self.inputs, self.descs):
            if isinstance(leaf, PackedSeqInfo):
                buf = leaf.padded(buf.numel() - 1, desc[5], out=buf, fill=False)
            out.append(leaf if buf is None else buf)
        return out


def statics_for(shared, leaves, descs, device) -> Statics:
    """The static buffers of signature ``shared`` (made on first use, and again after a renewal)."""
    statics = _statics.get(shared)
    if statics is None or statics.epoch != epoch(device):
        statics = _statics[shared] = Statics(leaves, descs, device)
    return statics


def static_bytes() -> int:
    """Bytes the static buffers hold, on every device."""
    return sum(s.base.numel() * s.base.element_size() for s in _slots.values() if s.base is not None)
