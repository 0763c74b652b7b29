"""Rotary position embeddings of queries and keys, in plain torch: the specification of ``fastft.rotary``.

``q`` ``[B, Hq, T, D]`` and ``k`` ``[B, Hk, T, D]`` rotate their first ``R`` channels (``R`` = ``cos``'s last
dim, even, at most ``D``) by the angles whose cosines and sines ``cos`` and ``sin`` ``[B or 1, T, R]`` hold; the
other ``D - R`` channels pass through. With ``x1, x2`` the two halves of the rotated channels (and ``c1, c2``,
``s1, s2`` those of ``cos`` and ``sin``):

    out = [x1 * c1 - x2 * s1,  x2 * c2 + x1 * s2,  x[R:]]

which is transformers' ``q * cos + rotate_half(q) * sin`` (``rotate_half(x) = [-x2, x1]``; its partial form
for ``R < D``), computed in fp32 and returned in each input's dtype (transformers computes in the inputs'
dtype: each product and the sum rounded, where this rounds once). With ``interleaved``, ``x1, x2`` are the even
and the odd rotated channels instead (and ``c1, c2``, ``s1, s2`` those of ``cos`` and ``sin``), the results
put back in their places: Cohere's and GLM's ``rotate_half(x)``, ``stack((-x[..., 1::2], x[..., ::2]),
-1).flatten(-2)``. ``rotary_backward`` is the gradient written out (``cos`` and ``sin`` take none): ``dx = [dy1 *
c1 + dy2 * s2,  dy2 * c2 - dy1 * s1,  dy[R:]]``.
"""

from __future__ import annotations

import torch


def _pair(t: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (t[..., 0::2], t[..., 1::2]) if interleaved else t.chunk(2, dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool, interleaved: bool) -> torch.Tensor:
    r = cos.shape[-1]
    c1, c2 = _pair(cos.float().unsqueeze(1), interleaved)
    s1, s2 = _pair(sin.float().unsqueeze(1), interleaved)
    xf = x.float()
    (x1, x2), rest = _pair(xf[..., :r], interleaved), xf[..., r:]
    if backward:
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    rotated = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return torch.cat((rotated, rest), dim=-1).to(x.dtype)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` rotated (see the module docstring); differentiable through these torch ops."""
    return _rotate(q, cos, sin, False, interleaved), _rotate(k, cos, sin, False, interleaved)


def rotary_backward(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``'s and ``k``'s gradients (in ``dq``'s and ``dk``'s dtypes) from those of the outputs."""
    return _rotate(dq, cos, sin, True, interleaved), _rotate(dk, cos, sin, True, interleaved)
