"""``launch(fn, grid, *args, **meta)``: ``fn[grid](*args, **meta)`` with less host time on repeat calls.

Triton's launch path binds and specializes every argument in Python on every call (~2-3 µs per
argument with Triton 3.6), which is most of the host cost of fastft's small kernels. ``launch`` keeps the
compiled kernel that ``fn[grid]`` returned, under a key that covers everything Triton specializes on
(each tensor's dtype and 16-byte alignment; each int's value class: 1, a multiple of 16, 32/64-bit;
the constexpr and launch options), and later launches it directly.
The interpreter (CPU) always takes Triton's own path.
"""

from __future__ import annotations

import torch

_compiled: dict = {}  # key -> (compiled kernel, names of the constexpr parameters after the positional ones)
_direct = [True]  # cleared if this Triton's compiled kernels cannot be launched directly


def _arg_key(a):
    if type(a) is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if type(a) is int:
        return (a == 1, a & 15 == 0, -(2**31) <= a < 2**31, a < 2**63)
    return (type(a), a)  # bool, None, float: value and type


def launch(fn, grid, *args, **meta) -> None:
    if not _direct[0] or not (args and isinstance(args[0], torch.Tensor) and args[0].is_cuda):
        fn[grid](*args, **meta)
        return
    grid = tuple(grid) + (1,) * (3 - len(grid))
    key = (fn, args[0].device.index, *meta.items(), *map(_arg_key, args))
    hit = _compiled.get(key)
    if hit is None:
        kernel = fn[grid](*args, **meta)
        names = fn.arg_names[len(args):]
        if all(name in meta for name in names):
            _compiled[key] = (kernel, names)
        return
    kernel, names = hit
    try:
        kernel[grid](*args, *(meta[name] for name in names))
    except (AttributeError, TypeError):  # a Triton whose compiled-kernel API differs: use its own path
        _direct[0] = False
        fn[grid](*args, **meta)
