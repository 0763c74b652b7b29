"""Mamba-2's state-space scan (SSD) over packed documents in plain torch, one token at a time: the specification.

Per head h (of H, in groups of H / G sharing B and C), with ``dt`` first given its bias, softplus and clamp,
the state ``S`` (``[P, N]``) starts at 0 at every document's first token (``position_ids == 0``) and then,
for each token ``t``:

    S   = exp(dt_t * A) * S + (dt_t * x_t) B_t^T
    y_t = S C_t + D * x_t

and ``y_t * silu(z_t)`` when ``z`` is given. This is what transformers 5.17's ``mamba2_chunk_scan`` (Bamba,
Granite-4.0-H, Falcon-H1, Nemotron-H, Zamba2) and mamba_ssm's ``mamba_chunk_scan_combined`` compute on one
document, with the reset added. Slow (a Python loop over tokens) and sync-free.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def discretize(dt, dt_bias=None, dt_softplus: bool = False, dt_limit=(0.0, math.inf)) -> torch.Tensor:
    """The step ``dt`` (fp32, or fp64 for fp64 input) as the scan uses it: plus ``dt_bias``, then softplus, then
    clamped to ``dt_limit``."""
    dt = dt.to(torch.promote_types(dt.dtype, torch.float32))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(dt_limit[0], dt_limit[1])


def ssd_scan(
    x, dt, A, B, C, position_ids, D=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf), z=None
) -> torch.Tensor:
    """y ``[Bt, T, H, P]`` in x's dtype for x ``[Bt, T, H, P]``, dt ``[Bt, T, H]``, A ``[H]``, B, C
    ``[Bt, T, G, N]``, D ``[H]`` or ``[H, P]``, dt_bias ``[H]``, z like x, and ``position_ids`` (each token's
    position inside its document, ``Bt * T`` of them in any shape). Tokens are read in flat ``Bt * T`` order;
    fp32 math (fp64 for fp64 x)."""
    b, t, h, p = x.shape
    g, n = B.shape[-2:]
    dtype, math_dtype = x.dtype, torch.promote_types(x.dtype, torch.float32)
    x = x.reshape(b * t, h, p).to(math_dtype)
    dt = discretize(dt.reshape(b * t, h), dt_bias, dt_softplus, dt_limit)
    B, C = (v.reshape(b * t, g, n).to(math_dtype).repeat_interleave(h // g, dim=1) for v in (B, C))  # [N, H, state]
    A = A.to(math_dtype)
    starts = position_ids.reshape(-1) == 0
    state = x.new_zeros(h, p, n)
    out = []
    for i in range(b * t):
        state = torch.where(starts[i], torch.zeros_like(state), state)
        state = state * torch.exp(dt[i] * A)[:, None, None] + (dt[i, :, None] * x[i])[:, :, None] * B[i][:, None, :]
        out.append((state * C[i][:, None, :]).sum(-1))
    y = torch.stack(out) if out else x.new_zeros(0, h, p)
    if D is not None:
        y = y + x * (D.to(math_dtype)[:, None] if D.dim() == 1 else D.to(math_dtype))
    if z is not None:
        y = y * F.silu(z.reshape(b * t, h, p).to(math_dtype))
    return y.reshape(b, t, h, p).to(dtype)
