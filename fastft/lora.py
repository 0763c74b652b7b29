"""LoRA linear without the casts and elementwise passes around the adapter (``lora_linear``).

PEFT's LoRA forward with fp32 adapters (its default) on bf16 activations casts the whole input to fp32,
runs two fp32 GEMMs, scales and adds an fp32 ``[tokens, out]`` tensor and casts the sum back: five passes
over activation-sized tensors per layer and direction, around a rank-16 product. Here the adapters are
cast instead (``r * (in + out)`` elements), the low-rank product is written first and the base GEMM adds
onto it (``addmm_``, without a bias: its epilogue reads the rows while the GEMM is compute-bound, 1.03x over
eight real shapes, docs/benchmarks.md), and backward runs four thin GEMMs. There is no Triton kernel: the
saving is in the order of operations, and cuBLAS runs every product.

Numerics: the adapter path runs in the activations' dtype with the GEMMs' fp32 accumulation, so the output
differs from the reference (``fastft.reference.lora``) by the rounding of that dtype; with fp32 inputs it
matches to fp32 rounding. Adapter gradients come back in the adapters' dtype. The base weight and bias are
frozen: ``lora_linear`` raises if they require grad.

A quantized base (QLoRA: bitsandbytes 4-bit) is given as a function that returns the dequantized weight:
it is called in forward and again in backward, so no layer keeps a full-precision copy of its weight
between the two.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._checks import number_arg
from ._custom_op import custom_op

__all__ = ["lora_linear"]


class _LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, dequantize=None):
        x2 = x.reshape(-1, x.shape[-1])
        a = lora_a.to(x.dtype)
        b = lora_b.to(x.dtype)
        out, xa = forward_op(x2, weight, bias, a, b, scaling)
        ctx.dequantize = dequantize  # backward materialises the weight again instead of keeping it
        ctx.save_for_backward(x2 if lora_a.requires_grad else None, xa, None if dequantize else weight, a, b)
        ctx.scaling, ctx.shape = scaling, x.shape
        ctx.dtypes = (lora_a.dtype, lora_b.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, xa, weight, a, b = ctx.saved_tensors
        s = ctx.scaling
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        if dy.dtype != a.dtype:
            dy = dy.to(a.dtype)
        dyb = dy @ b  # [N, r]; the scaling goes into the GEMMs below
        dx = da = db = None
        if ctx.needs_input_grad[0]:
            if weight is None:
                weight = ctx.dequantize()
            dx = _scaled_mm(dyb, a, s).addmm_(dy, weight).view(ctx.shape)  # the thin product first, as forward
        if ctx.needs_input_grad[3]:
            da = _scaled_mm(dyb.T, x2, s).to(ctx.dtypes[0])
        if ctx.needs_input_grad[4]:
            db = _scaled_mm(dy.T, xa, s).to(ctx.dtypes[1])
        return dx, None, None, da, db, None, None


@custom_op("fastft::lora_linear_forward")
def forward_op(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045  (torch.library.custom_op reads it: Optional spelled out)
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x2 @ weight.T + bias + scaling * (x2 @ a.T) @ b.T``, ``x2 @ a.T``) for 2-D ``x2`` and adapters in
    its dtype: one op, so that selective checkpointing saves the output whole instead of running the
    low-rank product again to write the saved GEMM's result into."""
    xa = x2 @ a.T  # [N, r]
    if bias is None:
        # The low-rank product first, then the base GEMM adds onto it: its epilogue reads the [N, out]
        # rows while the GEMM is compute-bound, instead of a thin GEMM reading and writing them again.
        out = _scaled_mm(xa, b.T, scaling)
        out.addmm_(x2, weight.T)
    else:
        out = F.linear(x2, weight, bias)
        out.addmm_(xa, b.T, alpha=scaling)
    return out, xa


@forward_op.register_fake
def _(x2, weight, bias, a, b, scaling):
    return x2.new_empty(x2.shape[0], weight.shape[0]), x2.new_empty(x2.shape[0], a.shape[0])


def _scaled_mm(m1: torch.Tensor, m2: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * m1 @ m2`` in one GEMM (``beta=0``: the unfilled input is ignored, and not copied)."""
    return torch.addmm(m1.new_empty(()), m1, m2, beta=0, alpha=alpha)


def lora_linear(
    x: torch.Tensor,
    weight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``x @ weight.T + bias + scaling * (x @ lora_a.T) @ lora_b.T`` in ``x``'s dtype, differentiable in
    ``x``, ``lora_a`` and ``lora_b``.

    ``x``: ``[..., in]`` floating; ``weight``: ``[out, in]`` frozen, ``x``'s dtype, or a function of no
    arguments returning it (a quantized base, dequantized in forward and again in backward, never kept);
    ``bias``: ``[out]`` frozen or None; ``lora_a``: ``[r, in]``; ``lora_b``: ``[out, r]``; ``scaling``: a
    Python number. All on one device. ``TypeError`` for a non-tensor, non-floating tensor, dtype mismatch or
    non-number ``scaling``; ``ValueError`` for mismatched shapes, zero ``in`` or ``out`` features, tensors on
    several devices or a base that requires grad.
    """
    dequantize = None
    if isinstance(weight, torch.nn.Module):
        raise TypeError(
            f"weight must be a tensor or a function of no arguments returning one, got {type(weight).__name__}"
        )
    if callable(weight) and not isinstance(weight, torch.Tensor):
        dequantize, weight = weight, weight()
    for name, t in (("x", x), ("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b)) + (
        (("bias", bias),) if bias is not None else ()
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: all must be on one device")
    if weight.dim() != 2 or lora_a.dim() != 2 or lora_b.dim() != 2 or x.dim() < 1:
        raise ValueError(
            "expected weight [out, in], lora_a [r, in], lora_b [out, r], x [..., in]; "
            f"got weight {tuple(weight.shape)}, "
            f"lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, x {tuple(x.shape)}"
        )
    out_features, in_features = weight.shape
    if not in_features or not out_features:
        raise ValueError(f"weight must be [out, in] with out, in >= 1, got {tuple(weight.shape)}")
    rank = lora_a.shape[0]
    if x.shape[-1] != in_features or lora_a.shape[1] != in_features:
        raise ValueError(
            f"x [..., {x.shape[-1]}] and lora_a [r, {lora_a.shape[1]}] must match weight's in features {in_features}"
        )
    if lora_b.shape != (out_features, rank):
        raise ValueError(f"lora_b must be [out, r] = [{out_features}, {rank}], got {tuple(lora_b.shape)}")
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(
            f"weight and bias must have x's dtype {x.dtype}, got {weight.dtype}"
            + (f" and {bias.dtype}" if bias is not None else "")
        )
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("lora_linear takes a frozen base layer: weight and bias must not require grad")
    return _LoRALinear.apply(x, weight, bias, lora_a, lora_b, number_arg("scaling", scaling), dequantize)
