"""Packed short convolution: a causal depthwise conv1d that restarts at every document of a packed row.

    info = fastft.packed_seq_info(position_ids=position_ids)                   # once per batch
    out = fastft.packed_conv1d(x, conv.weight, info, activation="silu")       # [B, T, C] in and out

The short convolutions of Gated DeltaNet (Qwen3.5, Qwen3-Next), LFM2 and Mamba-2 mixers. Each document
is convolved alone, with ``W - 1`` zeros before its first token, exactly as ``F.conv1d(doc.T, weight,
padding=W-1)[..., :len]`` (the torch reference in ``fastft/reference/conv.py`` is the specification):

    out[t, c] = act(bias[c] + sum_{j < W, j <= pos[t]} weight[c, W-1-j] * x[t-j, c])

``pos`` is ``info.position_ids`` (the position of each token inside its document). Sums in fp32, the
output in ``x``'s dtype. Backends: ``triton`` (forward: tokens x channels tiles; backward: each program
walks a block of tokens one at a time, the last W inputs and gradients in registers, so that each token's
SiLU derivative is recomputed once and x, dout and dx cross memory once; dweight/dbias sums per program,
then summed in a fixed order by a second kernel: deterministic) and ``torch`` (W masked shifted sums over
the stream). Neither syncs the GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import autotune, dispatch
from ._custom_op import custom_op
from .packing import PackedSeqInfo
from .reference import conv as reference

__all__ = ["packed_conv1d"]

OP_CONV = dispatch.register("conv.conv1d")
# Launch parameters only; dispatched with the forward op.
OP_CONV_BACKWARD = "conv.conv1d_backward"

# A fixed configuration: tiles of 32 tokens x 128 channels (256-byte bf16 rows); the interpreter's small
# tiles make small test inputs span several programs.
autotune.register(
    OP_CONV,
    autotune.Tunable({"BLOCK_T": 32, "BLOCK_C": 128, "num_warps": 4}, interpreter={"BLOCK_T": 8, "BLOCK_C": 16}),
)
# The backward: BLOCK_C channels (4 per thread), GROUP tokens' loads in flight per thread, and blocks of
# tokens sized for about PROGRAMS programs; registers capped at maxnreg (several programs per SM).
autotune.register(
    OP_CONV_BACKWARD,
    autotune.Tunable(
        {"BLOCK_C": 512, "GROUP": 4, "PROGRAMS": 1024, "num_warps": 4, "maxnreg": 128},
        interpreter={"BLOCK_C": 16, "GROUP": 2, "PROGRAMS": 4},
    ),
)
_MIN_BLOCK_T, _MAX_BLOCK_T = 8, 1024  # tokens per backward program

MAX_WIDTH = 8  # kernel widths accepted (the kernels unroll over the taps)
ACTIVATIONS = (None, "silu", "swish")  # "swish" is transformers' configs' name for SiLU
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- custom ops: one kernel (or the torch implementation) per call, on the backend named, no validation ---


@custom_op("fastft::packed_conv1d")
def conv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045  (torch.library.custom_op reads it: Optional spelled out)
    pos: torch.Tensor,
    silu: bool,
    backend: str,
) -> torch.Tensor:
    """``[N, C]`` in ``x.dtype``: ``x`` ``[N, C]`` with unit channel stride, contiguous ``weight`` ``[C, W]``,
    ``bias`` ``[C]`` or None, int64 positions ``pos`` ``[N]``."""
    if backend == "torch" or x.numel() == 0:
        return reference.shifted_conv1d(x, weight, bias, pos, silu)
    from .kernels import conv as kernels

    cfg = autotune.params(OP_CONV, x.device, x.numel())
    return kernels.conv1d_forward(x, weight, bias, pos, silu, **cfg)


@conv_op.register_fake
def _(x, weight, bias, pos, silu, backend):
    return x.new_empty(x.shape)


@custom_op("fastft::packed_conv1d_backward")
def conv_backward_op(
    dout: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    pos: torch.Tensor,
    silu: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in ``x.dtype``, dweight ``[C, W]`` in ``weight.dtype``, dbias ``[C]`` in ``bias.dtype`` (weight's
    without bias)); the sums in fp32."""
    if backend == "torch" or x.numel() == 0:
        dx, dweight, dbias = reference.shifted_conv1d_backward(dout, x, weight, bias, pos, silu)
        return dx, dweight.to(weight.dtype), dbias.to((weight if bias is None else bias).dtype)
    from .kernels import conv as kernels

    cfg = dict(autotune.params(OP_CONV_BACKWARD, x.device, x.numel()))
    n, c = x.shape
    # the largest power of two of tokens per program that still makes PROGRAMS programs
    per_program = max(n * -(-c // cfg["BLOCK_C"]) // cfg.pop("PROGRAMS"), 1)
    cfg["BLOCK_T"] = min(max(1 << (per_program.bit_length() - 1), _MIN_BLOCK_T), _MAX_BLOCK_T)
    return kernels.conv1d_backward(dout, x, weight, bias, pos, silu, **cfg)


@conv_backward_op.register_fake
def _(dout, x, weight, bias, pos, silu, backend):
    c = weight.shape[0]
    return x.new_empty(x.shape), weight.new_empty(weight.shape), (weight if bias is None else bias).new_empty((c,))


def _setup(ctx, inputs, output):
    x, weight, bias, pos, silu, backend = inputs
    ctx.silu, ctx.backend = silu, backend
    ctx.save_for_backward(x, weight, bias, pos)


def _backward(ctx, grad):
    x, weight, bias, pos = ctx.saved_tensors
    dx, dweight, dbias = conv_backward_op(grad.contiguous(), x, weight, bias, pos, ctx.silu, ctx.backend)
    return dx, dweight, None if bias is None else dbias, None, None, None


conv_op.register_autograd(_backward, setup_context=_setup)


# ---- public API ---------------------------------------------------------------------------------------


def _check(x, weight, info, bias, activation) -> int:
    """Every argument check; returns the kernel width W."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [B, T, C] or [T, C], got shape {tuple(x.shape)}")
    c = x.shape[-1]
    if c == 0:
        raise ValueError(f"x must have at least one channel (C >= 1), got shape {tuple(x.shape)}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a tensor, got {type(weight).__name__}")
    if weight.dtype not in _DTYPES:
        raise TypeError(f"weight must be float32, bfloat16 or float16, got {weight.dtype}")
    if not (weight.dim() == 2 or (weight.dim() == 3 and weight.shape[1] == 1)) or weight.shape[0] != c:
        raise ValueError(
            f"weight must be [C, W] or nn.Conv1d's depthwise [C, 1, W] with C={c} (x's channels), "
            f"got shape {tuple(weight.shape)}"
        )
    w = weight.shape[-1]
    if not 1 <= w <= MAX_WIDTH:
        raise ValueError(f"weight's kernel width W must be 1 to {MAX_WIDTH}, got {w}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
        if bias.dtype not in _DTYPES:
            raise TypeError(f"bias must be float32, bfloat16 or float16, got {bias.dtype}")
        if tuple(bias.shape) != (c,):
            raise ValueError(f"bias must be [C]=({c},), got shape {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device}, x on {x.device}")
    if not isinstance(info, PackedSeqInfo):
        raise TypeError(f"info must be a PackedSeqInfo from fastft.packed_seq_info, got {type(info).__name__}")
    tokens = x.numel() // c if c else (x.shape[0] * x.shape[1] if x.dim() == 3 else x.shape[0])
    if info.num_tokens != tokens:
        raise ValueError(f"info describes {info.num_tokens} tokens, x has {tokens} ({tuple(x.shape)} without C)")
    if info.device != x.device:
        raise ValueError(f"info is on {info.device}, x on {x.device}")
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be None or a str, got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return w


def packed_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    info: PackedSeqInfo,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d of each document of ``info`` alone; returns x's shape and dtype.

    ``x`` is ``[B, T, C]`` or ``[T, C]`` (token-major, as a projection writes it; any strides), its
    ``B * T`` tokens those ``info`` describes, in order. ``weight`` is ``[C, W]`` or ``nn.Conv1d``'s
    depthwise ``[C, 1, W]`` (``conv.weight`` as it is), ``1 <= W <= 8``; ``bias`` ``[C]`` or None.
    ``activation``: None, ``"silu"`` or ``"swish"`` (the same). x, weight and bias may differ in floating
    dtype (fp32, bf16, fp16); sums are fp32. Differentiable in x, weight and bias. ``backend``: ``auto``,
    ``triton`` or ``torch`` (default ``FASTFT_BACKEND``). No GPU sync.

    Raises ``TypeError`` for a non-tensor or non-floating x/weight/bias, a non-PackedSeqInfo ``info`` or a
    non-str activation; ``ValueError`` for shapes (x not 2-D/3-D or without channels, weight not ``[C, W]``/
    ``[C, 1, W]``, W outside 1..8, bias not ``[C]``), ``info.num_tokens`` other than x's tokens, tensors on
    other devices than x, an unknown activation or backend.
    """
    w = _check(x, weight, info, bias, activation)
    chosen = dispatch.backend_for(OP_CONV, x.device, backend)
    c = x.shape[-1]
    x2 = x.reshape(-1, c)
    if c > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    pos = info.position_ids.reshape(-1)
    silu = activation is not None
    out = conv_op(x2, weight.reshape(c, w).contiguous(), None if bias is None else bias.contiguous(), pos, silu, chosen)
    return out.view(x.shape)
