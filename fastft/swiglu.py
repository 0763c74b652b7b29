"""SwiGLU over a fused gate-up projection: one pass each way instead of a chain of elementwise kernels.

    out = fastft.swiglu(gate_up)                                              # silu(gate) * up, [gate | up]
    out = fastft.swiglu(gate_up, interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)      # gpt-oss

The activation between a MoE expert's gate-up and down projections (and any fused gate-up MLP):

    gate, up = halves of gate_up's last dim, side by side or interleaved
    gate, up = min(gate, limit), clamp(up, -limit, limit)       (with a limit)
    out = (up + up_shift) * gate * sigmoid(alpha * gate)

computed in fp32, the output in ``gate_up``'s dtype; ``fastft/reference/swiglu.py`` is the specification.
transformers' experts gates spell it as several kernels each way (gpt-oss's: seven forward, more backward,
each reading and writing a ``[rows, W]`` tensor, and autograd keeps their outputs); here the forward reads
``gate_up`` once and writes the output, and the backward (which recomputes the activation from ``gate_up``,
the only tensor saved) reads ``gate_up`` and the output's gradient and writes ``gate_up``'s gradient.
Backends: ``triton`` and ``torch`` (the reference, its gradient written out). No GPU sync.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import autotune, dispatch
from ._checks import bool_arg, finite_arg
from ._custom_op import custom_op
from .kernels._launch import next_power_of_2
from .reference import swiglu as reference

__all__ = ["swiglu"]

OP_SWIGLU = dispatch.register("swiglu.swiglu")
# Launch parameters only; dispatched with the forward op.
OP_SWIGLU_BACKWARD = "swiglu.swiglu_backward"

# Tiles of 4 rows x 1024 columns (fewer for narrower outputs): near the best of the tiles tried for
# Qwen3-30B-A3B's and gpt-oss's experts each way (docs/benchmarks.md).
# The interpreter's small tiles make small test inputs span several programs.
for _op in (OP_SWIGLU, OP_SWIGLU_BACKWARD):
    autotune.register(
        _op,
        autotune.Tunable({"BLOCK_R": 4, "BLOCK_C": 1024, "num_warps": 8}, interpreter={"BLOCK_R": 2, "BLOCK_C": 8}),
    )

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- custom ops: one kernel (or the torch reference) per call, on the backend named, no validation ----


def _params(op: str, x: torch.Tensor) -> dict:
    """``op``'s launch parameters for ``x`` ``[R, 2W]``: a tile no wider than the output's ``W`` columns."""
    cfg = autotune.params(op, x.device, x.numel())
    return {**cfg, "BLOCK_C": min(cfg["BLOCK_C"], next_power_of_2(x.shape[1] // 2))}


def _reference(x, interleaved, alpha, limit, up_shift):
    return reference.swiglu(x, interleaved=interleaved, alpha=alpha, limit=limit, up_shift=up_shift)


@custom_op("fastft::swiglu")
def swiglu_op(
    x: torch.Tensor,
    interleaved: bool,
    alpha: float,
    limit: Optional[float],  # noqa: UP045  (torch.library.custom_op reads it: Optional spelled out)
    up_shift: float,
    backend: str,
) -> torch.Tensor:
    """``[R, W]`` in ``x.dtype`` from ``x`` ``[R, 2W]`` with unit column stride."""
    if backend == "torch" or x.numel() == 0:
        return _reference(x, interleaved, alpha, limit, up_shift)
    from .kernels import swiglu as kernels

    return kernels.swiglu_forward(x, interleaved, alpha, limit, up_shift, **_params(OP_SWIGLU, x))


@swiglu_op.register_fake
def _(x, interleaved, alpha, limit, up_shift, backend):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@custom_op("fastft::swiglu_backward")
def swiglu_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    interleaved: bool,
    alpha: float,
    limit: Optional[float],  # noqa: UP045
    up_shift: float,
    backend: str,
) -> torch.Tensor:
    """``x``'s gradient ``[R, 2W]`` in ``x.dtype`` from the output's, ``dy`` ``[R, W]`` contiguous."""
    if backend == "torch" or x.numel() == 0:
        return reference.swiglu_backward(dy, x, interleaved, alpha, limit, up_shift)
    from .kernels import swiglu as kernels

    return kernels.swiglu_backward(dy, x, interleaved, alpha, limit, up_shift, **_params(OP_SWIGLU_BACKWARD, x))


@swiglu_backward_op.register_fake
def _(dy, x, interleaved, alpha, limit, up_shift, backend):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    x, interleaved, alpha, limit, up_shift, backend = inputs
    ctx.args = (interleaved, alpha, limit, up_shift, backend)
    ctx.save_for_backward(x)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return swiglu_backward_op.op(grad.contiguous(), x, *ctx.args), None, None, None, None, None


swiglu_op.register_autograd(_backward, setup_context=_setup)


# ---- public API ---------------------------------------------------------------------------------------


def swiglu(
    gate_up: torch.Tensor,
    *,
    interleaved: bool = False,
    alpha: float = 1.0,
    limit: float | None = None,
    up_shift: float = 0.0,
    backend: str | None = None,
) -> torch.Tensor:
    """``(up + up_shift) * gate * sigmoid(alpha * gate)`` of the gate and up halves of ``gate_up``'s last dim
    (``[gate | up]``, or ``gate0, up0, gate1, ...`` if ``interleaved``), the gate clamped to ``<= limit`` and
    the up half to ``[-limit, limit]`` if ``limit`` is given (see the module docstring).

    ``gate_up``: ``[..., 2W]`` fp32, bf16 or fp16, any strides; returns ``[..., W]`` in its dtype, computed
    in fp32. Differentiable in ``gate_up`` (a clamped entry passes no gradient beyond its bound, as
    ``torch.clamp``). ``backend``: ``auto``, ``triton`` or ``torch`` (default ``FASTFT_BACKEND``). No GPU sync.

    Raises ``TypeError`` for a non-tensor or non-floating ``gate_up``, a non-bool ``interleaved``, or
    ``alpha``/``limit``/``up_shift`` that are not numbers; ``ValueError`` for a 0-d ``gate_up`` or an odd
    last dim, a non-finite ``alpha`` or ``up_shift``, a ``limit`` that is not in ``(0, float32's max]``, an
    unknown backend.
    """
    if not isinstance(gate_up, torch.Tensor):
        raise TypeError(f"gate_up must be a tensor, got {type(gate_up).__name__}")
    if gate_up.dtype not in _DTYPES:
        raise TypeError(f"gate_up must be float32, bfloat16 or float16, got {gate_up.dtype}")
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2W] (an even last dim), got shape {tuple(gate_up.shape)}")
    interleaved = bool_arg("interleaved", interleaved)
    alpha = finite_arg("alpha", alpha)
    up_shift = finite_arg("up_shift", up_shift)
    if limit is not None:
        limit = finite_arg("limit", limit)
        if not 0 < limit <= torch.finfo(torch.float32).max:  # the clamp runs in fp32
            raise ValueError(f"limit must be None or in (0, float32's max], got {limit}")
    chosen = dispatch.backend_for(OP_SWIGLU, gate_up.device, backend)
    two_w = gate_up.shape[-1]
    if two_w == 0:  # W = 0: an empty [..., 0], still connected to gate_up
        return gate_up[..., :0].clone()
    x = gate_up.reshape(-1, two_w)
    if two_w > 1 and x.stride(1) != 1:
        x = x.contiguous()
    out = swiglu_op(x, interleaved, alpha, limit, up_shift, chosen)
    return out.view(*gate_up.shape[:-1], two_w // 2)
