"""SwiGLU, in plain torch: the specification of ``fastft.swiglu``.

``gate_up`` holds each row's gate and up halves, side by side (``[gate | up]``, transformers' default experts
gate and fused gate-up MLPs) or interleaved (``gate0, up0, gate1, up1, ...``: gpt-oss); or the gate and up
are two tensors of one shape (``swiglu(gate, up)``: a dense MLP's ``gate_proj`` and ``up_proj`` outputs).
With ``limit``, the gate is clamped from above
and the up half to ``[-limit, limit]`` (gpt-oss, and its kin); then

    out = (up + up_shift) * gate * sigmoid(alpha * gate)

in fp32, the output in ``gate_up``'s dtype; with ``activation="gelu_tanh"`` (GeGLU: Gemma's MLPs) ``gate *
sigmoid(alpha * gate)`` is ``gelu(gate, approximate="tanh")`` instead (``alpha`` 1), written ``gate *
sigmoid(2 z)`` for its ``0.5 * gate * (1 + tanh(z))``, ``z = sqrt(2/pi) (gate + 0.044715 gate^3)``: the same
function, whose fp32 value and gradient do not vanish where ``tanh(z)`` rounds to -1 (``gate`` below about -5).
``alpha=1, limit=None, up_shift=0`` is ``silu(gate) * up``;
gpt-oss is ``interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0``. Differentiable (autograd through
these torch ops: a clamped entry passes no gradient beyond its bound, as ``torch.clamp``).
``swiglu_backward`` and ``swiglu_pair_backward`` are the torch backend's gradients: that derivative written out
(tested against autograd).
"""

from __future__ import annotations

import math

import torch

ACTIVATIONS = ("silu", "gelu_tanh")
_K = 2 * math.sqrt(2 / math.pi)  # gelu_tanh(g) = g * sigmoid(_K * (g + 0.044715 g^3))


def _act(gate: torch.Tensor, alpha: float, activation: str) -> torch.Tensor:
    if activation == "gelu_tanh":
        return gate * torch.sigmoid(_K * (gate + 0.044715 * gate**3))
    return gate * torch.sigmoid(gate * alpha)


def _halves(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)


def swiglu(
    gate_up: torch.Tensor,
    up: torch.Tensor | None = None,
    *,
    interleaved: bool = False,
    alpha: float = 1.0,
    limit: float | None = None,
    up_shift: float = 0.0,
    activation: str = "silu",
) -> torch.Tensor:
    """``[..., W]`` in ``gate_up``'s dtype from ``gate_up`` ``[..., 2W]``, or from the gate ``gate_up`` and
    ``up``, both ``[..., W]`` (see the module docstring)."""
    gate, up = (gate_up.float(), up.float()) if up is not None else _halves(gate_up.float(), interleaved)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return ((up + up_shift) * _act(gate, alpha, activation)).to(gate_up.dtype)


def _grads(dy, gate, up, alpha, limit, up_shift, activation):
    dy = dy.float()
    g, u = gate, up
    if limit is not None:
        g, u = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if activation == "gelu_tanh":
        s = torch.sigmoid(_K * (g + 0.044715 * g**3))
        dact = s + g * s * (1 - s) * _K * (1 + 3 * 0.044715 * g**2)
    else:
        s = torch.sigmoid(g * alpha)
        dact = s + alpha * g * s * (1 - s)
    dgate = dy * (u + up_shift) * dact
    dup = dy * (g * s)
    if limit is not None:  # torch.clamp's gradient: inside the bounds, ends included (none for NaN)
        dgate = torch.where(gate <= limit, dgate, 0.0)
        dup = torch.where((up >= -limit) & (up <= limit), dup, 0.0)
    return dgate, dup


def swiglu_backward(
    dy: torch.Tensor,
    gate_up: torch.Tensor,
    interleaved: bool,
    alpha: float,
    limit: float | None,
    up_shift: float,
    activation: str = "silu",
) -> torch.Tensor:
    """``gate_up``'s gradient (its shape and dtype) given the output's, ``dy`` ``[..., W]``; in fp32."""
    dgate, dup = _grads(dy, *_halves(gate_up.float(), interleaved), alpha, limit, up_shift, activation)
    dx = torch.stack((dgate, dup), dim=-1).flatten(-2) if interleaved else torch.cat((dgate, dup), dim=-1)
    return dx.to(gate_up.dtype)


def swiglu_pair_backward(
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    alpha: float,
    limit: float | None,
    up_shift: float,
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate``'s and ``up``'s gradients (their dtypes) given the output's, ``dy``; in fp32."""
    dgate, dup = _grads(dy, gate.float(), up.float(), alpha, limit, up_shift, activation)
    return dgate.to(gate.dtype), dup.to(up.dtype)
