"""Triton kernel for fastft.linear_cross_entropy: the cross-entropy of a block of logits rows, its gradient
written over the logits (spec: ``cross_entropy_rows`` in fastft/reference/linear_cross_entropy.py).

One program per row. A first pass over the row's columns keeps a running max and sum of exponentials (the
log-sum-exp online, in fp32); the row's loss is ``lse - x[label]``; a second pass writes
``(exp(x - lse) - onehot) * scale`` over the row in the logits' dtype. ``scale`` is read from a device scalar
(1 / the count of labelled rows, or 1), so nothing waits on the host. A label outside ``[0, V)`` other than
``ignore_index`` is never dereferenced: its row's loss and gradient are NaN. Row offsets are int64.
With ``SOFTCAP``, each logit ``x`` is read as ``softcap * tanh(x / softcap)`` in fp32 and its gradient carries
the cap's slope ``1 - tanh^2``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import launch


@triton.jit
def _capped(x, softcap):
    """``softcap * tanh(x / softcap)`` and ``tanh(x / softcap)`` in fp32 (``tanh`` from one ``exp`` of a
    non-positive number: no overflow; ``x = -inf`` gives ``-softcap``)."""
    u = x / softcap
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(u < 0, -t, t)
    return softcap * t, t


@triton.jit(do_not_specialize=["ignore_index"])
def _cross_entropy_rows_kernel(
    logits_ptr,
    labels_ptr,
    loss_ptr,
    scale_ptr,
    vocab,
    stride_row,
    ignore_index,
    softcap,
    SOFTCAP: tl.constexpr,
    GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        inside = start + cols < vocab
        x = tl.load(base + start + cols, mask=inside, other=0.0).to(tl.float32)
        if SOFTCAP:
            x, _t = _capped(x, softcap)
        x = tl.where(inside, x, float("-inf"))
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    lse = m + tl.log(s)
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    in_range = (label >= 0) & (label < vocab)
    target = tl.load(base + label, mask=valid & in_range, other=0.0).to(tl.float32)
    if SOFTCAP:
        target, _t = _capped(target, softcap)
    nan = float("nan")
    loss = tl.where(valid, tl.where(in_range, lse - target, nan), 0.0)
    tl.store(loss_ptr + row, loss)
    if GRAD:
        scale = tl.load(scale_ptr).to(tl.float32)
        weight = tl.where(valid, tl.where(in_range, scale, nan), 0.0)
        for start in range(0, vocab, BLOCK_V):
            c = start + cols
            x = tl.load(base + c, mask=c < vocab, other=0.0).to(tl.float32)
            if SOFTCAP:
                x, t = _capped(x, softcap)
                g = (tl.exp(x - lse) - tl.where(c == label, 1.0, 0.0)) * (weight * (1.0 - t * t))
            else:
                g = (tl.exp(x - lse) - tl.where(c == label, 1.0, 0.0)) * weight
            tl.store(base + c, g.to(logits_ptr.dtype.element_ty), mask=c < vocab)


def cross_entropy_rows_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    grad: bool,
    softcap: float | None = None,
    *,
    BLOCK_V: int,
    num_warps: int,
) -> torch.Tensor:
    """Each row's fp32 loss ``[R]`` of ``logits`` ``[R, V]`` (unit column stride) against ``labels`` ``[R]``
    (the logits capped at ``softcap`` first, if given); with ``grad``, the logits' gradient times ``scale`` (a
    0-d fp32 tensor) written over ``logits``."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        launch(
            _cross_entropy_rows_kernel,
            (rows,),
            logits,
            labels,
            loss,
            scale,
            vocab,
            logits.stride(0),
            ignore_index,
            1.0 if softcap is None else softcap,
            SOFTCAP=softcap is not None,
            GRAD=grad,
            BLOCK_V=BLOCK_V,
            num_warps=num_warps,
        )
    return loss
