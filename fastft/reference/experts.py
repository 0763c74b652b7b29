"""Reference routed experts: the specification ``fastft.experts`` is tested against.

One (token, expert) pair at a time, in plain torch: the pair's row through its expert's up projection, the
activation and the down projection, scaled by the router weight and added to the token's fp32 sum in
ascending k. Pairs whose expert id is outside ``[0, E)`` are skipped. LoRA adapters on a projection are
folded into the expert's matrix as PEFT does (``W + scaling * B A``, formed for each pair).
"""

from __future__ import annotations

import torch


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Row ``i`` of ``x`` times the matrix of the expert ``e`` with ``ends[e-1] <= i < ends[e]`` (``weight[e]``
    if ``transposed``, else ``weight[e].T``); rows from ``ends[-1]`` on are zero."""
    out_features = weight.shape[2] if transposed else weight.shape[1]
    rows = []
    for i in range(x.shape[0]):
        e = int((ends <= i).sum())  # the first expert whose rows end after row i
        if e == weight.shape[0]:
            rows.append(x.new_zeros(out_features))
        else:
            rows.append(x[i] @ (weight[e] if transposed else weight[e].T))
    return torch.stack(rows) if rows else x.new_zeros(0, out_features)


def grouped_lowrank_add(
    y: torch.Tensor, u: torch.Tensor, v: torch.Tensor, ends: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``y`` plus ``scaling * u[i] @ v[e]`` on row ``i`` of each expert ``e`` (``ends[e-1] <= i < ends[e]``),
    in fp32, returned in ``y``'s dtype; rows from ``ends[-1]`` on are ``y``'s."""
    out = y.float().clone()
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] += scaling * (u[start:end].float() @ v[e].float())
        start = max(start, end)
    return out.to(y.dtype)


def _matrix(weight: torch.Tensor, lora, transposed: bool, e: int) -> torch.Tensor:
    """Expert ``e``'s ``[in, out]`` matrix, with ``lora`` (``a`` ``[E, r, in]``, ``b`` ``[E, out, r]``,
    ``scaling``) added as ``scaling * (b[e] @ a[e]).T``."""
    w = weight[e] if transposed else weight[e].T
    if lora is None:
        return w
    return w + lora.scaling * (lora.b[e].to(w.dtype) @ lora.a[e].to(w.dtype)).T


def routed_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor | None,
    up: torch.Tensor,
    down: torch.Tensor,
    *,
    transposed: bool,
    activation,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    up_lora=None,
    down_lora=None,
) -> torch.Tensor:
    """``[T, H_out]``: ``sum_k top_k_weights[t, k] * expert_e(hidden_states[t])`` over ``e = top_k_index[t, k]``
    in ``[0, E)``, ``expert_e(x) = activation(x @ up_e + up_bias[e]) @ down_e + down_bias[e]`` with
    ``up_e = up[e]`` if ``transposed`` else ``up[e].T`` (same for down), plus ``scaling * (b[e] @ a[e]).T`` of
    ``up_lora`` (``down_lora``) when given; ``top_k_weights`` None: all ones."""
    experts = up.shape[0]
    out_features = down.shape[2] if transposed else down.shape[1]
    tokens = []
    for t in range(hidden_states.shape[0]):
        total = hidden_states.new_zeros(out_features, dtype=torch.float32)
        for k in range(top_k_index.shape[1]):
            e = int(top_k_index[t, k])
            if not 0 <= e < experts:
                continue
            h = hidden_states[t] @ _matrix(up, up_lora, transposed, e)
            if up_bias is not None:
                h = h + up_bias[e]
            y = activation(h[None])[0] @ _matrix(down, down_lora, transposed, e)
            if down_bias is not None:
                y = y + down_bias[e]
            weight = top_k_weights[t, k].float() if top_k_weights is not None else 1.0
            total = total + weight * y.float()
        tokens.append(total)
    if not tokens:
        return hidden_states.new_zeros(0, out_features)
    return torch.stack(tokens).to(hidden_states.dtype)
