"""A linear layer's cross-entropy, in plain torch: the specification of ``fastft.linear_cross_entropy``.

    logits = hidden @ weight^T (+ bias)          in hidden's dtype, as the model's head computes them
    logits = logits * logit_scale                in hidden's dtype, where a model scales them (Granite, Cohere)
    logits = softcap * tanh(fp32(logits) / softcap)   in fp32, where a model caps them (Gemma)
    loss   = cross_entropy(fp32(logits), labels)  ignore_index's rows left out; mean over the others, or sum

transformers' ``ForCausalLMLoss`` is this with the labels shifted by one token. ``cross_entropy_rows`` is one
block of rows of it, the part fastft's kernel computes: each row's loss and the logits' gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """fp32 loss of ``hidden`` ``[..., H]`` through ``weight`` ``[V, H]`` (and ``bias`` ``[V]``), times
    ``logit_scale``, capped at ``softcap``, against ``labels`` ``[...]``: the logits in full, then
    ``F.cross_entropy``. In fp64 inputs everything is fp64."""
    logits = F.linear(hidden, weight, bias)
    if logit_scale is not None:
        logits = logits * logit_scale
    logits = logits.float() if logits.dtype != torch.float64 else logits
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(
        logits.reshape(-1, weight.shape[0]), labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )


def cross_entropy_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's fp32 loss ``logsumexp(x) - x[label]`` (0 on a row labelled ``ignore_index``, NaN on a label
    outside ``[0, V)``) and the fp32 gradient ``(softmax(x) - onehot(label)) * scale`` (0 on an ignored row,
    NaN on an out-of-range one) of ``logits`` ``[R, V]`` (any float dtype, read as fp32) against ``labels``
    ``[R]``; ``scale`` a 0-d fp32 tensor. With ``softcap``, ``x = softcap * tanh(logits / softcap)`` and the
    gradient is the raw logits', times ``1 - tanh(logits / softcap)^2``."""
    x = logits.float()
    slope = None
    if softcap is not None:
        t = torch.tanh(x / softcap)
        x, slope = softcap * t, 1 - t * t
    vocab = x.shape[1]
    lse = torch.logsumexp(x, dim=1)
    valid = labels != ignore_index
    in_range = (labels >= 0) & (labels < vocab)
    safe = torch.where(in_range, labels, 0)
    target = x.gather(1, safe[:, None])[:, 0]
    nan = torch.full_like(lse, float("nan"))
    loss = torch.where(valid, torch.where(in_range, lse - target, nan), torch.zeros_like(lse))
    weight = torch.where(valid, torch.where(in_range, scale.expand_as(lse), nan), torch.zeros_like(lse))
    grad = torch.exp(x - lse[:, None])
    grad[torch.arange(len(safe), device=x.device), safe] -= in_range.to(x.dtype)
    grad = grad * weight[:, None]
    return loss, grad if slope is None else grad * slope
