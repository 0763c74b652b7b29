"""``launch(fn, grid, *args, **meta)``: ``fn[grid](*args, **meta)`` with less host time on repeat calls.

Triton's launch path binds and specializes every argument in Python on every call, which is most of the
host cost of fastft's small kernels (docs/benchmarks.md, "launch floor"). ``launch`` keeps the compiled
kernel that ``fn[grid]`` returned, under a key that covers everything Triton specializes on (each tensor's
dtype and 16-byte alignment; each int's value class: 1, a multiple of 16, 32/64-bit; the constexpr and
launch options), and later launches it through the compiled kernel's own runner (current stream, launch
hooks honoured). The interpreter (CPU) always takes Triton's own path. fastft does not reach below that
runner into the launcher: what that saves per launch is not measurable in a training step (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import torch

_compiled: dict = {}  # key -> (compiled kernel, names of the constexpr parameters after the positional ones)


def cdiv(a: int, b: int) -> int:
    """Host-side ``ceil(a / b)`` (``triton.cdiv`` is a slower constexpr function on newer Tritons)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Host-side smallest power of 2 >= n (1 for n <= 1): fastft's one power-of-two rounding (autotune's
    size buckets and the CUDA-graph bounds use it too)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def unit_inner(v: torch.Tensor) -> torch.Tensor:
    """``v`` with unit stride along its last dimension (kernels take the others as strides)."""
    return v if v.stride(-1) == 1 else v.contiguous()


@functools.cache
def dot_precision(device: torch.device) -> str:
    """``tl.dot``'s fp32 precision on ``device``: 3xTF32 where tensor cores take TF32 (CUDA, sm80 on), IEEE fp32
    elsewhere (Triton's interpreter, older GPUs, ROCm)."""
    if device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 0):
        return "tf32x3"
    return "ieee"


_I32, _I64 = 2**31, 2**63
_T = torch.Tensor


def _key(args) -> tuple:
    # One comprehension, no call per argument (this key is most of launch's own cost). Tensors: dtype and
    # 16-byte alignment. Ints: small ones by value, others by divisibility by 16 and by the i32/i64/u64
    # range. Floats: by type (Triton does not specialize on their value). bool, None: by value.
    return tuple(
        [
            (a.dtype, a.data_ptr() & 15 == 0)
            if isinstance(a, _T)
            else (a if -16 <= a <= 16 else (a & 15 == 0, not -_I32 <= a < _I32, a >= _I64))
            if type(a) is int
            else float
            if type(a) is float
            else (type(a), a)
            for a in args
        ]
    )


def launch(fn, grid, *args, **meta) -> None:
    """``fn[grid](*args, **meta)`` on the device of ``args[0]`` (a CUDA tensor), whatever the current device."""
    first = args[0] if args else None
    if not (isinstance(first, torch.Tensor) and first.is_cuda):
        fn[grid](*args, **meta)
        return
    index = first.device.index
    if index != torch.cuda.current_device():  # Triton launches on the current device and its current stream
        with torch.cuda.device(index):
            _launch(fn, index, grid, args, meta)
        return
    _launch(fn, index, grid, args, meta)


def _launch(fn, index: int, grid, args, meta) -> None:
    grid = tuple(grid) + (1,) * (3 - len(grid))
    key = (fn, index, *meta.items(), *_key(args))
    hit = _compiled.get(key)
    if hit is None:
        kernel = fn[grid](*args, **meta)
        names = fn.arg_names[len(args) :]
        if all(name in meta for name in names):
            _compiled[key] = (kernel, names)
        return
    kernel, names = hit
    kernel[grid](*args, *(meta[name] for name in names))
