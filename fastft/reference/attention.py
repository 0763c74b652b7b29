"""Packed attention in plain torch: the specification ``fastft.packed_attention`` is tested against.

Query ``q`` attends key ``k`` iff same document, ``k <= q`` and (no window or ``q - k < window``)
(``fastft.reference.packing.sdpa_mask``). With ``sinks``, every softmax row of head ``h`` also holds the
logit ``sinks[h]``, which attends to nothing: it takes its share of the probability mass (gpt-oss's
attention sinks). Grouped-query attention: query head ``h`` reads key/value head ``h // (H / H_kv)``.
Computed in fp32, returned in ``q.dtype``.
"""

from __future__ import annotations

import einops
import torch
import torch.nn.functional as F

from .packing import sdpa_mask


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor,
    window: int,
    sinks,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``q [B, T, H, D]``, ``k [B, T, H_kv, D]``, ``v [B, T, H_kv, Dv]``, ``doc_ids [B, T]`` -> ``[B, T, H, Dv]``."""
    groups = q.shape[2] // k.shape[2]
    k = einops.repeat(k.float(), "b t hk d -> b t (hk g) d", g=groups)
    v = einops.repeat(v.float(), "b t hk d -> b t (hk g) d", g=groups)
    scores = einops.einsum(q.float(), k, "b q h d, b k h d -> b h q k") * scale
    scores = scores.masked_fill(~sdpa_mask(doc_ids, window, torch.bool), float("-inf"))
    if sinks is not None:
        b, h, t, _ = scores.shape
        sink = einops.repeat(sinks.float(), "h -> b h q 1", b=b, q=t)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :t]
    else:
        probs = scores.softmax(dim=-1)  # every query sees itself: no row is all -inf
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return einops.einsum(probs, v, "b h q k, b k h d -> b q h d").to(q.dtype)
