"""RMSNorm in one pass each way: ``fastft.rms_norm(x, weight, eps)``.

    out = fastft.rms_norm(hidden, norm.weight, norm.variance_epsilon)               # Llama, Qwen3
    out = fastft.rms_norm(hidden, norm.weight, norm.eps, offset=1.0)               # Gemma, Qwen3-Next: 1 + w

transformers' RMSNorm modules spell it in torch: an fp32 copy of ``x``, its square, the mean, ``rsqrt``, two
products and two casts, each a kernel reading and writing ``[tokens, H]`` (in fp32 for most), and autograd keeps
several of them for the backward. Here the forward reads ``x`` once and writes the output and one fp32 number
a row; the backward reads ``x``, the output's gradient and those numbers and writes ``x``'s gradient, the
weight's summed per program and then in a fixed order. ``fastft/reference/rms_norm.py`` is the specification.
Backends: ``triton`` (rows of at most ``MAX_WIDTH``; wider rows take the torch path) and ``torch`` (the
reference, its gradient written out). No GPU sync.
"""

from __future__ import annotations

import functools

import torch

from . import autotune, dispatch
from ._checks import finite_arg
from ._custom_op import custom_op
from .reference import rms_norm as reference

__all__ = ["rms_norm"]

OP_RMS_NORM = dispatch.register("rms_norm.rms_norm")
# Launch parameters only; dispatched with the forward op.
OP_RMS_NORM_BACKWARD = "rms_norm.rms_norm_backward"

MAX_WIDTH = 16384  # the Triton path holds whole rows in registers
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


# ---- custom ops: one kernel (or the torch reference) per call, on the backend named, no validation ----


@custom_op("fastft::rms_norm")
def rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output ``[R, H]`` in ``x.dtype`` and each row's fp32 ``r`` ``[R]`` of ``x`` ``[R, H]`` (unit column
    stride) and ``weight`` ``[H]`` (contiguous)."""
    if backend == "torch" or x.shape[1] > MAX_WIDTH:
        return reference.rms_norm(x, weight, eps, offset), reference.rms_norm_rstd(x, eps)
    from .kernels import rms_norm as kernels

    return kernels.rms_norm_forward(x, weight, eps, offset, **autotune.params(OP_RMS_NORM, x.device, x.shape[1]))


@rms_norm_op.register_fake
def _(x, weight, eps, offset, backend):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], dtype=torch.float32)


@custom_op("fastft::rms_norm_backward")
def rms_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    grad_weight: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s gradient (its dtype) and, with ``grad_weight``, ``weight``'s (its dtype; else an empty tensor)
    from the output's ``dy`` ``[R, H]`` (unit column stride)."""
    if backend == "torch" or x.shape[1] > MAX_WIDTH:
        dx, dw = reference.rms_norm_backward(dy, x, weight, rstd, offset)
    else:
        from .kernels import rms_norm as kernels

        params = autotune.params(OP_RMS_NORM_BACKWARD, x.device, x.shape[1])
        dx, dw = kernels.rms_norm_backward(
            dy, x, weight, rstd, offset, grad_weight, programs=_programs(x.device), stages=STAGES, **params
        )
    return dx, dw.to(weight.dtype) if grad_weight else weight.new_empty(0)


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, offset, grad_weight, backend):
    return x.new_empty(x.shape), weight.new_empty(weight.shape if grad_weight else (0,))


def _setup(ctx, inputs, output):
    x, weight, eps, offset, backend = inputs
    ctx.args = (offset, backend)
    ctx.grad_weight = ctx.needs_input_grad[1]
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    offset, backend = ctx.args
    dx, dw = rms_norm_backward_op.op(grad.contiguous(), x, weight, rstd, offset, ctx.grad_weight, backend)
    return dx, (dw if ctx.grad_weight else None), None, None, None


rms_norm_op.register_autograd(_backward, setup_context=_setup)


# ---- public API ---------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0, backend: str | None = None
) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (weight + offset)`` over ``x``'s last dim, computed in fp32 and returned
    in ``x``'s dtype (see the module docstring).

    ``x``: ``[..., H]`` fp32, bf16 or fp16, any strides; ``weight``: ``[H]`` in any of these dtypes, on ``x``'s
    device. Differentiable in ``x`` and ``weight`` (whose gradient, summed over the rows in fp32, is returned
    in its dtype). ``offset``: 1 for norms that scale by ``1 + weight`` (Gemma, Qwen3-Next). ``backend``:
    ``auto``, ``triton`` or ``torch`` (default ``FASTFT_BACKEND``). No GPU sync.

    Raises ``TypeError`` for non-tensors, dtypes other than these, an ``eps`` or ``offset`` that is not a
    number; ``ValueError`` for a 0-d ``x``, a ``weight`` that is not ``[H]``, tensors on different devices, an
    ``eps`` that is negative or not finite, a non-finite ``offset``, an unknown backend.
    """
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if x.dim() == 0:
        raise ValueError("x must be [..., H], got a 0-d tensor")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must be [H] = [{x.shape[-1]}] (x's last dim), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    eps = finite_arg("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    offset = finite_arg("offset", offset)
    chosen = dispatch.backend_for(OP_RMS_NORM, x.device, backend)
    width = x.shape[-1]
    if x.numel() == 0:
        return reference.rms_norm(x, weight, eps, offset)
    rows = x.reshape(-1, width)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out, _ = rms_norm_op(rows, weight.contiguous(), eps, offset, chosen)
    return out.view(x.shape)
