"""Mamba-1's selective scan over packed documents in plain torch, one token at a time: the specification.

Per channel d (of Dm), with ``delta`` first given its bias and softplus, the state ``h`` (``[Dm, N]``) starts at
0 at every document's first token (``position_ids == 0``) and then, for each token ``t``:

    h   = exp(delta_t[:, None] * A) * h + (delta_t * u_t)[:, None] * B_t[None, :]
    y_t = h C_t + D * u_t

and ``y_t * silu(z_t)`` when ``z`` is given. This is transformers 5.17's ``mamba_selective_scan`` (Jamba; its
sequential path) and mamba_ssm's ``selective_scan_fn`` on one document, with the reset added. Slow (a Python
loop over tokens) and sync-free.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def selective_scan(u, delta, A, B, C, position_ids, D=None, z=None, delta_bias=None, delta_softplus=False):
    """y ``[Bt, Dm, T]`` in u's dtype for u, delta ``[Bt, Dm, T]``, A ``[Dm, N]``, B, C ``[Bt, N, T]``, D and
    delta_bias ``[Dm]``, z like u, and ``position_ids`` (each token's position inside its document, ``Bt * T``
    of them in any shape). Tokens are read in flat ``Bt * T`` order; fp32 math (fp64 for fp64 u)."""
    b, d, t = u.shape
    n = A.shape[-1]
    dtype, math_dtype = u.dtype, torch.promote_types(u.dtype, torch.float32)

    def tokens(v):  # [Bt, K, T] -> [Bt * T, K]
        return v.transpose(1, 2).reshape(b * t, v.shape[1]).to(math_dtype)

    u, delta, B, C = tokens(u), tokens(delta), tokens(B), tokens(C)
    if delta_bias is not None:
        delta = delta + delta_bias.to(math_dtype)
    if delta_softplus:
        delta = F.softplus(delta)
    A = A.to(math_dtype)
    starts = position_ids.reshape(-1) == 0
    state = u.new_zeros(d, n)
    out = []
    for i in range(b * t):
        state = torch.where(starts[i], torch.zeros_like(state), state)
        state = torch.exp(delta[i][:, None] * A) * state + (delta[i] * u[i])[:, None] * B[i][None, :]
        out.append(state @ C[i])
    y = torch.stack(out) if out else u.new_zeros(0, d)
    if D is not None:
        y = y + u * D.to(math_dtype)
    if z is not None:
        y = y * F.silu(tokens(z))
    return y.reshape(b, t, d).transpose(1, 2).to(dtype)
