"""Torch reference for packing tensors into one byte buffer: the specification of fastft.copy's kernels.

A ``PackLayout`` (see fastft/copy.py) places tensor ``i`` at byte ``offsets[i]`` (a multiple of 16) of a
uint8 buffer, its elements in row-major (logical index) order, whatever its strides. Bytes between
entries are unspecified.
"""

from __future__ import annotations

import torch


def pack(tensors, layout, out: torch.Tensor) -> torch.Tensor:
    """Write each tensor's elements, row-major, at its offset of ``out`` (uint8 ``[>= layout.nbytes]``)."""
    for t, entry in zip(tensors, layout.entries):
        out[entry.offset : entry.offset + entry.nbytes].view(t.dtype).copy_(t.reshape(-1))
    return out


def unpack(buffer: torch.Tensor, layout, out) -> list[torch.Tensor]:
    """Copy each entry of ``buffer`` into the matching tensor of ``out`` (any strides); return ``out``."""
    for o, entry in zip(out, layout.entries):
        o.copy_(buffer[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape))
    return list(out)
