"""SwiGLU: one pass each way instead of a chain of elementwise kernels.

    out = fastft.swiglu(gate_up)                                              # silu(gate) * up, [gate | up]
    out = fastft.swiglu(gate_up, interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)      # gpt-oss
    out = fastft.swiglu(mlp.gate_proj(x), mlp.up_proj(x))                     # a dense MLP: silu(gate) * up
    out = fastft.swiglu(gate, up, activation="gelu_tanh")                     # GeGLU (Gemma): gelu(gate) * up

The activation between a MoE expert's gate-up and down projections, a fused gate-up MLP's, or a dense MLP's
(``down_proj(act(gate_proj(x)) * up_proj(x))``):

    gate, up = halves of gate_up's last dim, side by side or interleaved (or two tensors)
    gate, up = min(gate, limit), clamp(up, -limit, limit)       (with a limit)
    out = (up + up_shift) * gate * sigmoid(alpha * gate)
        or with activation="gelu_tanh": (up + up_shift) * gelu(gate, approximate="tanh")

computed in fp32, the output in the inputs' dtype; ``fastft/reference/swiglu.py`` is the specification.
transformers spells it as several kernels each way (gpt-oss's: seven forward, more backward; a dense MLP's
two forward and three backward), each reading and writing a ``[rows, W]`` tensor, and autograd keeps their
outputs; here the forward reads the inputs once and writes the output, and the backward (which recomputes the
activation from the inputs, the only tensors saved) reads them and the output's gradient and writes theirs.
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
# The interpreter runs a program in milliseconds: a tiny model's MLP rows in one or a few (the tests give the
# kernels small tiles themselves).
for _op in (OP_SWIGLU, OP_SWIGLU_BACKWARD):
    autotune.register(
        _op,
        autotune.Tunable({"BLOCK_R": 4, "BLOCK_C": 1024, "num_warps": 8}, interpreter={"BLOCK_R": 64, "BLOCK_C": 256}),
    )

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- custom ops: one kernel (or the torch reference) per call, on the backend named, no validation ----


def _params(op: str, x: torch.Tensor, width: int) -> dict:
    """``op``'s launch parameters for rows of ``x``'s and an output ``width`` columns wide: a tile no wider."""
    cfg = autotune.params(op, x.device, x.shape[0] * 2 * width)
    return {**cfg, "BLOCK_C": min(cfg["BLOCK_C"], next_power_of_2(width))}


def _split(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' gate and up arguments for ``x`` ``[R, 2W]``: its halves' views, or ``x`` twice."""
    if interleaved:
        return x, x
    width = x.shape[1] // 2
    return x[:, :width], x[:, width:]


def _activation(gelu: bool) -> str:
    return "gelu_tanh" if gelu else "silu"


@custom_op("fastft::swiglu")
def swiglu_op(
    x: torch.Tensor,
    interleaved: bool,
    alpha: float,
    limit: Optional[float],  # noqa: UP045  (torch.library.custom_op reads it: Optional spelled out)
    up_shift: float,
    gelu: bool,
    backend: str,
) -> torch.Tensor:
    """``[R, W]`` in ``x.dtype`` from ``x`` ``[R, 2W]`` with unit column stride."""
    if backend == "torch" or x.numel() == 0:
        return reference.swiglu(
            x, interleaved=interleaved, alpha=alpha, limit=limit, up_shift=up_shift, activation=_activation(gelu)
        )
    from .kernels import swiglu as kernels

    width = x.shape[1] // 2
    params = _params(OP_SWIGLU, x, width)
    return kernels.swiglu_forward(*_split(x, interleaved), interleaved, alpha, limit, up_shift, gelu, **params)


@swiglu_op.register_fake
def _(x, interleaved, alpha, limit, up_shift, gelu, backend):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@custom_op("fastft::swiglu_backward")
def swiglu_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    interleaved: bool,
    alpha: float,
    limit: Optional[float],  # noqa: UP045
    up_shift: float,
    gelu: bool,
    backend: str,
) -> torch.Tensor:
    """``x``'s gradient ``[R, 2W]`` in ``x.dtype`` from the output's, ``dy`` ``[R, W]`` contiguous."""
    if backend == "torch" or x.numel() == 0:
        return reference.swiglu_backward(dy, x, interleaved, alpha, limit, up_shift, _activation(gelu))
    from .kernels import swiglu as kernels

    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    params = _params(OP_SWIGLU_BACKWARD, x, dy.shape[1])
    gate, up = _split(x, interleaved)
    dgate, dup = _split(dx, interleaved)
    kernels.swiglu_backward(dy, gate, up, dgate, dup, interleaved, alpha, limit, up_shift, gelu, **params)
    return dx


@swiglu_backward_op.register_fake
def _(dy, x, interleaved, alpha, limit, up_shift, gelu, backend):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    x, interleaved, alpha, limit, up_shift, gelu, backend = inputs
    ctx.args = (interleaved, alpha, limit, up_shift, gelu, backend)
    ctx.save_for_backward(x)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return swiglu_backward_op(grad.contiguous(), x, *ctx.args), None, None, None, None, None, None


swiglu_op.register_autograd(_backward, setup_context=_setup)


@custom_op("fastft::swiglu_pair")
def swiglu_pair_op(
    gate: torch.Tensor,
    up: torch.Tensor,
    alpha: float,
    limit: Optional[float],  # noqa: UP045
    up_shift: float,
    gelu: bool,
    backend: str,
) -> torch.Tensor:
    """``[R, W]`` in ``gate.dtype`` from ``gate`` and ``up`` ``[R, W]`` of one dtype, unit column strides."""
    if backend == "torch" or gate.numel() == 0:
        return reference.swiglu(gate, up, alpha=alpha, limit=limit, up_shift=up_shift, activation=_activation(gelu))
    from .kernels import swiglu as kernels

    params = _params(OP_SWIGLU, gate, gate.shape[1])
    return kernels.swiglu_forward(gate, up, False, alpha, limit, up_shift, gelu, **params)


@swiglu_pair_op.register_fake
def _(gate, up, alpha, limit, up_shift, gelu, backend):
    return gate.new_empty(gate.shape)


@custom_op("fastft::swiglu_pair_backward")
def swiglu_pair_backward_op(
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    alpha: float,
    limit: Optional[float],  # noqa: UP045
    up_shift: float,
    gelu: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate``'s and ``up``'s gradients (contiguous, their dtype) from the output's, ``dy`` contiguous."""
    if backend == "torch" or gate.numel() == 0:
        return reference.swiglu_pair_backward(dy, gate, up, alpha, limit, up_shift, _activation(gelu))
    from .kernels import swiglu as kernels

    dgate, dup = torch.empty_like(dy), torch.empty_like(dy)
    params = _params(OP_SWIGLU_BACKWARD, gate, gate.shape[1])
    kernels.swiglu_backward(dy, gate, up, dgate, dup, False, alpha, limit, up_shift, gelu, **params)
    return dgate, dup


@swiglu_pair_backward_op.register_fake
def _(dy, gate, up, alpha, limit, up_shift, gelu, backend):
    return torch.empty_like(dy), torch.empty_like(dy)


def _pair_setup(ctx, inputs, output):
    gate, up, alpha, limit, up_shift, gelu, backend = inputs
    ctx.args = (alpha, limit, up_shift, gelu, backend)
    ctx.save_for_backward(gate, up)


def _pair_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    dgate, dup = swiglu_pair_backward_op(grad.contiguous(), gate, up, *ctx.args)
    return dgate, dup, None, None, None, None, None


swiglu_pair_op.register_autograd(_pair_backward, setup_context=_pair_setup)


# ---- public API ---------------------------------------------------------------------------------------


def swiglu(
    gate_up: torch.Tensor,
    up: torch.Tensor | None = None,
    *,
    interleaved: bool = False,
    alpha: float = 1.0,
    limit: float | None = None,
    up_shift: float = 0.0,
    activation: str = "silu",
    backend: str | None = None,
) -> torch.Tensor:
    """``(up + up_shift) * gate * sigmoid(alpha * gate)`` (or with ``activation="gelu_tanh"``, GeGLU: ``(up +
    up_shift) * gelu(gate, approximate="tanh")``, ``alpha`` 1) of the gate and up halves of ``gate_up``'s last dim
    (``[gate | up]``, or ``gate0, up0, gate1, ...`` if ``interleaved``), or of the gate ``gate_up`` and ``up``
    given apart; the gate clamped to ``<= limit`` and the up half to ``[-limit, limit]`` if ``limit`` is given
    (see the module docstring).

    ``gate_up``: ``[..., 2W]`` fp32, bf16 or fp16, any strides; returns ``[..., W]`` in its dtype, computed
    in fp32. With ``up`` (``interleaved`` then False): ``gate_up`` is the gate, and both are ``[..., W]`` of one
    shape and dtype on one device. Differentiable in ``gate_up`` and ``up`` (a clamped entry passes no gradient
    beyond its bound, as ``torch.clamp``). ``backend``: ``auto``, ``triton`` or ``torch`` (default
    ``FASTFT_BACKEND``). No GPU sync.

    Raises ``TypeError`` for a non-tensor or non-floating ``gate_up`` or ``up``, a non-bool ``interleaved``,
    ``alpha``/``limit``/``up_shift`` that are not numbers or a non-string ``activation``; ``ValueError`` for a
    0-d ``gate_up`` or (without ``up``) an odd last dim, an ``up`` of another shape, dtype or device than the
    gate's, or with ``interleaved``, a non-finite ``alpha`` or ``up_shift``, a ``limit`` that is not in ``(0,
    float32's max]``, an ``activation`` other than ``"silu"`` and ``"gelu_tanh"`` (or ``"gelu_tanh"`` with
    ``alpha`` not 1), an unknown backend.
    """
    if not isinstance(gate_up, torch.Tensor):
        raise TypeError(f"gate_up must be a tensor, got {type(gate_up).__name__}")
    if gate_up.dtype not in _DTYPES:
        raise TypeError(f"gate_up must be float32, bfloat16 or float16, got {gate_up.dtype}")
    if gate_up.dim() == 0:
        raise ValueError("gate_up must be [..., 2W] (an even last dim), or the gate [..., W] with up; got a 0-d tensor")
    interleaved = bool_arg("interleaved", interleaved)
    if up is not None:
        if not isinstance(up, torch.Tensor):
            raise TypeError(f"up must be None or a tensor, got {type(up).__name__}")
        if up.shape != gate_up.shape or up.dtype != gate_up.dtype or up.device != gate_up.device:
            raise ValueError(
                f"up must have the gate's shape, dtype and device {tuple(gate_up.shape)}, {gate_up.dtype}, "
                f"{gate_up.device}; got {tuple(up.shape)}, {up.dtype}, {up.device}"
            )
        if interleaved:
            raise ValueError("interleaved must be False when up is given apart")
    elif gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2W] (an even last dim), got shape {tuple(gate_up.shape)}")
    alpha = finite_arg("alpha", alpha)
    up_shift = finite_arg("up_shift", up_shift)
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a string, got {type(activation).__name__}")
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    gelu = activation == "gelu_tanh"
    if gelu and alpha != 1:
        raise ValueError(f"alpha must be 1 with activation='gelu_tanh' (it scales SiLU's gate), got {alpha}")
    if limit is not None:
        limit = finite_arg("limit", limit)
        if not 0 < limit <= torch.finfo(torch.float32).max:  # the clamp runs in fp32
            raise ValueError(f"limit must be None or in (0, float32's max], got {limit}")
    chosen = dispatch.backend_for(OP_SWIGLU, gate_up.device, backend)
    if up is not None:
        width = gate_up.shape[-1]
        if width == 0:
            return (gate_up * up)[..., :0].clone()
        gate, up_rows = (_unit(t.reshape(-1, width)) for t in (gate_up, up))
        return swiglu_pair_op(gate, up_rows, alpha, limit, up_shift, gelu, chosen).view(gate_up.shape)
    two_w = gate_up.shape[-1]
    if two_w == 0:  # W = 0: an empty [..., 0], still connected to gate_up
        return gate_up[..., :0].clone()
    out = swiglu_op(_unit(gate_up.reshape(-1, two_w)), interleaved, alpha, limit, up_shift, gelu, chosen)
    return out.view(*gate_up.shape[:-1], two_w // 2)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()
