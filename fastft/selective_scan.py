"""Mamba-1's selective scan over packed documents (Jamba).

``packed_selective_scan(u, delta, A, B, C, info, ...)`` is transformers 5.17's ``mamba_selective_scan`` (and
mamba_ssm's ``selective_scan_fn``) with the state reset to 0 at every document of ``info``: on a row that holds
one document it computes the same thing; on a packed row no document sees the state of the one before it. The
specification is the token-by-token loop in ``fastft/reference/selective_scan.py``.

The scan runs chunk-parallel on the chunk layout of ``fastft.delta_rule.chunk_table`` (no chunk spans two
documents): the state each chunk leaves from a zero entering state, then the entering states carried over the
chunks (zeroed where a chunk starts a document: ``fastft.ssd``'s scan over chunks, with a decay per element of
the ``[Dm, N]`` state), then each chunk again from its entering state, giving the outputs. Backends: ``triton``
(``_TritonScan``: ``kernels/selective_scan.py``'s glue kernels read u, delta and z in their own layout and dtypes
and write the output once in u's dtype, around ``selective_scan_op``'s three kernels forward and three backward,
the backward rerunning the first two steps rather than keeping their ``[chunks, Dm, N]`` results) and ``torch``
(the same steps with a Python loop over the positions in a chunk, all chunks at once, and autograd for the
backward: it keeps every token's ``[Dm, N]`` state for the backward, as transformers' own path does).

GPU syncs: none when ``info`` came from host lengths / ``cu_seqlens``; from device position ids, the one
``PackedSeqInfo`` makes when ``num_seqs`` is first read.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import autotune, dispatch
from ._checks import bool_arg, float_tensor_arg, int_arg
from ._custom_op import custom_op
from .delta_rule import MAX_CHUNK_SIZE, ChunkTable, chunk_table
from .packing import PackedSeqInfo
from .ssd import OP_SCAN as OP_STATE_SCAN
from .ssd import OP_SCAN_BACKWARD as OP_STATE_SCAN_BACKWARD
from .ssd import scan_states

__all__ = ["packed_selective_scan"]

OP = dispatch.register("selective_scan.scan")
# Launch parameters only; dispatched with the forward.
OP_BACKWARD = "selective_scan.scan_backward"
# Keyed by u's elements (T * Dm). Defaults: sweeps on an H200 at Jamba's widths (Dm = 8192, N = 16), T=2,048 and
# 16,384. STAGES: the depth of a chunk loop's software pipeline (it loads STAGES - 1 tokens ahead); the backward's
# one warp a program keeps its sums over channels within the warp. The interpreter's 16: few programs (each costs
# the interpreter milliseconds), and tests/test_selective_scan.py's widest inputs span two.
autotune.register(
    OP,
    autotune.Tunable(
        {"BD": 128, "num_warps": 2, "STAGES": 4},
        sizes=(8192 * 8192, 32768 * 8192),
        grid={"BD": (32, 64, 128), "num_warps": (1, 2, 4), "STAGES": (1, 3, 4)},
        interpreter={"BD": 16},
    ),
)
autotune.register(
    OP_BACKWARD,
    autotune.Tunable(
        {"BD": 64, "num_warps": 1, "STAGES": 3, "PROGRAMS_PER_SM": 8},
        sizes=(8192 * 8192, 32768 * 8192),
        grid={"BD": (32, 64, 128), "num_warps": (1, 2), "STAGES": (1, 3, 4), "PROGRAMS_PER_SM": (8, 16)},
        interpreter={"BD": 16, "PROGRAMS_PER_SM": 1},
    ),
)


def _check(u, delta, A, B, C, info, D, z, delta_bias, delta_softplus, chunk_size, backend):
    """Every argument check; returns (chunk_size, the backend)."""
    float_tensor_arg("u", u, getattr(u, "device", None), "u")
    if u.dim() != 3 or u.shape[1] == 0:
        raise ValueError(f"u must be [B, Dm, T] with Dm >= 1, got shape {tuple(u.shape)}")
    b, dm, t = u.shape
    float_tensor_arg("delta", delta, u.device, "u", u.shape, "u's shape [B, Dm, T]")
    float_tensor_arg("A", A, u.device, "u")
    if A.dim() != 2 or A.shape[0] != dm or A.shape[1] == 0:
        raise ValueError(f"A must be [Dm, N] with Dm = {dm} and N >= 1, got {tuple(A.shape)}")
    for name, v in (("B", B), ("C", C)):
        float_tensor_arg(name, v, u.device, "u", (b, A.shape[1], t), "[B, N, T] with N = A.shape[1]")
    for name, v in (("D", D), ("delta_bias", delta_bias)):
        if v is not None:
            float_tensor_arg(name, v, u.device, "u", (dm,), "[Dm]")
    if z is not None:
        float_tensor_arg("z", z, u.device, "u", u.shape, "u's shape [B, Dm, T]")
    bool_arg("delta_softplus", delta_softplus)
    if not isinstance(info, PackedSeqInfo):
        raise TypeError(f"info must be a fastft.PackedSeqInfo, got {type(info).__name__}")
    if info.num_tokens != b * t:
        raise ValueError(f"info has {info.num_tokens} tokens but u has B * T = {b * t}")
    if info.device != u.device:
        raise ValueError(f"info is on {info.device} but u is on {u.device}")
    chunk_size = int_arg("chunk_size", chunk_size, minimum=1)
    if chunk_size > MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be an int from 1 to {MAX_CHUNK_SIZE}, got {chunk_size}")
    return chunk_size, dispatch.backend_for(OP, u.device, backend)


def packed_selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    info: PackedSeqInfo,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    chunk_size: int = 64,
    backend: str | None = None,
) -> torch.Tensor:
    """Mamba-1's selective scan with its state reset to 0 at every document of ``info``.

    u, delta ``[B, Dm, T]`` (channels first, as transformers and mamba_ssm pass them; delta before
    ``delta_bias`` and softplus, applied in that order); A ``[Dm, N]`` (``-exp(A_log)``); B, C ``[B, N, T]``; D
    and delta_bias ``[Dm]``; z like u (the gate, ``y *= silu(z)``); any floating dtypes. ``info``: the
    ``PackedSeqInfo`` of these ``B * T`` tokens, read in flat order. Returns y ``[B, Dm, T]`` in u's dtype
    (a transposed view of a ``[B, T, Dm]`` tensor); the math is fp32 (autocast is off inside). No initial and
    no final state. ``chunk_size`` (1 to 256) is the work unit of the chunk-parallel scan, not part of the
    result. ``backend``: ``auto``, ``triton`` or ``torch`` (default ``FASTFT_BACKEND``). Differentiable.
    """
    chunk_size, chosen = _check(u, delta, A, B, C, info, D, z, delta_bias, delta_softplus, chunk_size, backend)
    b, dm, t = u.shape
    if b * t == 0:
        return u.new_zeros(u.shape)
    table = chunk_table(info, chunk_size)

    if chosen == "triton":
        with torch.autocast(u.device.type, enabled=False):
            tables = (table.start, table.length, table.first, table.chunk_size)
            y = _TritonScan.apply(u, delta, A.float(), B, C, D, z, delta_bias, delta_softplus, *tables)
        return y.view(b, t, dm).transpose(1, 2)

    with torch.autocast(u.device.type, enabled=False):
        x, step, B, C = _tokens(u), _tokens(delta), _tokens(B), _tokens(C)
        if delta_bias is not None:
            step = step + delta_bias.float()
        if delta_softplus:
            step = F.softplus(step)
        y = _chunked(x, step, A.float(), B, C, table)
        if D is not None:
            y = y + x * D.float()
        if z is not None:
            y = y * F.silu(_tokens(z))
    return y.reshape(b, t, dm).transpose(1, 2).to(u.dtype)


def _chunked(u, delta, A, B, C, table: ChunkTable) -> torch.Tensor:
    """y ``[T, Dm]`` fp32 (without D and z) for fp32 u, delta ``[T, Dm]``, B, C ``[T, N]``: the chunk-parallel
    scan in torch, each step over all chunks at once."""
    c, num_chunks = table.chunk_size, table.num_chunks_bound
    dm, n = A.shape

    def chunks(v):  # [T, K] -> [C, num_chunks, K]: position in the chunk first; zeros in the empty slots
        slots = v.new_zeros(num_chunks * c, v.shape[-1]).index_copy(0, table.slot, v)
        return slots.view(num_chunks, c, -1).transpose(0, 1)

    u, delta, B, C = chunks(u), chunks(delta), chunks(B), chunks(C)
    decays = torch.exp(delta[..., None] * A)  # [C, chunks, Dm, N]
    inputs = (delta * u)[..., None] * B[:, :, None, :]  # empty slots: decay 1, input 0

    local = u.new_zeros(num_chunks, dm, n)
    for j in range(c):
        local = decays[j] * local + inputs[j]
    decay = torch.exp(A * delta.sum(0)[..., None])
    # reshape: products with A take A's layout, which may be transposed
    h = scan_states(local.reshape(1, num_chunks, -1), decay.reshape(1, num_chunks, -1), table.first).view(local.shape)
    out = []
    for j in range(c):
        h = decays[j] * h + inputs[j]
        out.append((h * C[j][:, None, :]).sum(-1))
    y = torch.stack(out, 1)  # [chunks, C, Dm]
    return y.reshape(num_chunks * c, dm).index_select(0, table.slot)


# ---- the scan on Triton: a custom op, its kernels, no validation ---------------------------------------------


def backward_programs(device: torch.device, per_sm: int) -> int:
    """How many programs loop over the backward's (chunk, block) pairs (each with its own scratch)."""
    if device.type != "cuda":
        return 4 * per_sm
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def chunk_states(u, delta, A, B, start, length, first):
    """(entering states, decay) ``[chunks, Dm, N]`` fp32: steps 1 and 2 of the forward."""
    from .kernels import selective_scan as kernels
    from .kernels import ssd as ssd_kernels

    cfg = autotune.params(OP, u.device, u.numel())
    local, decay = kernels.chunk_ends(u, delta, A, B, start, length, **cfg)
    scan_cfg = autotune.params(OP_STATE_SCAN, u.device, local.numel())
    states = ssd_kernels.state_scan(local.view(1, *first.shape, -1), decay.view(1, *first.shape, -1), first, **scan_cfg)
    return states.view(local.shape), decay


@custom_op("fastft::selective_scan")
def selective_scan_op(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    first: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """y ``[T, Dm]`` fp32 for fp32 u, delta ``[T, Dm]`` (delta final: biased, softplus applied), A ``[Dm, N]``,
    B, C ``[T, N]`` and a chunk table's start, length, first and chunk size: the scan on the Triton kernels,
    without D and z; differentiable."""
    from .kernels import selective_scan as kernels

    u, delta, A, B, C = (v.float().contiguous() for v in (u, delta, A, B, C))
    states, _ = chunk_states(u, delta, A, B, start, length, first)
    cfg = autotune.params(OP, u.device, u.numel())
    return kernels.chunk_outputs(u, delta, A, B, C, start, length, states, **cfg)


@selective_scan_op.register_fake
def _(u, delta, A, B, C, start, length, first, chunk_size):
    return u.new_empty(u.shape, dtype=torch.float32)


@custom_op("fastft::selective_scan_backward")
def selective_scan_backward_op(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    first: torch.Tensor,
    dy: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(du, ddelta, dA, dB, dC) fp32 of ``selective_scan_op`` from its inputs and the output's gradient."""
    from .kernels import selective_scan as kernels
    from .kernels import ssd as ssd_kernels

    u, delta, A, B, C, dy = (v.float().contiguous() for v in (u, delta, A, B, C, dy))
    states, decay = chunk_states(u, delta, A, B, start, length, first)
    cfg = autotune.params(OP_BACKWARD, u.device, u.numel())
    block = {"BD": cfg["BD"], "num_warps": cfg["num_warps"], "STAGES": cfg["STAGES"]}
    dstates = kernels.chunk_start_grads(delta, A, C, dy, start, length, **block)
    scan_cfg = autotune.params(OP_STATE_SCAN_BACKWARD, u.device, states.numel())
    flat = (1, first.shape[0], -1)
    dT, _ = ssd_kernels.state_scan_backward(decay.view(flat), first, states.view(flat), dstates.view(flat), **scan_cfg)
    programs = backward_programs(u.device, cfg["PROGRAMS_PER_SM"])
    du, ddelta, dB, dC, dA = kernels.chunk_grads(
        u, delta, A, B, C, dy, start, length, states, dT.view(states.shape), chunk_size, PROGRAMS=programs, **block
    )
    return du, ddelta, dA, dB, dC


@selective_scan_backward_op.register_fake
def _(u, delta, A, B, C, start, length, first, dy, chunk_size):
    f32 = torch.float32
    return (
        u.new_empty(u.shape, dtype=f32),
        u.new_empty(u.shape, dtype=f32),
        A.new_empty(A.shape, dtype=f32),
        B.new_empty(B.shape, dtype=f32),
        C.new_empty(C.shape, dtype=f32),
    )


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:-1])
    ctx.chunk_size = inputs[-1]


def _backward(ctx, dy):
    grads = selective_scan_backward_op(*ctx.saved_tensors, dy, ctx.chunk_size)
    return (*grads, None, None, None, None)


selective_scan_op.register_autograd(_backward, setup_context=_setup)


# ---- the glue on Triton: u, delta, z in their layout and dtypes <-> the scan's fp32 [tokens, Dm] ---------------


@custom_op("fastft::selective_scan_tokens_forward")
def tokens_forward_op(
    u: torch.Tensor,
    delta: torch.Tensor,
    delta_bias: Optional[torch.Tensor],  # noqa: UP045  (torch.library.custom_op reads it: Optional spelled out)
    delta_softplus: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.selective_scan.tokens_forward``: (x, step) fp32 ``[B * T, Dm]``, not differentiable."""
    from .kernels import selective_scan as kernels

    return kernels.tokens_forward(u, delta, delta_bias, delta_softplus)


@tokens_forward_op.register_fake
def _(u, delta, delta_bias, delta_softplus):
    b, dm, t = u.shape
    return u.new_empty(b * t, dm, dtype=torch.float32), u.new_empty(b * t, dm, dtype=torch.float32)


@custom_op("fastft::selective_scan_output_forward")
def output_forward_op(
    y: torch.Tensor,
    x: torch.Tensor,
    D: Optional[torch.Tensor],  # noqa: UP045
    z: Optional[torch.Tensor],  # noqa: UP045
    like: torch.Tensor,
) -> torch.Tensor:
    """``kernels.selective_scan.output_forward``: ``(y + D x) * silu(z)`` ``[B * T, Dm]`` in like's dtype, not
    differentiable."""
    from .kernels import selective_scan as kernels

    return kernels.output_forward(y, x, D, z, dtype=like.dtype)


@output_forward_op.register_fake
def _(y, x, D, z, like):
    return x.new_empty(x.shape, dtype=like.dtype)


@custom_op("fastft::selective_scan_output_backward")
def output_backward_op(
    dout: torch.Tensor,
    y: Optional[torch.Tensor],  # noqa: UP045
    x: torch.Tensor,
    D: Optional[torch.Tensor],  # noqa: UP045
    z: Optional[torch.Tensor],  # noqa: UP045
    t: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.selective_scan.output_backward``: (dys fp32, dz in z's dtype, dD fp32); the last two empty
    without z / D."""
    from .kernels import selective_scan as kernels

    return kernels.output_backward(dout, y, x, D, z, t)


@output_backward_op.register_fake
def _(dout, y, x, D, z, t):
    return (
        x.new_empty(x.shape, dtype=torch.float32),
        z.new_empty(z.shape) if z is not None else x.new_empty(0),
        x.new_empty(x.shape[1] if D is not None else 0, dtype=torch.float32),
    )


@custom_op("fastft::selective_scan_tokens_backward")
def tokens_backward_op(
    du: torch.Tensor,
    ddelta: torch.Tensor,
    dys: torch.Tensor,
    D: Optional[torch.Tensor],  # noqa: UP045
    delta: torch.Tensor,
    delta_bias: Optional[torch.Tensor],  # noqa: UP045
    delta_softplus: bool,
    u_like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.selective_scan.tokens_backward``: (du in u_like's dtype, ddelta in delta's, both ``[B, Dm, T]``;
    dbias fp32 ``[Dm]``, empty without a bias)."""
    from .kernels import selective_scan as kernels

    return kernels.tokens_backward(du, ddelta, dys, D, delta, delta_bias, delta_softplus, u_dtype=u_like.dtype)


@tokens_backward_op.register_fake
def _(du, ddelta, dys, D, delta, delta_bias, delta_softplus, u_like):
    return (
        delta.new_empty(delta.shape, dtype=u_like.dtype),
        delta.new_empty(delta.shape),
        du.new_empty(du.shape[1] if delta_bias is not None else 0, dtype=torch.float32),
    )


class _TritonScan(torch.autograd.Function):
    """``packed_selective_scan``'s math on Triton, its backward written out (the torch path's autograd graph is
    its specification): u and delta (with its bias and softplus) into fp32 tokens (``tokens_forward_op``), the
    chunk-parallel scan (``selective_scan_op``), the skip and the gate back in u's dtype (``output_forward_op``).
    Its backward reruns ``tokens_forward_op`` rather than keep its fp32 results; with z it keeps the scan's
    output for z's gradient. Returns ``[B * T, Dm]``."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, bias, softplus, start, length, first, chunk_size):
        x, step = tokens_forward_op(u, delta, bias, softplus)
        Bt, Ct = _tokens(B), _tokens(C)
        y = selective_scan_op(x, step, A, Bt, Ct, start, length, first, chunk_size)
        ctx.save_for_backward(u, delta, A, B, C, D, z, bias, start, length, first, y if z is not None else None)
        ctx.softplus, ctx.chunk_size = softplus, chunk_size
        return output_forward_op(y, x, D, z, u)

    @staticmethod
    def backward(ctx, dout):
        u, delta, A, B, C, D, z, bias, start, length, first, y = ctx.saved_tensors
        b, dm, t = u.shape
        with torch.autocast(dout.device.type, enabled=False):
            x, step = tokens_forward_op(u, delta, bias, ctx.softplus)
            dys, dz, dD = output_backward_op(dout.reshape(b * t, dm), y, x, D, z, t)
            grads = selective_scan_backward_op(x, step, A, _tokens(B), _tokens(C), start, length, first, dys,
                                               ctx.chunk_size)  # fmt: skip
            du_s, ddelta_s, dA, dB, dC = grads
            du, ddelta, dbias = tokens_backward_op(du_s, ddelta_s, dys, D, delta, bias, ctx.softplus, u)

        def channels_first(v, like):  # [B * T, N] -> [B, N, T]
            return v.view(b, t, -1).transpose(1, 2).to(like.dtype)

        return (
            du,
            ddelta,
            dA,
            channels_first(dB, B),
            channels_first(dC, C),
            None if D is None else dD.to(D.dtype),
            None if z is None else dz,
            None if bias is None else dbias.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def _tokens(v):
    """``[B, K, T]`` -> fp32 ``[B * T, K]`` contiguous."""
    return v.transpose(1, 2).reshape(-1, v.shape[1]).float().contiguous()
