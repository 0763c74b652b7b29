"""The gated delta rule over packed documents in plain torch, one token at a time: the specification.

Per head, with ``q``/``k`` optionally L2-normalised and ``q`` scaled, the state ``S`` (``[Dk, Dv]``) starts at
0 at every document's first token (``position_ids == 0``) and then, for each token ``t``:

    S   = exp(g_t) * S              (g_t a scalar, or one decay per row of S: Kimi Delta Attention)
    S   = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t

which is transformers 5.17's ``torch_recurrent_gated_delta_rule`` (Qwen3.5, Qwen3-Next) and
``recurrent_kimi_delta_attention`` (Kimi-Linear) step for step, with the reset added. Slow (a Python loop over
tokens) and sync-free.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dim (transformers' and flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta, position_ids, scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """o ``[B, T, H, Dv]`` in q's dtype for q, k ``[B, T, H, Dk]``, v ``[B, T, H, Dv]``, g ``[B, T, H]`` (one
    decay per head) or ``[B, T, H, Dk]`` (one per key channel: Kimi Delta Attention), beta ``[B, T, H]`` and
    ``position_ids`` (each token's position inside its document, ``B * T`` of them in any shape). The tokens
    are read in flat ``B * T`` order; fp32 math."""
    b, t, h, dk = q.shape
    dv, dtype = v.shape[-1], q.dtype
    q, k, v = (x.reshape(b * t, h, x.shape[-1]).float() for x in (q, k, v))
    g = g.reshape(b * t, h, dk if g.dim() == 4 else 1).float()  # [N, H, 1] or [N, H, Dk]: each state row's decay
    beta = beta.reshape(b * t, h).float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    starts = position_ids.reshape(-1) == 0
    state = q.new_zeros(h, dk, dv)
    out = []
    for i in range(b * t):
        state = torch.where(starts[i], torch.zeros_like(state), state)
        state = state * g[i].exp()[:, :, None]
        kv_mem = (state * k[i][:, :, None]).sum(dim=-2)
        delta = (v[i] - kv_mem) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        out.append((state * q[i][:, :, None]).sum(dim=-2))
    o = torch.stack(out) if out else v.new_zeros(0, h, dv)
    return o.reshape(b, t, h, dv).to(dtype)
