"""Triton kernels for fastft.rotary (spec: fastft/reference/rotary.py).

Each program takes ``BLOCK_T`` tokens of one batch row and a block of ``HEADS`` heads of ``q`` or of ``k``: it
loads the tokens' ``cos`` and ``sin`` in fp32, then the heads' rotated channels as two ``[HEADS, BLOCK_T, R/2]``
halves (``INTERLEAVED``: the even and the odd channels, and ``cos``'s and ``sin``'s likewise), writes their
rotation in the output's dtype, and copies the channels past ``R``. The backward is
the same pass with the transposed rotation (``BACKWARD``). Every tensor is addressed by its own batch, head
and token strides (unit channel stride), so ``[B, T, H, D]`` memory seen as ``[B, H, T, D]`` (transformers'
``view(...).transpose(1, 2)``) is read and written in place of a copy. Launch wrappers take explicit launch
parameters; choosing them is fastft.rotary's job. Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr, x_h, x_t, o_h, o_t, heads, t, tmask, first, second, jmask, c1, c2, a, b, R, rest,
    HAS_REST: tl.constexpr, HEADS: tl.constexpr, BLOCK_REST: tl.constexpr,
):  # fmt: skip
    """``[HEADS, BLOCK_T, D]`` of the block's first ``heads`` heads (``x_ptr``, ``o_ptr`` at the block's first):
    ``x1 c1 + x2 a`` and ``x2 c2 + x1 b`` at the channels ``first`` and ``second`` (``x1``, ``x2`` there; ``a, b =
    -s1, s2`` forward), ``x[R:]`` copied."""
    h = tl.arange(0, HEADS).to(tl.int64)
    rows = (h < heads)[:, None] & tmask[None, :]  # [HEADS, BLOCK_T]
    x_row = x_ptr + h[:, None, None] * x_h + t[None, :, None] * x_t
    o_row = o_ptr + h[:, None, None] * o_h + t[None, :, None] * o_t
    m = rows[:, :, None] & jmask[None, None, :]
    x1 = tl.load(x_row + first[None, None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, None, :], mask=m, other=0.0).to(tl.float32)
    ty = o_ptr.dtype.element_ty
    tl.store(o_row + first[None, None, :], (x1 * c1[None] + x2 * a[None]).to(ty), mask=m)
    tl.store(o_row + second[None, None, :], (x2 * c2[None] + x1 * b[None]).to(ty), mask=m)
    if HAS_REST:
        p = tl.arange(0, BLOCK_REST)
        mr = rows[:, :, None] & (p < rest)[None, None, :]
        tl.store(o_row + R + p[None, None, :], tl.load(x_row + R + p[None, None, :], mask=mr).to(ty), mask=mr)


@triton.jit(do_not_specialize=["tokens"])
def _rotary_kernel(
    q_ptr, k_ptr, oq_ptr, ok_ptr, cos_ptr, sin_ptr,
    tokens, heads_q, heads_k, half, R, rest,
    q_b, q_h, q_t, k_b, k_h, k_t, oq_b, oq_h, oq_t, ok_b, ok_h, ok_t, cos_b, cos_t, sin_b, sin_t,
    BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_REST: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < tokens
    j = tl.arange(0, BLOCK_HALF)
    jmask = j < half
    if INTERLEAVED:  # the pairs (2j, 2j + 1)
        first = 2 * j
        second = 2 * j + 1
    else:  # the halves (j, j + R/2)
        first = j
        second = j + half
    m = tmask[:, None] & jmask[None, :]
    c_row = cos_ptr + batch * cos_b + t[:, None] * cos_t
    s_row = sin_ptr + batch * sin_b + t[:, None] * sin_t
    c1 = tl.load(c_row + first[None, :], mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + second[None, :], mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(s_row + first[None, :], mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + second[None, :], mask=m, other=0.0).to(tl.float32)
    if BACKWARD:  # the transposed rotation: [dy1 c1 + dy2 s2, dy2 c2 - dy1 s1]
        a = s2
        b = -s1
    else:
        a = -s1
        b = s2
    block = tl.program_id(2)
    q_blocks = tl.cdiv(heads_q, HEADS)
    if block < q_blocks:
        h0 = (block * HEADS).to(tl.int64)
        x = q_ptr + batch * q_b + h0 * q_h
        o = oq_ptr + batch * oq_b + h0 * oq_h
        _rotate_heads(
            x, o, q_h, q_t, oq_h, oq_t, heads_q - h0, t, tmask, first, second, jmask, c1, c2, a, b, R, rest,
            HAS_REST, HEADS, BLOCK_REST,
        )  # fmt: skip
    else:
        h0 = ((block - q_blocks) * HEADS).to(tl.int64)
        x = k_ptr + batch * k_b + h0 * k_h
        o = ok_ptr + batch * ok_b + h0 * ok_h
        _rotate_heads(
            x, o, k_h, k_t, ok_h, ok_t, heads_k - h0, t, tmask, first, second, jmask, c1, c2, a, b, R, rest,
            HAS_REST, HEADS, BLOCK_REST,
        )  # fmt: skip


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backward: bool,
    interleaved: bool,
    *,
    BLOCK_T: int,
    HEADS: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[B, Hq, T, D]`` and ``k`` ``[B, Hk, T, D]`` (unit channel stride) rotated by ``cos`` and ``sin``
    ``[B or 1, T, R]`` (unit last stride), or by the transposed rotation with ``backward``; the rotated pairs
    are the halves of the first ``R`` channels, or with ``interleaved`` the channels ``(2j, 2j + 1)``; each
    output in its input's dtype and memory layout (``torch.empty_like``)."""
    batch, heads_q, tokens, width = q.shape
    heads_k = k.shape[1]
    r = cos.shape[-1]
    oq, ok = torch.empty_like(q), torch.empty_like(k)
    HEADS = min(HEADS, next_power_of_2(max(heads_q, heads_k)))
    launch(
        _rotary_kernel,
        (cdiv(tokens, BLOCK_T), batch, cdiv(heads_q, HEADS) + cdiv(heads_k, HEADS)),
        q,
        k,
        oq,
        ok,
        cos,
        sin,
        tokens,
        heads_q,
        heads_k,
        r // 2,
        r,
        width - r,
        *q.stride()[:3],
        *k.stride()[:3],
        *oq.stride()[:3],
        *ok.stride()[:3],
        cos.stride(0) if cos.shape[0] > 1 else 0,
        cos.stride(1),
        sin.stride(0) if sin.shape[0] > 1 else 0,
        sin.stride(1),
        BACKWARD=backward,
        INTERLEAVED=interleaved,
        HAS_REST=width > r,
        BLOCK_T=BLOCK_T,
        BLOCK_HALF=next_power_of_2(r // 2),
        BLOCK_REST=next_power_of_2(max(width - r, 1)),
        HEADS=HEADS,
        num_warps=num_warps,
    )
    return oq, ok
