"""RMSNorm in plain torch: the specification of ``fastft.rms_norm``.

    r   = 1 / sqrt(mean(x^2 over the last dim) + eps)      in fp32
    out = x * r * (weight + offset)                        in fp32, rounded once to x's dtype

``offset=0`` is Llama's and Qwen3's norm (which round ``x * r`` to x's dtype before the product: one rounding
more, within one unit in the last place); ``offset=1`` is Gemma's and Qwen3-Next's (``1 + weight``).

With a ``gate`` z (x's shape), the gated norms of the linear-attention and state-space mixers:

    gate_first=False:  out = x * r * (weight + offset) * silu(z)              Qwen3.5's, Qwen3-Next's
    gate_first=True:   u = x * silu(z);  out = u * r_u * (weight + offset)    Mamba-2's (Granite-4.0-H, Bamba)

``gate_activation="sigmoid"`` puts ``sigmoid(z)`` in place of ``silu(z)`` (Kimi-Linear's, after the norm).

With ``group_size``, each row's channels are normalised in groups of that many (``r`` per group: Nemotron-H's
and Zamba2's gated norms, Falcon-H1's); without, the whole row is one group.

``rms_norm_backward`` is the torch backend's gradient: that derivative written out (tested against autograd).
"""

from __future__ import annotations

import torch


def _compute(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _activation(z: torch.Tensor, gate_activation: str) -> torch.Tensor:
    return torch.sigmoid(z) if gate_activation == "sigmoid" else torch.nn.functional.silu(z)


def _gated_input(x, gate, gate_first, gate_activation, compute):
    xf = x.to(compute)
    return xf * _activation(gate.to(compute), gate_activation) if gate is not None and gate_first else xf


def _groups(v: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """``v`` ``[..., H]`` as ``[..., H / group_size, group_size]`` (``[..., 1, H]`` without a group size)."""
    return v.unflatten(-1, (1, v.shape[-1]) if group_size is None else (-1, group_size))


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    gate: torch.Tensor | None = None,
    gate_first: bool = False,
    gate_activation: str = "silu",
    group_size: int | None = None,
) -> torch.Tensor:
    """``x`` ``[..., H]`` normalised by its root mean square over the last dim (over each group of
    ``group_size`` channels), times ``weight + offset`` (``weight`` ``[H]``), gated by ``silu(gate)`` (or
    ``sigmoid(gate)``) after the norm or, with ``gate_first``, before it; computed in fp32 (fp64 inputs: fp64),
    returned in ``x``'s dtype."""
    compute = _compute(x)
    u = _groups(_gated_input(x, gate, gate_first, gate_activation, compute), group_size)
    n = (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    out = n * (weight.to(compute) + offset)
    if gate is not None and not gate_first:
        out = out * _activation(gate.to(compute), gate_activation)
    return out.to(x.dtype)


def rms_norm_rstd(
    x: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    gate_first: bool = False,
    gate_activation: str = "silu",
    group_size: int | None = None,
) -> torch.Tensor:
    """The fp32 ``r`` ``[R * G]`` of each row's each group (G per row; one without ``group_size``) of ``x``
    ``[R, H]`` (of ``x * silu(gate)`` with ``gate_first``): what the forward keeps for the backward."""
    u = _groups(_gated_input(x, gate, gate_first, gate_activation, torch.float32), group_size)
    return torch.rsqrt(u.pow(2).mean(-1) + eps).flatten()


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    gate: torch.Tensor | None = None,
    gate_first: bool = False,
    gate_activation: str = "silu",
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x``'s gradient (x's dtype), ``weight``'s (fp32) and ``gate``'s (its dtype; None without a gate) from the
    output's ``dy`` ``[R, H]``. With ``u`` the normalised input (``x``, or ``x s`` with ``gate_first``, where
    ``s = silu(z)``), ``n = u r``, ``e`` the output's gradient before the gate after the norm (``dy s``, else
    ``dy``) and ``g = e (weight + offset)``: ``du = r (g - n mean(g n))``, ``dweight = sum over rows of e n``;
    ``dx = du`` (``du s`` with ``gate_first``); ``dz = dy n (weight + offset) silu'(z)`` after the norm,
    ``du x silu'(z)`` before it, with ``silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))`` (a sigmoid gate:
    ``s = sigmoid(z)``, ``s' = s (1 - s)``). With ``group_size``, ``r`` and the mean are each group's."""
    w = weight.float() + offset
    xf, dyf = x.float(), dy.float()
    if gate is not None:
        z = gate.float()
        sig = torch.sigmoid(z)
        if gate_activation == "sigmoid":
            s, ds = sig, sig * (1 - sig)
        else:
            s, ds = z * sig, sig * (1 + z * (1 - sig))
    u = xf * s if gate is not None and gate_first else xf
    r = rstd.view(x.shape[0], -1, 1)
    n = _groups(u, group_size) * r  # [R, G, H / G]
    e = dyf * s if gate is not None and not gate_first else dyf
    g = _groups(e * w, group_size)
    du = (r * (g - n * (g * n).mean(-1, keepdim=True))).flatten(-2)
    n = n.flatten(-2)
    dw = (e * n).sum(0)
    if gate is None:
        return du.to(x.dtype), dw, None
    if gate_first:
        return (du * s).to(x.dtype), dw, (du * xf * ds).to(gate.dtype)
    return du.to(x.dtype), dw, (dyf * n * w * ds).to(gate.dtype)
