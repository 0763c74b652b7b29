"""RMSNorm in plain torch: the specification of ``fastft.rms_norm``.

    r   = 1 / sqrt(mean(x^2 over the last dim) + eps)      in fp32
    out = x * r * (weight + offset)                        in fp32, rounded once to x's dtype

``offset=0`` is Llama's and Qwen3's norm (which round ``x * r`` to x's dtype before the product: one rounding
more, within one unit in the last place); ``offset=1`` is Gemma's and Qwen3-Next's (``1 + weight``).
``rms_norm_backward`` is the torch backend's gradient: that derivative written out (tested against autograd).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``x`` ``[..., H]`` normalised by its root mean square over the last dim, times ``weight + offset``
    (``weight`` ``[H]``); computed in fp32 (fp64 inputs: fp64), returned in ``x``'s dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * r * (weight.to(compute) + offset)).to(x.dtype)


def rms_norm_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row's fp32 ``r`` ``[R]`` of ``x`` ``[R, H]`` (what the forward keeps for the backward)."""
    return torch.rsqrt(x.float().pow(2).mean(-1) + eps)


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s gradient (x's dtype) and ``weight``'s (fp32) from the output's ``dy`` ``[R, H]``: with
    ``n = x r`` and ``g = dy (weight + offset)``, ``dx = r (g - n mean(g n))`` and ``dweight = sum over rows of
    dy n``."""
    n = x.float() * rstd[:, None]
    g = dy.float() * (weight.float() + offset)
    dx = rstd[:, None] * (g - n * (g * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dy.float() * n).sum(0)
