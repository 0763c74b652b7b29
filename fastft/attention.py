"""Packed attention: each token attends to the earlier tokens of its own document, from a ``PackedSeqInfo``.

    info = fastft.packed_seq_info(position_ids=position_ids)          # once per batch
    out = fastft.packed_attention(q, k, v, info, window=None, sinks=None)   # every layer

The torch reference in ``fastft/reference/attention.py`` is the specification (a masked softmax, with a sink
column per head when ``sinks`` is given). Two implementations:

- ``flash`` (CUDA, fp16/bf16, no dropout, head dim a multiple of 8 up to 256, sm80+): torch's flash
  variable-length kernels over the flattened token stream, with ``info.cu_seqlens`` (no mask is built).
  Without sinks through ``torch.nn.attention.varlen.varlen_attn``; with sinks through ``_SinkAttention``
  (flash's forward and backward with the sink's share of each row applied around them);
- ``dense``: ``scaled_dot_product_attention`` with ``info.sdpa_mask`` (``[B, 1, T, T]``), or the
  reference's fp32 masked softmax when there are sinks. Memory grows with T squared: for CPUs, short
  sequences, and fp32.

Values may have their own head dim (``Dv``, MLA layers: DeepSeek-V3, Kimi-Linear): the output has it. The flash
kernels take one head dim, so there q/k or v are zero-padded to the larger one and the output cut back (as
transformers does for flash-attn); padding q and k with zeros leaves their dot products as they were.

``impl=None`` (or ``"auto"``) takes ``flash`` where it runs, else ``dense``. (``impl``, not ``backend``: a
dispatch backend picks Triton or torch for one op; these are two torch implementations.) ``flash_op`` and
``flash_reason`` are the op layer, for the benchmarks: not public.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F

from . import capabilities
from ._checks import int_arg, number_arg
from .packing import PackedSeqInfo
from .reference import attention as reference
from .reference import packing as reference_packing

__all__ = ["packed_attention"]

IMPLS = ("auto", "flash", "dense")  # packed_attention's impl= choices


@functools.cache
def _varlen():
    """(``varlen_attn``, its parameter names) from torch, or None."""
    fn = capabilities.varlen_attn()
    return None if fn is None else (fn, frozenset(inspect.signature(fn).parameters))


class _SinkAttention(torch.autograd.Function):
    """Causal flash variable-length attention whose every softmax row also holds a per-head sink logit that
    attends to nothing, from torch's flash kernels: with ``lse`` a row's log-sum-exp, the sink leaves
    ``keep = sigmoid(lse - sink)`` of the row's mass, so the output is ``keep * flash_out``. Backward is
    flash's backward given ``keep * grad`` and the final output (its ``rowsum(grad * out)`` term then carries
    the sink), and ``d sink = -sum((1 - keep) * rowsum(grad * out))``. ``q``: ``[N, H, D]``, ``k``/``v``:
    ``[N, H_kv, D]``, ``sinks``: ``[H]``; ``left``: keys left of the query in the window, -1 for none."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens, max_seqlen, scale, left):
        out, lse = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            0.0,
            True,
            False,
            scale=scale,
            window_size_left=left,
            window_size_right=0,
        )[:2]
        keep = torch.sigmoid(lse - sinks.float()[:, None]).T[:, :, None]  # [N, H, 1]
        y = (out * keep).to(q.dtype)
        ctx.save_for_backward(q, k, v, y, lse, keep, cu_seqlens)
        ctx.args = (max_seqlen, scale, left, sinks.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse, keep, cu = ctx.saved_tensors
        max_seqlen, scale, left, sinks_dtype = ctx.args
        no_rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout is 0: no random state
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            (dy * keep).to(q.dtype),
            q,
            k,
            v,
            y,
            lse,
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            0.0,
            True,
            no_rng,
            torch.empty(0, device=q.device),
            scale=scale,
            window_size_left=left,
            window_size_right=0,
        )
        dsinks = None
        if ctx.needs_input_grad[3]:
            dsinks = -((1 - keep[..., 0]) * (dy.float() * y.float()).sum(-1)).sum(0).to(sinks_dtype)
        return dq, dk, dv, dsinks, None, None, None, None


def flash_reason(q, k, sinks, dropout_p, window, v_head_dim: int | None = None) -> str | None:
    """Why the flash path cannot run this call (``[B, T, H, D]`` q and k; values of ``v_head_dim``, default
    D), or None when it can."""
    if not q.is_cuda:
        return "it needs CUDA tensors"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it needs fp16/bf16, got {q.dtype}"
    if dropout_p:
        return "it runs without dropout"
    dims = {q.shape[-1], v_head_dim or q.shape[-1]}
    if any(d % 8 or d > 256 for d in dims):
        what = " and ".join(str(d) for d in sorted(dims))
        return f"it needs head dims that are multiples of 8 up to 256, got {what}"
    if not capabilities.flash_attention(q.device):
        return f"{capabilities.arch(q.device)} has no torch flash attention kernels"
    if sinks is None:
        found = _varlen()
        if found is None:
            return "this torch has no torch.nn.attention.varlen"
        if "window_size" not in found[1] and (window or "is_causal" not in found[1]):
            return "this torch's varlen_attn takes no causal window"
    return None


def flash_op(q, k, v, cu_seqlens, max_seqlen: int, scale: float, window, sinks):
    """The flash path on ``[N, H, D]`` inputs (N = all tokens) -> ``[N, H, D]``: internal op layer, no
    validation (``packed_attention`` checks first; the e2e benchmark's naive glue calls it directly)."""
    if sinks is not None:
        return _SinkAttention.apply(q, k, v, sinks, cu_seqlens, max_seqlen, scale, window - 1 if window else -1)
    fn, params = _varlen()
    options = {"scale": scale}
    if "window_size" in params:
        options["window_size"] = (window - 1 if window else -1, 0)  # (left, right): causal, window keys
    else:
        options["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)


def _dense(q, k, v, info, window, sinks, scale, dropout_p):
    """``[B, T, H, D]`` inputs (v ``[..., Dv]``) -> ``[B, T, H, Dv]``, on the info's own rows when they are ``[B, T]``
    (documents never cross them), else on the flattened stream as one row."""
    b, t = q.shape[:2]
    rows = tuple(info.shape) == (b, t)
    if not rows:
        q, k, v = (x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v))
    doc = info.doc_ids.reshape(q.shape[:2])
    if sinks is not None:
        out = reference.packed_attention(q, k, v, doc, window or 0, sinks, scale, dropout_p)
    else:
        mask = info.sdpa_mask(window=window) if rows else reference_packing.sdpa_mask(doc, window or 0, torch.bool)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=k.shape[2] != q.shape[2],
        ).transpose(1, 2)
    return out.reshape(b, t, *out.shape[2:]).contiguous()


def _check_tensors(q, k, v) -> None:
    """What autocast needs of q, k, v before it casts them."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t.is_meta:
            raise ValueError(f"{name} must hold data (a CPU or CUDA tensor), got a meta tensor")


def _check(q, k, v, info, window, sinks, scale, dropout_p, impl) -> None:
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [B, T, H, D] or [T, H, D], got shape {tuple(q.shape)}")
    if (
        k.dim() != q.dim()
        or v.dim() != q.dim()
        or k.shape[:-2] != q.shape[:-2]
        or k.shape[-1] != q.shape[-1]
        or v.shape[:-1] != k.shape[:-1]
    ):
        raise ValueError(
            f"k must be [..., T, H_kv, D] matching q's tokens and head dim, and v [..., T, H_kv, Dv] matching k's "
            f"tokens and heads: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] < 1 or v.shape[-1] < 1:
        raise ValueError(f"q, k and v must have head dims >= 1, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    if k.shape[-2] < 1 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"q's {q.shape[-2]} heads must be a multiple of k/v's {k.shape[-2]} (grouped-query attention)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not isinstance(info, PackedSeqInfo):
        raise TypeError(f"info must be a PackedSeqInfo from fastft.packed_seq_info, got {type(info).__name__}")
    tokens = q.shape[:-2].numel()
    if info.num_tokens != tokens:
        raise ValueError(f"info describes {info.num_tokens} tokens, q has {tokens}")
    if info.device != q.device:
        raise ValueError(f"info is on {info.device}, q on {q.device}")
    if window is not None:
        int_arg("window", window)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise TypeError(
                f"sinks must be a floating tensor or None, got {getattr(sinks, 'dtype', type(sinks).__name__)}"
            )
        if sinks.shape != (q.shape[-2],) or sinks.device != q.device:
            raise ValueError(
                f"sinks must be [H={q.shape[-2]}] on {q.device}, got {tuple(sinks.shape)} on {sinks.device}"
            )
    if scale is not None and not math.isfinite(number_arg("scale", scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    if not 0 <= number_arg("dropout_p", dropout_p) < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    info: PackedSeqInfo,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    impl: str | None = None,
) -> torch.Tensor:
    """Causal attention inside each document of ``info``; returns ``[B, T, H, Dv]`` (or ``[T, H, Dv]``).

    ``q`` is ``[B, T, H, D]`` or ``[T, H, D]``, ``k`` the same with ``H_kv`` heads (``H % H_kv == 0``), ``v``
    as ``k`` with its own head dim ``Dv`` (MLA; usually ``D``);
    ``info`` describes these ``B * T`` tokens (``packed_seq_info``). ``window``: keys a query sees,
    itself included (``None`` or <= 0: all earlier keys of its document). ``sinks``: ``[H]`` logits of a
    per-head sink (gpt-oss). ``scale``: default ``D ** -0.5``. ``dropout_p``: on the attention
    probabilities (dense path only). ``impl``: ``None``/``"auto"``, ``"flash"`` (``ValueError`` where it
    cannot run, saying why) or ``"dense"``. Differentiable in q, k, v and sinks.

    Under ``torch.autocast``, q, k and v are cast to its dtype first, as ``scaled_dot_product_attention`` is
    (mixed-precision training hands attention fp32 rotated q/k beside a low-precision v); outside it they
    must share a dtype.
    """
    _check_tensors(q, k, v)
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    _check(q, k, v, info, window, sinks, scale, dropout_p, impl)
    window = window if window and window > 0 else None
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    flat = q.dim() == 3
    if flat:
        q, k, v = q[None], k[None], v[None]
    dv = v.shape[-1]
    why_not = flash_reason(q, k, sinks, dropout_p, window, dv) if impl != "dense" else "dense was asked for"
    if impl == "flash" and why_not:
        raise ValueError(f"impl='flash' cannot run this call: {why_not}")
    if why_not is None:
        b, t, h = q.shape[:3]
        d = max(q.shape[-1], dv)  # one head dim for the kernels: zeros added to the smaller (see the module doc)
        padded = (x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1])) for x in (q, k, v))
        out = flash_op(
            *(x.reshape(b * t, x.shape[2], d) for x in padded), info.cu_seqlens, info.max_seqlen, scale, window, sinks
        )
        out = out.view(b, t, h, d) if dv == d else out.view(b, t, h, d)[..., :dv].contiguous()
    else:
        out = _dense(q, k, v, info, window, sinks, scale, dropout_p)
    return out[0] if flat else out
