"""Causal depthwise conv1d over a packed token stream, in plain torch: the specification.

``x`` is ``[N, C]`` (tokens of every document back to back), ``weight`` ``[C, W]`` (``nn.Conv1d``'s
depthwise ``[C, 1, W]`` squeezed), ``bias`` ``[C]`` or None. Each document is convolved alone, causally,
with ``W - 1`` zeros before its first token:

    out[t, c] = act(bias[c] + sum_{j < W, j <= pos[t]} weight[c, W-1-j] * x[t-j, c])

where ``pos[t]`` is token ``t``'s position inside its document and ``act`` is the identity or SiLU. Sums in
fp32, the output in ``x``'s dtype.

``packed_conv1d`` is the specification: a loop over the documents calling ``F.conv1d`` (it reads
``cu_seqlens`` on the host). ``shifted_conv1d`` / ``shifted_conv1d_backward`` are the torch backend: the
formula above as W shifted, masked sums over the whole stream, sync-free, with the gradients written out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packed_conv1d(x: torch.Tensor, weight: torch.Tensor, bias, cu_seqlens, silu: bool) -> torch.Tensor:
    """Each document ``x[cu_seqlens[i]:cu_seqlens[i+1]]`` through ``F.conv1d`` alone (padding ``W - 1``,
    the first ``len`` outputs), in fp32. Differentiable (autograd through ``F.conv1d``)."""
    c, w = weight.shape
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(v) for v in cu_seqlens]
    outs = [x.new_empty((0, c))]
    for start, end in zip(cu[:-1], cu[1:]):
        doc = x[start:end].float().t()[None]  # [1, C, len]
        y = F.conv1d(doc, weight.float()[:, None, :], None if bias is None else bias.float(), padding=w - 1, groups=c)
        y = y[0, :, : end - start].t()
        outs.append((F.silu(y) if silu else y).to(x.dtype))
    return torch.cat(outs)


def _pre_activation(xf: torch.Tensor, wf: torch.Tensor, bias, pos: torch.Tensor) -> torch.Tensor:
    """fp32 ``bias + sum_j weight[:, W-1-j] * x[t-j] * [j <= pos[t]]`` for fp32 ``xf`` ``[N, C]``."""
    n, c = xf.shape
    w = wf.shape[1]
    acc = xf.new_zeros((n, c)) if bias is None else bias.float().expand(n, c).clone()
    for j in range(min(w, n)):
        keep = (pos[j:] >= j)[:, None]
        acc[j:] += torch.where(keep, xf[: n - j], 0.0) * wf[:, w - 1 - j]
    return acc


def shifted_conv1d(x: torch.Tensor, weight: torch.Tensor, bias, pos: torch.Tensor, silu: bool) -> torch.Tensor:
    """The convolution of ``x`` ``[N, C]`` with positions ``pos`` ``[N]``: W masked shifted sums."""
    pre = _pre_activation(x.float(), weight.float(), bias, pos)
    return (F.silu(pre) if silu else pre).to(x.dtype)


def shifted_conv1d_backward(
    dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias, pos: torch.Tensor, silu: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in ``x.dtype``, dweight fp32 ``[C, W]``, dbias fp32 ``[C]``) of ``shifted_conv1d`` for the output
    gradient ``dout``; the pre-activation is recomputed for SiLU's derivative."""
    n, c = x.shape
    w = weight.shape[1]
    xf, wf = x.float(), weight.float()
    g = dout.float()
    if silu:
        pre = _pre_activation(xf, wf, bias, pos)
        s = torch.sigmoid(pre)
        g = g * (s * (1 + pre * (1 - s)))
    dx = torch.zeros_like(xf)
    dweight = xf.new_zeros((c, w))
    for j in range(min(w, n)):
        gj = torch.where((pos[j:] >= j)[:, None], g[j:], 0.0)  # gradient reaching x[t - j] from token t
        dx[: n - j] += gj * wf[:, w - 1 - j]
        dweight[:, w - 1 - j] = (gj * xf[: n - j]).sum(0)
    return dx.to(x.dtype), dweight, g.sum(0)
