"""Pack tensors of any shapes, strides and dtypes into one byte buffer, and unpack them again.

    buffer, layout = fastft.copy.pack([a, b])        # uint8 [layout.nbytes]: a then b, row-major
    a2, b2 = fastft.copy.unpack(buffer, layout)      # new tensors, the originals' shapes/dtypes/strides

Dispatched like every fastft op (Triton kernel on GPUs, the torch reference in fastft/reference/copy.py
otherwise). ``fastft.offloader`` uses them to stage non-dense tensors for host copies.
"""

from __future__ import annotations

import dataclasses

import torch

from . import autotune, dispatch
from .reference import copy as reference

__all__ = ["pack", "unpack", "PackLayout", "PackEntry"]

OP_PACK = dispatch.register("copy.pack")
OP_UNPACK = dispatch.register("copy.unpack")
# No grid: one flat copy loop, bandwidth-bound at the defaults.
autotune.register(OP_PACK, autotune.Tunable({"BLOCK": 2048, "num_warps": 8}, interpreter={"BLOCK": 64}))
autotune.register(OP_UNPACK, autotune.Tunable({"BLOCK": 2048, "num_warps": 8}, interpreter={"BLOCK": 64}))

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
    def of(tensors) -> PackLayout:
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
    lazy = src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg()  # views whose values torch resolves
    if backend == "triton" and not lazy:
        from .kernels import copy as kernels

        if kernels.strided_copy(src, dst, **autotune.params(op, src.device, src.numel() * src.element_size())):
            return
    dst.copy_(src)  # torch backend, conjugate or negative views, or more dimensions than the kernel takes


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
        raise ValueError(
            f"out must be contiguous, {ALIGN}-byte aligned and hold {layout.nbytes} bytes, got {out.numel()}"
        )
    chosen = dispatch.backend_for(OP_PACK, device, backend) if tensors else "torch"
    if chosen == "torch":
        return reference.pack(tensors, layout, out), layout
    for t, entry in zip(tensors, layout.entries):
        region = out[entry.offset : entry.offset + entry.nbytes].view(t.dtype).view(t.shape)
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
        raise ValueError(
            f"buffer must be contiguous, {ALIGN}-byte aligned and hold {layout.nbytes} bytes, got {buffer.numel()}"
        )
    if out is None:
        out = [
            torch.empty_strided(e.shape, e.stride, dtype=e.dtype, device=buffer.device)
            if non_overlapping(e.shape, e.stride)
            else torch.empty(e.shape, dtype=e.dtype, device=buffer.device)
            for e in layout.entries
        ]
    else:
        out = _check_tensors(out, "out")
        if len(out) != len(layout.entries):
            raise ValueError(f"out has {len(out)} tensors, the layout {len(layout.entries)}")
        for i, (o, e) in enumerate(zip(out, layout.entries)):
            if tuple(o.shape) != e.shape or o.dtype != e.dtype or o.device != buffer.device:
                raise ValueError(
                    f"out[{i}] must be {e.dtype} {list(e.shape)} on {buffer.device}, "
                    f"got {o.dtype} {list(o.shape)} on {o.device}"
                )
            if not non_overlapping(o.shape, o.stride()):
                raise ValueError(f"out[{i}] has overlapping strides {o.stride()}")
    chosen = dispatch.backend_for(OP_UNPACK, buffer.device, backend) if out else "torch"
    if chosen == "torch":
        return reference.unpack(buffer, layout, out)
    for o, e in zip(out, layout.entries):
        _copy(buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape), o, OP_UNPACK, chosen)
    return out
