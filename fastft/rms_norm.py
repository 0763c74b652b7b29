"""RMSNorm in one pass each way: ``fastft.rms_norm(x, weight, eps)``.

    out = fastft.rms_norm(hidden, norm.weight, norm.variance_epsilon)               # Llama, Qwen3
    out = fastft.rms_norm(hidden, norm.weight, norm.eps, offset=1.0)               # Gemma, Qwen3-Next: 1 + w
    out = fastft.rms_norm(core, norm.weight, norm.variance_epsilon, gate=z)        # Qwen3.5's gated norm
    out = fastft.rms_norm(y, norm.weight, norm.variance_epsilon, gate=z, gate_first=True)  # Mamba-2's
    out = fastft.rms_norm(o, norm.weight, norm.variance_epsilon, gate=g, gate_activation="sigmoid")  # Kimi's
    out = fastft.rms_norm(y, norm.weight, eps, gate=z, gate_first=True, group_size=1024)  # Nemotron-H's groups

transformers' RMSNorm modules spell it in torch: an fp32 copy of ``x``, its square, the mean, ``rsqrt``, two
products and two casts, each a kernel reading and writing ``[tokens, H]`` (in fp32 for most), and autograd keeps
several of them for the backward. Here the forward reads ``x`` once and writes the output and one fp32 number
a row; the backward reads ``x``, the output's gradient and those numbers and writes ``x``'s gradient, the
weight's summed per program and then in a fixed order. A gate is read with ``x`` and its gradient written with
``x``'s. ``fastft/reference/rms_norm.py`` is the specification.
Backends: ``triton`` (rows or groups of at most ``MAX_WIDTH``; wider ones take the torch path) and ``torch`` (the
reference, its gradient written out). No GPU sync.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from . import autotune, dispatch
from ._checks import bool_arg, finite_arg, int_arg
from ._custom_op import custom_op
from .reference import rms_norm as reference

__all__ = ["rms_norm"]

OP_RMS_NORM = dispatch.register("rms_norm.rms_norm")
# Launch parameters only; dispatched with the forward op.
OP_RMS_NORM_BACKWARD = "rms_norm.rms_norm_backward"

MAX_WIDTH = 16384  # the Triton path holds whole rows (or groups) in registers
MAX_GROUPS = 65535  # and a row's groups are its grid's second axis (CUDA's limit)
PROGRAMS_PER_SM = 4  # the backward's programs where it sums the weight's gradient (a row of partial sums each)
STAGES = 2  # and their loads one tile ahead

# Tiles of about 8,192 elements (whole rows). The interpreter runs a program in milliseconds: tiles of 4,096
# elements keep a tiny model's norms to a program or two (the tests give the kernels small tiles themselves).
for _op in (OP_RMS_NORM, OP_RMS_NORM_BACKWARD):
    autotune.register(_op, autotune.Tunable({"TILE": 8192, "num_warps": 8}, interpreter={"TILE": 4096, "num_warps": 1}))

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 3  # the interpreter: a few programs, each over several tiles
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _torch_path(backend: str, width: int, group_size: int) -> bool:
    """Whether a call runs the reference: asked for, or groups wider or more than the Triton path takes."""
    return backend == "torch" or group_size > MAX_WIDTH or width // group_size > MAX_GROUPS


# ---- custom ops: one kernel (or the torch reference) per call, on the backend named, no validation ----


@custom_op("fastft::rms_norm")
def rms_norm_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    gate: Optional[torch.Tensor],  # noqa: UP045  (torch.library.custom_op reads it: Optional spelled out)
    eps: float,
    offset: float,
    gate_first: bool,
    gate_activation: str,
    group_size: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output ``[R, H]`` in ``x.dtype`` and the fp32 ``r`` ``[R * H / group_size]`` of each row's groups of
    ``x`` ``[R, H]`` (unit column stride), ``weight`` ``[H]`` (contiguous) and ``gate`` (x's shape, unit column
    stride, or None)."""
    if _torch_path(backend, x.shape[1], group_size):
        return (
            reference.rms_norm(x, weight, eps, offset, gate, gate_first, gate_activation, group_size),
            reference.rms_norm_rstd(x, eps, gate, gate_first, gate_activation, group_size),
        )
    from .kernels import rms_norm as kernels

    params = autotune.params(OP_RMS_NORM, x.device, group_size)
    return kernels.rms_norm_forward(x, weight, eps, offset, gate, gate_first, gate_activation, group_size, **params)


@rms_norm_op.register_fake
def _(x, weight, gate, eps, offset, gate_first, gate_activation, group_size, backend):
    return x.new_empty(x.shape), x.new_empty(x.shape[0] * (x.shape[1] // group_size), dtype=torch.float32)


@custom_op("fastft::rms_norm_backward")
def rms_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    gate: Optional[torch.Tensor],  # noqa: UP045
    rstd: torch.Tensor,
    offset: float,
    gate_first: bool,
    gate_activation: str,
    group_size: int,
    grad_weight: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x``'s gradient (its dtype), with ``grad_weight`` ``weight``'s (its dtype; else an empty tensor) and the
    gate's (its dtype; an empty tensor without one) from the output's ``dy`` ``[R, H]`` (unit column stride)."""
    if _torch_path(backend, x.shape[1], group_size):
        dx, dw, dz = reference.rms_norm_backward(
            dy, x, weight, rstd, offset, gate, gate_first, gate_activation, group_size
        )
    else:
        from .kernels import rms_norm as kernels

        params = autotune.params(OP_RMS_NORM_BACKWARD, x.device, group_size)
        dx, dw, dz = kernels.rms_norm_backward(
            dy, x, weight, rstd, offset, grad_weight, gate, gate_first, gate_activation, group_size,
            programs=_programs(x.device), stages=STAGES, **params,
        )  # fmt: skip
    dw = dw.to(weight.dtype) if grad_weight else weight.new_empty(0)
    return dx, dw, x.new_empty(0) if dz is None else dz


@rms_norm_backward_op.register_fake
def _(dy, x, weight, gate, rstd, offset, gate_first, gate_activation, group_size, grad_weight, backend):
    dz = x.new_empty(0) if gate is None else gate.new_empty(gate.shape)
    return x.new_empty(x.shape), weight.new_empty(weight.shape if grad_weight else (0,)), dz


def _setup(ctx, inputs, output):
    x, weight, gate, eps, offset, gate_first, gate_activation, group_size, backend = inputs
    ctx.args = (offset, gate_first, gate_activation, group_size, backend)
    ctx.grad_weight = ctx.needs_input_grad[1]
    ctx.save_for_backward(x, weight, gate, output[1])


def _backward(ctx, grad, _grad_rstd):
    x, weight, gate, rstd = ctx.saved_tensors
    offset, gate_first, gate_activation, group_size, backend = ctx.args
    dx, dw, dz = rms_norm_backward_op(
        grad.contiguous(), x, weight, gate, rstd, offset, gate_first, gate_activation, group_size, ctx.grad_weight,
        backend,
    )  # fmt: skip
    return dx, (dw if ctx.grad_weight else None), (dz if gate is not None else None), *(None,) * 6


rms_norm_op.register_autograd(_backward, setup_context=_setup)


# ---- public API ---------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    gate: torch.Tensor | None = None,
    gate_first: bool = False,
    gate_activation: str = "silu",
    group_size: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (weight + offset)`` over ``x``'s last dim, computed in fp32 and returned
    in ``x``'s dtype (see the module docstring); with ``gate``, times ``silu(gate)`` or, with ``gate_first``,
    of ``x * silu(gate)`` (the gated norms of Qwen3.5's and Mamba-2's mixers); ``gate_activation="sigmoid"``:
    ``sigmoid(gate)`` in place of ``silu(gate)`` (Kimi-Linear's); ``group_size``: each row normalised in groups
    of that many channels (Nemotron-H's and Zamba2's gated norms; default: the whole row).

    ``x``: ``[..., H]`` fp32, bf16 or fp16, any strides; ``weight``: ``[H]`` in any of these dtypes, on ``x``'s
    device; ``gate``: x's shape, any of these dtypes, or None. Differentiable in ``x``, ``weight`` (whose
    gradient, summed over the rows in fp32, is returned in its dtype) and ``gate``. ``offset``: 1 for norms
    that scale by ``1 + weight`` (Gemma, Qwen3-Next). ``backend``: ``auto``, ``triton`` or ``torch`` (default
    ``FASTFT_BACKEND``). No GPU sync.

    Raises ``TypeError`` for non-tensors, dtypes other than these, an ``eps`` or ``offset`` that is not a
    number, a ``gate_first`` that is not a bool, a ``gate_activation`` that is not a string, a ``group_size``
    that is not an int or None; ``ValueError`` for
    a 0-d ``x``, a ``weight`` that is not ``[H]``, a ``gate`` not of x's shape, tensors on different devices, an
    ``eps`` that is negative or not finite, a non-finite ``offset``, ``gate_first`` or a ``gate_activation``
    other than ``"silu"`` without a gate, a ``gate_activation`` other than ``"silu"`` and ``"sigmoid"``, a
    ``group_size`` below 1 or not dividing H, an unknown backend.
    """
    named = (("x", x), ("weight", weight)) + ((("gate", gate),) if gate is not None else ())
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if x.dim() == 0:
        raise ValueError("x must be [..., H], got a 0-d tensor")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must be [H] = [{x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    for name, t in named[1:]:
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    eps = finite_arg("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    offset = finite_arg("offset", offset)
    gate_first = bool_arg("gate_first", gate_first)
    if gate_first and gate is None:
        raise ValueError("gate_first=True gates the input before the norm: give gate")
    if not isinstance(gate_activation, str):
        raise TypeError(f"gate_activation must be 'silu' or 'sigmoid', got {type(gate_activation).__name__}")
    if gate_activation not in ("silu", "sigmoid"):
        raise ValueError(f"gate_activation must be 'silu' or 'sigmoid', got {gate_activation!r}")
    if gate_activation != "silu" and gate is None:
        raise ValueError(f"gate_activation={gate_activation!r} is the gate's activation: give gate")
    width = x.shape[-1]
    if group_size is not None:
        group_size = int_arg("group_size", group_size, minimum=1)
        if width % group_size:
            raise ValueError(f"group_size must divide x's last dim {width}, got {group_size}")
    chosen = dispatch.backend_for(OP_RMS_NORM, x.device, backend)
    if x.numel() == 0:
        return reference.rms_norm(x, weight, eps, offset, gate, gate_first, gate_activation, group_size)
    rows = _rows(x, width)
    gate_rows = None if gate is None else _rows(gate, width)
    out, _ = rms_norm_op(
        rows, weight.contiguous(), gate_rows, eps, offset, gate_first, gate_activation, group_size or width, chosen
    )
    return out.view(x.shape)


def _rows(v: torch.Tensor, width: int) -> torch.Tensor:
    """``v`` as ``[R, H]`` rows with a unit column stride (a view where it can be)."""
    rows = v.reshape(-1, width)
    return rows if rows.stride(1) == 1 else rows.contiguous()
