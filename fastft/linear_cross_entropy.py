"""A language-model head's cross-entropy without its logits: blocks of rows, never all ``[N, V]`` at once.

    loss = fastft.linear_cross_entropy(hidden, lm_head.weight, labels)              # mean over labelled rows
    loss = fastft.linear_cross_entropy(hidden, weight, labels, reduction="sum") / num_items

Stock training computes ``logits = hidden @ W^T`` for every token, upcasts them to fp32 and keeps the
log-softmax for the backward: at a 248k vocabulary and 16k tokens that is 16 GB of fp32 alone, most of a small
model's peak. Here the rows go through in blocks: per block the logits in ``hidden``'s dtype (one GEMM), the
loss and the logits' gradient written over them (one Triton pass each way over the block; the torch backend
runs ``cross_entropy_rows``' formulas), and the block's share of ``hidden``'s, ``weight``'s and ``bias``'s
gradients (GEMMs), all in the forward, since the loss is a scalar. Memory beyond the inputs: one block of
logits and the gradients. The backward scales the kept gradients by the loss's gradient.
``fastft/reference/linear_cross_entropy.py`` is the specification. No GPU sync.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from . import autotune, dispatch
from ._checks import finite_arg, int_arg
from ._custom_op import custom_op
from .kernels._launch import cdiv, next_power_of_2
from .reference import linear_cross_entropy as reference

__all__ = ["linear_cross_entropy"]

OP_CROSS_ENTROPY = dispatch.register("linear_cross_entropy.cross_entropy_rows")

# One program per row, 4,096-column steps. The interpreter takes milliseconds a step: 128-column steps keep a
# tiny model's row to one (the tests give the kernel small steps themselves, so that a row spans several).
autotune.register(
    OP_CROSS_ENTROPY,
    autotune.Tunable({"BLOCK_V": 4096, "num_warps": 8}, interpreter={"BLOCK_V": 128, "num_warps": 1}),
)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = ("mean", "sum")
MIN_BLOCK_ROWS = 256  # rows per block at least (the GEMMs' efficiency), unless fewer rows in all
TRAINED_HEAD_BLOCKS = 8  # blocks at most where the head's gradient is formed (its [V, H] sum: once per block)


def block_rows(rows: int, vocab: int, width: int, trained_head: bool = False) -> int:
    """Rows per block: a block's logits about as large as ``hidden`` (``vocab / width`` blocks), in a power of
    two of at least ``MIN_BLOCK_ROWS`` rows; with a trained head at most ``TRAINED_HEAD_BLOCKS`` blocks, since
    each block adds its share to the head's whole fp32 gradient."""
    least = min(rows, MIN_BLOCK_ROWS)
    if trained_head:
        least = max(least, next_power_of_2(cdiv(rows, TRAINED_HEAD_BLOCKS)))
    return max(least, next_power_of_2(cdiv(rows, max(cdiv(vocab, width), 1))))


@functools.cache
def _mm_to_fp32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs for ``dtype`` inputs on ``device_type``."""
    a = torch.zeros(1, 1, dtype=dtype, device=device_type)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in fp32."""
    if a.dtype == torch.float32:
        return a @ b
    if _mm_to_fp32(a.device.type, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@functools.cache
def _addmm_to_fp32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` runs for ``dtype`` ``a``, ``b`` and an fp32
    ``c`` on ``device_type`` (CUDA: one GEMM that adds into ``c``)."""
    a = torch.zeros(1, 1, dtype=dtype, device=device_type)
    c = torch.zeros(1, 1, dtype=torch.float32, device=device_type)
    try:
        return torch.addmm(c, a, a, out_dtype=torch.float32, out=c) is c
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _add_mm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``, the product accumulated in fp32 into the fp32 ``acc``."""
    if a.dtype != torch.float32 and _addmm_to_fp32(a.device.type, a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += _mm_fp32(a, b)


# ---- custom op: the whole loss and its gradients, on the backend named, no validation ------------------


@custom_op("fastft::linear_cross_entropy")
def linear_cross_entropy_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045  (torch.library.custom_op reads it: Optional spelled out)
    labels: torch.Tensor,
    ignore_index: int,
    mean: bool,
    logit_scale: float,
    softcap: Optional[float],  # noqa: UP045
    rows_per_block: int,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fp32 loss (0-d) of ``hidden`` ``[N, H]`` against ``labels`` ``[N]`` and the gradients asked for
    (``hidden``'s and ``weight``'s in their dtypes, ``bias``'s; empty where not asked) of the loss."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    labelled = (labels != ignore_index).sum()
    scale = (1.0 / labelled.float()) if mean else torch.ones((), device=hidden.device)
    scale = scale.to(torch.float32)
    grad = grad_hidden or grad_weight or grad_bias
    dh = hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight else None
    db = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if grad_bias else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    params = autotune.params(OP_CROSS_ENTROPY, hidden.device, vocab)
    for start in range(0, rows, rows_per_block):
        h, y = hidden[start : start + rows_per_block], labels[start : start + rows_per_block]
        logits = F.linear(h, weight, bias)
        if logit_scale != 1.0:
            logits.mul_(logit_scale)  # in the logits' dtype, as the model's own product
        if backend == "torch":
            loss, g = reference.cross_entropy_rows(logits, y, scale, ignore_index, softcap)
            logits = g.to(logits.dtype) if grad else logits
        else:
            from .kernels import linear_cross_entropy as kernels

            loss = kernels.cross_entropy_rows_(logits, y, scale, ignore_index, grad, softcap, **params)
        total += loss.sum()
        if grad and logit_scale != 1.0:
            logits.mul_(logit_scale)  # the product's gradient, in the logits' dtype
        if grad_hidden:
            torch.mm(logits, weight, out=dh[start : start + rows_per_block])
        if grad_weight:
            _add_mm_fp32_(dw, logits.t(), h)
        if grad_bias:
            db += logits.float().sum(0)
    loss = total * scale if mean else total
    return (
        loss,
        dh,
        dw.to(weight.dtype) if grad_weight else hidden.new_empty(0),
        db.to(bias.dtype) if grad_bias else hidden.new_empty(0),
    )


@linear_cross_entropy_op.register_fake
def _(
    hidden,
    weight,
    bias,
    labels,
    ignore_index,
    mean,
    logit_scale,
    softcap,
    rows_per_block,
    grad_hidden,
    grad_weight,
    grad_bias,
    backend,
):
    return (
        hidden.new_empty((), dtype=torch.float32),
        hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if grad_weight else hidden.new_empty(0),
        torch.empty_like(bias) if grad_bias else hidden.new_empty(0),
    )


def _scaled(grad: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    """``grad`` times the loss's gradient ``by``, in fp32 and rounded once (the same values when it is 1)."""
    return (grad.float() * by).to(grad.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, mean, logit_scale, softcap, rows_per_block, backend):
        needs = tuple(ctx.needs_input_grad[:3])  # grad mode on and the tensor requiring grad
        loss, dh, dw, db = linear_cross_entropy_op(
            hidden, weight, bias, labels, ignore_index, mean, logit_scale, softcap, rows_per_block, *needs, backend
        )
        ctx.save_for_backward(dh, dw, db)
        ctx.needs = needs
        return loss

    @staticmethod
    def backward(ctx, grad):
        dh, dw, db = ctx.saved_tensors
        h, w, b = ctx.needs
        return (
            _scaled(dh, grad) if h else None,
            _scaled(dw, grad) if w else None,
            _scaled(db, grad) if b else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


# ---- public API ---------------------------------------------------------------------------------------


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
    block_size: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The cross-entropy of ``hidden @ weight^T (+ bias)`` (times ``logit_scale``, capped at ``softcap``)
    against ``labels``, as ``F.cross_entropy((F.linear(hidden, weight, bias) * logit_scale).float(), labels)``
    (see the module docstring), without the logits of all rows at once.

    ``hidden``: ``[..., H]`` fp32, bf16 or fp16; ``weight``: ``[V, H]`` and ``bias``: ``[V]`` in its dtype;
    ``labels``: integer ``[...]`` of ``hidden``'s leading shape, on its device, already aligned with the rows
    (shift them first for next-token prediction). A row labelled ``ignore_index`` adds nothing; a label
    outside ``[0, V)`` otherwise makes the loss and gradients NaN (torch's cross-entropy raises, on a GPU
    with a device assert). ``reduction``: ``"mean"`` over labelled rows (NaN if none) or ``"sum"``.
    ``logit_scale``: a finite number the logits are multiplied by in ``hidden``'s dtype (Granite's
    ``1 / logits_scaling``, Cohere's ``logit_scale``), or None. ``softcap``: a finite positive number ``c``, the
    logits read as ``c * tanh(logits / c)`` in fp32 (Gemma's ``final_logit_softcapping``), or None. Returns the
    fp32 loss (0-d); differentiable in ``hidden``, ``weight`` and ``bias``: their gradients are formed in
    this call (grad mode on and any of them requiring grad) and scaled in the backward. ``block_size``: rows
    per block (default: ``block_rows``: blocks of logits about ``hidden``'s size, at most 8 with a trained
    head). ``backend``: ``auto``, ``triton`` or ``torch`` (default
    ``FASTFT_BACKEND``). No GPU sync.

    Raises ``TypeError`` for non-tensors, floating dtypes other than these (or that differ), non-integer
    labels, a non-int ``ignore_index`` or ``block_size``, a ``logit_scale`` or ``softcap`` that is not a number;
    ``ValueError`` for shapes that do not match, tensors on different devices, an unknown ``reduction`` or
    backend, ``block_size < 1``, a non-finite ``logit_scale``, a ``softcap`` not finite and positive.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be None or a tensor, got {type(bias).__name__}")
    if hidden.dtype not in _DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise TypeError(f"{name} must have hidden's dtype {hidden.dtype}, got {t.dtype}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    ignore_index = int_arg("ignore_index", ignore_index)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] < 1:
        raise ValueError(
            f"weight must be [V, H] with V >= 1 and H = hidden's last dim, got hidden {tuple(hidden.shape)} and "
            f"weight {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}"
        )
    for name, t in (("weight", weight), ("labels", labels), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {t.device}")
    if block_size is not None:
        block_size = int_arg("block_size", block_size, minimum=1)
    scale = 1.0 if logit_scale is None else finite_arg("logit_scale", logit_scale)
    if softcap is not None and not finite_arg("softcap", softcap) > 0:
        raise ValueError(f"softcap must be finite and > 0, got {softcap}")
    softcap = None if softcap is None else float(softcap)
    chosen = dispatch.backend_for(OP_CROSS_ENTROPY, hidden.device, backend)
    width = hidden.shape[-1]
    h = hidden.reshape(-1, width)
    if h.numel() and h.stride(-1) != 1:
        h = h.contiguous()
    y = labels.reshape(-1).to(torch.int64)
    trained_head = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    rows = block_size or block_rows(h.shape[0], weight.shape[0], width, trained_head)
    mean = reduction == "mean"
    return _LinearCrossEntropy.apply(h, weight, bias, y, ignore_index, mean, scale, softcap, rows, chosen)
