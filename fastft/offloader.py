"""Move GPU tensors to pinned host memory and back on a side stream, into reusable GPU buffers.

    off = fastft.offloader.Offloader(torch.device("cuda"))   # two GPU buffers (num_buffers=2)
    saved = off.offload(x)        # async device->host copy into pooled pinned memory
    ...
    ticket = off.reload(saved)    # async host->device copy into a free GPU buffer (prefetch)
    x2 = ticket.wait()            # the current stream waits for the copy; x2 == x, same strides

Everything is ordered with CUDA events, never ``record_stream``: a copy waits for an event recorded on the
current stream when it is issued, and the current stream waits for the copy's event before it reads the
result. The Offloader also owns the order of what it offloaded: ``saved.prev`` is the copy offloaded just
before (what a backward pass needs next), which ``fastft.offloaded_checkpoint`` prefetches.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch

from ._checks import int_arg
from .copy import ALIGN, PackLayout, dense, pack, unpack

__all__ = ["Offloader", "PinnedPool", "HostCopy", "Reload"]

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable

# ---- host memory ------------------------------------------------------------------------------------------


class PinnedPool:
    """Reusable page-locked host buffers of exactly the requested size (plain host memory registered with
    ``cudaHostRegister``; torch's pinned allocator would round each one up to a power of two).

    ``take(n)`` returns the smallest free buffer of at least ``n`` bytes, or a new one of exactly ``n``
    bytes, first releasing the free buffers (all too small to serve it) so the pool does not grow with
    varying sizes. Releasing waits for ``stream``, the stream that copies to and from these buffers. If
    registering fails, buffers are pageable from then on, with one warning.
    """

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self._stream = stream
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.pinned = True  # False after a failed registration: pageable memory from then on
        self.held_bytes = 0  # free + in use

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                best = min(fits, key=torch.Tensor.numel)
                self._free = [b for b in self._free if b is not best]
                return best
            if self._free:
                if self._stream is not None:
                    self._stream.synchronize()  # no copy may still use a buffer that is unregistered
                for b in self._free:
                    self._release(b)
                self._free = []
            buf = self._allocate(nbytes)
            self.held_bytes += nbytes
            return buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self.pinned and nbytes:
            # portable: page-locked for every device's context, not only the current device's (the copies run
            # on the stream's device, which need not be the current one)
            error = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE)
            if int(error) != 0:
                self.pinned = False
                warnings.warn(
                    f"fastft: page-locking {nbytes} bytes of host memory failed (CUDA error {int(error)}); "
                    "offloading to pageable memory, which copies several times slower",
                    RuntimeWarning,
                    stacklevel=4,
                )
            else:
                # memory freed while still registered would leave the driver a stale mapping for later
                # allocations at those addresses: unregister when the buffer dies
                weakref.finalize(buf, _unregister, buf.data_ptr())
        return buf

    def _release(self, buf: torch.Tensor) -> None:
        self.held_bytes -= buf.numel()  # dropped: unregistered by its finalizer

    def __del__(self) -> None:
        _synchronize(self._stream)  # the free buffers die next: no copy may still use them


def _synchronize(stream) -> None:
    try:
        if stream is not None:
            stream.synchronize()
    except Exception:  # interpreter shutdown: CUDA may be gone already
        pass


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: CUDA may be gone already
        pass


# ---- offload and reload -------------------------------------------------------------------------------------


class HostCopy:
    """A GPU tensor's bytes in host memory (written asynchronously by ``Offloader.offload``) and how to
    rebuild it: dense tensors keep their memory order and strides; others are packed row-major."""

    def __init__(self, host: torch.Tensor, nbytes: int, layout: PackLayout | None, shape, stride, dtype) -> None:
        self.host = host  # pinned (pooled) uint8, at least nbytes
        self.nbytes = nbytes
        self.layout = layout  # None: dense bytes restored with as_strided
        self.shape, self.stride, self.dtype = shape, stride, dtype
        # the offloaded GPU tensor itself while it is the Offloader's newest: the first reload backward
        # asks for (usually the last layer's input) then needs no copy
        self.on_device: torch.Tensor | None = None
        # the copy the same Offloader made just before this one (weakly: None once it is gone)
        self.prev: weakref.ref | None = None

    def previous(self) -> HostCopy | None:
        """The copy offloaded just before this one by the same Offloader, if it is still alive."""
        return self.prev() if self.prev is not None else None


class Reload:
    """An issued host->device copy. ``wait()`` makes the current stream wait for it and returns the tensor."""

    def __init__(
        self, saved: HostCopy, buffer, event, timeline: list | None, on_device: torch.Tensor | None = None
    ) -> None:
        self.buffer, self.event, self._timeline = buffer, event, timeline
        self._on_device = on_device  # the offloaded tensor itself: no copy was needed
        self.saved = weakref.ref(saved)  # not kept alive by a ticket: its pinned buffer returns to the pool
        self.nbytes, self.layout = saved.nbytes, saved.layout
        self.shape, self.stride, self.dtype = saved.shape, saved.stride, saved.dtype

    def wait(self) -> torch.Tensor:
        if self._on_device is not None:
            return self._on_device
        stream = torch.cuda.current_stream(self.buffer.device)
        if self._timeline is None:
            stream.wait_event(self.event)
        else:  # the time the current stream sits waiting for the copy
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(self.event)
            after.record(stream)
            self._timeline.append(("stall", before, after))
        data = self.buffer[: self.nbytes]
        if self.layout is None:
            return data.view(self.dtype).as_strided(self.shape, self.stride)
        return unpack(data, self.layout)[0]


class Offloader:
    """Moves GPU tensors to pooled pinned host memory and back, on one side stream per device, into
    ``num_buffers`` reusable GPU buffers (2: double buffering, so one reload can fill a buffer while the
    other buffer's tensor is in use).

    A buffer is refilled only when nothing else references the tensor last reloaded into it; otherwise a
    fresh buffer takes its place (``stats['fresh_buffers']`` counts these), so a reloaded tensor is never
    overwritten while it is in use.
    """

    def __init__(self, device: torch.device | str, num_buffers: int = 2) -> None:
        device = torch.device(device)
        int_arg("num_buffers", num_buffers, minimum=1)
        if device.type != "cuda":
            raise ValueError(f"Offloader needs a CUDA device, got {device}")
        if not torch.cuda.is_available():
            raise ValueError(f"Offloader needs a CUDA device, and this torch sees none (asked for {device})")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.copy_stream = torch.cuda.Stream(self.device)
        self.pool = PinnedPool(self.copy_stream)
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self._base_use: list[int] = [0] * num_buffers
        self._resident: list[Reload | None] = [None] * num_buffers  # the last reload issued into each buffer
        self._next = 0
        self._pending: list[tuple[torch.cuda.Event, object]] = []  # device->host copies still reading GPU memory
        self._newest: HostCopy | None = None  # the last offloaded tensor, kept on the GPU (HostCopy.on_device)
        self._last: weakref.ref | None = None  # the last HostCopy made, weakly: the next one's ``prev``
        self._lock = threading.Lock()
        self.stats = {"offloaded_bytes": 0, "reloads": 0, "reused_reloads": 0, "kept_on_device": 0, "fresh_buffers": 0}
        # set to a list to record timing events: ("copy", start, end) per reload on the copy stream and
        # ("stall", before, after) per wait on the current stream (benchmarks: how much copy time is hidden)
        self.timeline: list | None = None

    def __del__(self) -> None:
        _synchronize(getattr(self, "copy_stream", None))  # the GPU buffers return to the allocator next

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    def _ordered_after_current(self) -> torch.cuda.Stream:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.copy_stream.wait_event(event)
        return self.copy_stream

    def release_finished(self) -> None:
        """Drop the GPU tensors that issued device->host copies read from, after making the current stream
        wait for those copies (so their memory is reused only after the copies)."""
        current = torch.cuda.current_stream(self.device)
        with self._lock:
            pending, self._pending = self._pending, []
        for event, _ in pending:
            current.wait_event(event)

    def offload(self, tensor: torch.Tensor) -> HostCopy:
        """Start copying ``tensor`` (on this device) to pinned host memory; returns its ``HostCopy``."""
        if tensor.device != self.device:
            raise ValueError(f"tensor is on {tensor.device}, this Offloader on {self.device}")
        self.release_finished()  # the previous copies had a whole layer's compute to finish
        self._drop_newest()
        shape, stride = tuple(tensor.shape), tuple(tensor.stride())
        if dense(shape, stride):
            layout = None
            nbytes = tensor.numel() * tensor.element_size()
            src = tensor.detach().as_strided((tensor.numel(),), (1,), tensor.storage_offset()).view(torch.uint8)
        else:
            src, layout = pack([tensor.detach()])
            nbytes = layout.nbytes
        host = self.pool.take(nbytes)
        done = torch.cuda.Event()
        with torch.cuda.stream(self._ordered_after_current()):
            host[:nbytes].copy_(src, non_blocking=True)
            done.record()
        with self._lock:
            self._pending.append((done, src))
        self.stats["offloaded_bytes"] += nbytes
        saved = HostCopy(host, nbytes, layout, shape, stride, tensor.dtype)
        weakref.finalize(saved, self.pool.give, host)
        saved.on_device = tensor.detach()
        saved.prev = self._last
        self._newest = saved
        self._last = weakref.ref(saved)
        return saved

    def _drop_newest(self) -> None:
        # called after release_finished: the current stream already waits for its device->host copy
        if self._newest is not None:
            self._newest.on_device = None
            self._newest = None

    def _in_use(self, i: int) -> bool:
        return torch._C._storage_Use_Count(self._buffers[i].untyped_storage()._cdata) > self._base_use[i]

    def reload(self, saved: HostCopy) -> Reload:
        """Start copying ``saved`` back into a GPU buffer; returns the ``Reload`` to ``wait()`` on. A copy
        already issued for ``saved`` and not overwritten since is returned instead of copying again."""
        on_device = saved.on_device
        if on_device is not None:  # still on the GPU: hand it out once, then the host copy serves
            self.release_finished()
            self._drop_newest()
            self.stats["kept_on_device"] += 1
            return Reload(saved, None, None, None, on_device)
        with self._lock:
            for r in self._resident:
                if r is not None and r.saved() is saved:
                    self.stats["reused_reloads"] += 1
                    return r
            i = self._next
            self._next = (i + 1) % len(self._buffers)
            old = self._buffers[i]
            in_use = old is not None and self._in_use(i)
            if old is None or old.numel() < saved.nbytes or in_use:
                if old is not None:
                    if in_use:
                        self.stats["fresh_buffers"] += 1
                    # a pending copy into the dropped buffer must finish before its memory is reused
                    torch.cuda.current_stream(self.device).wait_event(self._resident[i].event)
                size = max(saved.nbytes, old.numel() if old is not None else 0)
                self._buffers[i] = torch.empty(-(-size // ALIGN) * ALIGN, dtype=torch.uint8, device=self.device)
                self._buffers[i].untyped_storage()  # settle the count before taking the baseline
                self._base_use[i] = torch._C._storage_Use_Count(self._buffers[i].untyped_storage()._cdata)
            buffer = self._buffers[i]
            timeline = self.timeline
            event = torch.cuda.Event(enable_timing=timeline is not None)
            with torch.cuda.stream(self._ordered_after_current()):
                if timeline is not None:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record()
                buffer[: saved.nbytes].copy_(saved.host[: saved.nbytes], non_blocking=True)
                event.record()
            if timeline is not None:
                timeline.append(("copy", start, event))
            reload = self._resident[i] = Reload(saved, buffer, event, timeline)
            self.stats["reloads"] += 1
            return reload
