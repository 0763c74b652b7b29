"""Rotary position embeddings of queries and keys, in plain torch: the specification of ``fastft.rotary``.

``q`` ``[B, Hq, T, D]`` and ``k`` ``[B, Hk, T, D]`` rotate their first ``R`` channels (``R`` = ``cos``'s last
dim, even, at most ``D``) by the angles whose cosines and sines ``cos`` and ``sin`` ``[B or 1, T, R]`` hold; the
other ``D - R`` channels pass through. With ``x1, x2`` the two halves of the rotated channels (and ``c1, c2``,
``s1, s2`` those of ``cos`` and ``sin``):

    out = [x1 * c1 - x2 * s1,  x2 * c2 + x1 * s2,  x[R:]]

which is transformers' ``q * cos + rotate_half(q) * sin`` (``rotate_half(x) = [-x2, x1]``; its partial form
for ``R < D``), computed in fp32 and returned in each input's dtype (transformers computes in the inputs'
dtype: each product and the sum rounded, where this rounds once). ``rotary_backward`` is the gradient written
out (``cos`` and ``sin`` take none): ``dx = [dy1 * c1 + dy2 * s2,  dy2 * c2 - dy1 * s1,  dy[R:]]``.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    r = cos.shape[-1]
    c1, c2 = cos.float().unsqueeze(1).chunk(2, dim=-1)
    s1, s2 = sin.float().unsqueeze(1).chunk(2, dim=-1)
    xf = x.float()
    x1, x2, rest = xf[..., : r // 2], xf[..., r // 2 : r], xf[..., r:]
    if backward:
        out = (x1 * c1 + x2 * s2, x2 * c2 - x1 * s1, rest)
    else:
        out = (x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, rest)
    return torch.cat(out, dim=-1).to(x.dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` rotated (see the module docstring); differentiable through these torch ops."""
    return _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)


def rotary_backward(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``'s and ``k``'s gradients (in ``dq``'s and ``dk``'s dtypes) from those of the outputs."""
    return _rotate(dq, cos, sin, True), _rotate(dk, cos, sin, True)
