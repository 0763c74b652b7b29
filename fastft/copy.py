"""Copy/compute overlap helpers: pack tensors into one staging buffer, and move GPU tensors to pinned host
memory and back on a side stream.

    buffer, layout = fastft.copy.pack([a, b])        # uint8 [layout.nbytes]: a then b, row-major
    a2, b2 = fastft.copy.unpack(buffer, layout)      # new tensors, the originals' shapes/dtypes/strides

    off = fastft.copy.Offloader(torch.device("cuda"))   # two GPU buffers (num_buffers=2)
    saved = off.offload(x)        # async device->host copy into pooled pinned memory
    ...
    ticket = off.reload(saved)    # async host->device copy into a free GPU buffer (prefetch)
    x2 = ticket.wait()            # the current stream waits for the copy; x2 == x, same strides

``pack``/``unpack`` are dispatched like every fastft op (Triton kernel on GPUs, the torch reference in
fastft/reference/copy.py otherwise). ``Offloader`` orders everything with CUDA events, never
``record_stream``: a copy waits for an event recorded on the current stream when it is issued, and the
current stream waits for the copy's event before it reads the result.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref

import torch

from . import autotune, dispatch
from .reference import copy as reference

OP_PACK = dispatch.register("copy.pack")
OP_UNPACK = dispatch.register("copy.unpack")
autotune.DEFAULTS.update({OP_PACK: {"BLOCK": 2048, "num_warps": 8}, OP_UNPACK: {"BLOCK": 2048, "num_warps": 8}})
autotune.INTERPRETER.update({OP_PACK: {"BLOCK": 64}, OP_UNPACK: {"BLOCK": 64}})

ALIGN = 16  # bytes: every entry starts at a multiple of this


@dataclasses.dataclass(frozen=True)
class PackEntry:
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # the packed tensor's strides; unpack gives its outputs these where possible
    dtype: torch.dtype
    offset: int  # byte offset in the buffer, a multiple of ALIGN
    nbytes: int


@dataclasses.dataclass(frozen=True)
class PackLayout:
    entries: tuple[PackEntry, ...]
    nbytes: int  # buffer size: the last entry's end

    @staticmethod
    def of(tensors) -> "PackLayout":
        entries, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(PackEntry(tuple(t.shape), tuple(t.stride()), t.dtype, offset, nbytes))
            offset += nbytes
            end = offset
            offset = -(-offset // ALIGN) * ALIGN
        return PackLayout(tuple(entries), end if entries else 0)


def non_overlapping(shape, stride) -> bool:
    """True when no two indices of a tensor with these shape and strides share a memory location
    (a sufficient test: dimensions sorted by stride each step past the span of the smaller ones)."""
    span = 0
    for st, size in sorted((s, z) for z, s in zip(shape, stride) if z > 1):
        if st <= span:
            return False
        span += (size - 1) * st
    return True


def dense(shape, stride) -> bool:
    """True when the tensor's elements fill ``numel`` consecutive memory locations (any dimension order)."""
    expected = 1
    for st, size in sorted((s, z) for z, s in zip(shape, stride) if z > 1):
        if st != expected:
            return False
        expected *= size
    return True


def _check_tensors(tensors, name: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
        if t.device != tensors[0].device:
            raise ValueError(f"{name}[{i}] is on {t.device}, {name}[0] on {tensors[0].device}: one device expected")
    return tensors


def _copy(src: torch.Tensor, dst: torch.Tensor, op: str, backend: str) -> None:
    if backend == "triton":
        from .kernels import copy as kernels

        if kernels.strided_copy(src, dst, **autotune.params(op, src.device, src.numel() * src.element_size())):
            return
    dst.copy_(src)  # torch backend, or more dimensions than the kernel takes


def pack(tensors, *, out: torch.Tensor | None = None, backend: str | None = None) -> tuple[torch.Tensor, PackLayout]:
    """(uint8 buffer, layout): every tensor's elements in row-major order at its layout offset.

    ``out``: a uint8 1-D tensor of at least ``layout.nbytes`` bytes on the tensors' device to pack into.
    """
    tensors = _check_tensors(tensors, "tensors")
    layout = PackLayout.of(tensors)
    device = tensors[0].device if tensors else (out.device if out is not None else torch.device("cpu"))
    if out is None:
        out = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    elif not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1 or out.device != device:
        raise ValueError(f"out must be a 1-D uint8 tensor on {device}")
    elif out.numel() < layout.nbytes or not out.is_contiguous() or out.data_ptr() % ALIGN:
        raise ValueError(f"out must be contiguous, {ALIGN}-byte aligned and hold {layout.nbytes} bytes, got {out.numel()}")
    chosen = dispatch.backend_for(OP_PACK, device, backend) if tensors else "torch"
    if chosen == "torch":
        return reference.pack(tensors, layout, out), layout
    for t, entry in zip(tensors, layout.entries):
        region = out[entry.offset:entry.offset + entry.nbytes].view(t.dtype).view(t.shape)
        _copy(t, region, OP_PACK, chosen)
    return out, layout


def unpack(buffer: torch.Tensor, layout: PackLayout, *, out=None, backend: str | None = None) -> list[torch.Tensor]:
    """The tensors ``pack`` wrote to ``buffer``. Into ``out`` (tensors of the layout's shapes and dtypes,
    any non-overlapping strides) if given, else into new tensors with the packed tensors' strides
    (contiguous where those strides overlapped)."""
    if not isinstance(layout, PackLayout):
        raise TypeError(f"layout must be a PackLayout, got {type(layout).__name__}")
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("buffer must be a 1-D uint8 tensor")
    if buffer.numel() < layout.nbytes or not buffer.is_contiguous() or buffer.data_ptr() % ALIGN:
        raise ValueError(f"buffer must be contiguous, {ALIGN}-byte aligned and hold {layout.nbytes} bytes, got {buffer.numel()}")
    if out is None:
        out = [
            torch.empty_strided(e.shape, e.stride, dtype=e.dtype, device=buffer.device)
            if non_overlapping(e.shape, e.stride) else torch.empty(e.shape, dtype=e.dtype, device=buffer.device)
            for e in layout.entries
        ]
    else:
        out = _check_tensors(out, "out")
        if len(out) != len(layout.entries):
            raise ValueError(f"out has {len(out)} tensors, the layout {len(layout.entries)}")
        for i, (o, e) in enumerate(zip(out, layout.entries)):
            if tuple(o.shape) != e.shape or o.dtype != e.dtype or o.device != buffer.device:
                raise ValueError(f"out[{i}] must be {e.dtype} {list(e.shape)} on {buffer.device}, got {o.dtype} {list(o.shape)} on {o.device}")
            if not non_overlapping(o.shape, o.stride()):
                raise ValueError(f"out[{i}] has overlapping strides {o.stride()}")
    chosen = dispatch.backend_for(OP_UNPACK, buffer.device, backend) if out else "torch"
    if chosen == "torch":
        return reference.unpack(buffer, layout, out)
    for o, e in zip(out, layout.entries):
        _copy(buffer[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape), o, OP_UNPACK, chosen)
    return out


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
            error = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            if int(error) != 0:
                self.pinned = False
                warnings.warn(f"fastft: page-locking {nbytes} bytes of host memory failed (CUDA error {int(error)}); offloading to pageable memory, which copies several times slower", RuntimeWarning, stacklevel=4)
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


class Reload:
    """An issued host->device copy. ``wait()`` makes the current stream wait for it and returns the tensor."""

    def __init__(self, saved: HostCopy, buffer, event, timeline: list | None, on_device: torch.Tensor | None = None) -> None:
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
        data = self.buffer[:self.nbytes]
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
        if isinstance(num_buffers, bool) or not isinstance(num_buffers, int) or num_buffers < 1:
            raise ValueError(f"num_buffers must be an int >= 1, got {num_buffers!r}")
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
        self._newest = saved
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
                buffer[:saved.nbytes].copy_(saved.host[:saved.nbytes], non_blocking=True)
                event.record()
            if timeline is not None:
                timeline.append(("copy", start, event))
            reload = self._resident[i] = Reload(saved, buffer, event, timeline)
            self.stats["reloads"] += 1
            return reload
