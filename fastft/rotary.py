"""Rotary position embeddings of queries and keys in one pass each way: ``fastft.rotary(q, k, cos, sin)``.

    q, k = fastft.rotary(query_states, key_states, cos, sin)      # transformers' apply_rotary_pos_emb(q, k, cos, sin)

transformers spells it ``q * cos + rotate_half(q) * sin`` (and the same for ``k``): a slice, a negation, a
concatenation, two products and a sum for each, every one a kernel reading and writing ``[B, H, T, D]``, and
the backward as many again. Here one launch reads ``q``, ``k``, ``cos`` and ``sin`` once and writes both
outputs, in fp32 rounded once; the backward likewise. ``cos`` and ``sin`` ``[B or 1, T, R]`` rotate the first
``R`` channels (``R < D``: the partial rotary of GPT-NeoX, Phi-3, Qwen3.5...); the rest pass through. With
``interleaved=True`` the rotated pairs are the channels ``(2j, 2j + 1)`` rather than the halves ``(j, j + R/2)``
(Cohere's, GLM's, Helium's and Ernie 4.5's ``rotate_half``).
``fastft/reference/rotary.py`` is the specification. Backends: ``triton`` and ``torch`` (the reference, its
gradient written out). No GPU sync.
"""

from __future__ import annotations

import torch

from . import autotune, dispatch
from ._checks import bool_arg
from ._custom_op import custom_op
from .reference import rotary as reference

__all__ = ["rotary"]

OP_ROTARY = dispatch.register("rotary.rotary")

# 8 tokens of one head a program: near the best of a sweep at Qwen3-8B's and Qwen3.5's widths (docs/benchmarks.md).
# The interpreter runs a program in milliseconds: a tiny model's heads and tokens
# in one for q and one for k (the tests give the kernel small tiles themselves).
autotune.register(
    OP_ROTARY,
    autotune.Tunable(
        {"BLOCK_T": 8, "HEADS": 1, "num_warps": 4}, interpreter={"BLOCK_T": 128, "HEADS": 16, "num_warps": 1}
    ),
)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- custom ops: one kernel (or the torch reference) per call, on the backend named, no validation ----


def _run(q, k, cos, sin, backward: bool, interleaved: bool, backend: str):
    if backend == "torch":
        return (reference.rotary_backward if backward else reference.rotary)(q, k, cos, sin, interleaved)
    from .kernels import rotary as kernels

    size = q.shape[2] * (q.shape[1] + k.shape[1])
    return kernels.rotary(q, k, cos, sin, backward, interleaved, **autotune.params(OP_ROTARY, q.device, size))


@custom_op("fastft::rotary")
def rotary_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[B, Hq, T, D]`` and ``k`` ``[B, Hk, T, D]`` (unit channel stride) rotated by ``cos`` and ``sin``
    ``[B or 1, T, R]`` (unit last stride)."""
    return _run(q, k, cos, sin, False, interleaved, backend)


@rotary_op.register_fake
def _(q, k, cos, sin, interleaved, backend):
    return torch.empty_like(q), torch.empty_like(k)


@custom_op("fastft::rotary_backward")
def rotary_backward_op(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``'s and ``k``'s gradients from the outputs', ``dq`` and ``dk`` (unit channel stride)."""
    return _run(dq, dk, cos, sin, True, interleaved, backend)


@rotary_backward_op.register_fake
def _(dq, dk, cos, sin, interleaved, backend):
    return torch.empty_like(dq), torch.empty_like(dk)


def _setup(ctx, inputs, output):
    q, k, cos, sin, interleaved, backend = inputs
    ctx.args = (interleaved, backend)
    ctx.inputs = [(t.shape, t.dtype, t.device) for t in (q, k)]  # for a gradient not given; not the tensors
    ctx.save_for_backward(cos, sin)


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    grads = [
        torch.zeros(shape, dtype=dtype, device=device) if g is None else _unit(g)
        for g, (shape, dtype, device) in zip((grad_q, grad_k), ctx.inputs)
    ]
    dq, dk = rotary_backward_op(*grads, cos, sin, *ctx.args)
    return dq, dk, None, None, None, None


rotary_op.register_autograd(_backward, setup_context=_setup)


# ---- public API ---------------------------------------------------------------------------------------


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` with their first ``R`` channels rotated: ``x * cos + rotate_half(x) * sin`` as
    transformers' ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``), computed in fp32 and returned in each
    input's dtype (see the module docstring). ``interleaved``: ``rotate_half`` of the pairs ``(2j, 2j + 1)``
    (Cohere's, GLM's), ``cos`` and ``sin`` in the same layout.

    ``q``: ``[B, Hq, T, D]`` and ``k``: ``[B, Hk, T, D]``, fp32, bf16 or fp16, any strides (a transposed view
    of ``[B, T, H, D]`` is read as it lies, and the Triton path's outputs keep its layout); ``cos``, ``sin``:
    ``[B or 1, T, R]`` of these dtypes, ``R`` even and at most ``D``. Differentiable in ``q`` and ``k``; ``cos``
    and ``sin`` take no gradient. ``backend``: ``auto``, ``triton`` or ``torch`` (default ``FASTFT_BACKEND``). No
    GPU sync.

    Raises ``TypeError`` for non-tensors or other dtypes, a non-bool ``interleaved``; ``ValueError`` for other
    shapes, tensors on different devices, a ``cos`` or ``sin`` that requires grad, an unknown backend.
    """
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [B, H, T, D], got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    batch, _, tokens, width = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, tokens, width):
        raise ValueError(f"k must be [B, Hk, T, D] with q's B, T and D {batch, tokens, width}, got {tuple(k.shape)}")
    if cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must be [B or 1, T, R] of one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    r = cos.shape[2]
    if cos.shape[0] not in (1, batch) or cos.shape[1] != tokens or r % 2 or not 0 < r <= width:
        raise ValueError(
            f"cos and sin must be [B or 1, T, R] with B={batch}, T={tokens} and R even in [2, D={width}], "
            f"got {tuple(cos.shape)}"
        )
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("cos and sin must not require grad: fastft.rotary does not differentiate them")
    interleaved = bool_arg("interleaved", interleaved)
    chosen = dispatch.backend_for(OP_ROTARY, q.device, backend)
    if q.numel() == 0 or k.numel() == 0:
        return reference.rotary(q, k, cos, sin, interleaved)
    return rotary_op(_unit(q), _unit(k), _unit(cos), _unit(sin), interleaved, chosen)
