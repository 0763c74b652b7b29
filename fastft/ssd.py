"""Mamba-2's state-space scan (SSD) over packed documents: Bamba, Granite-4.0-H, Falcon-H1, Nemotron-H, Zamba2,
and MiniMax's lightning attention (the same scan with dt = 1).

``packed_ssd_scan(x, dt, A, B, C, info, ...)`` is transformers 5.17's ``mamba2_chunk_scan`` (and mamba_ssm's
``mamba_chunk_scan_combined``) with the state reset to 0 at every document of ``info``: on a row that holds one
document it computes the same thing; on a packed row no document sees the state of the one before it. The
specification is the token-by-token loop in ``fastft/reference/ssd.py``.

The op runs the chunked SSD algorithm on the chunk layout of ``fastft.delta_rule.chunk_table``, in which no
chunk spans two documents: tokens are gathered into ``[num_chunks_bound, chunk_size]`` slots (empty slots hold
zeros, so they add nothing), the intra-chunk part (``C B^T`` masked by the decays, and the state each chunk
leaves from a zero entering state) runs over all chunks at once, the state is carried from chunk to chunk and
zeroed where a chunk starts a document, and the outputs are gathered back. Backends: ``torch`` (the intra-chunk
part batched in torch with autograd for its backward, the carry ``scan_states``, a Python loop over chunks: the
specification) and ``triton`` (the carry ``state_scan_op``, a Triton scan forward and a reverse scan backward;
with chunks of at most 64 tokens, states of at most 256 and heads of at most 128 the whole op, ``_TritonScan``:
x and the step (discretized there) into the slots ``pack_forward_op``, B and C
``bc_pack_forward_op``, the intra-chunk part ``intra_forward_op``, the output's share from each chunk's entering
state
``output_forward_op``, the outputs back to the tokens with D and z ``unpack_forward_op``, ``kernels/ssd.py``, and
the backward written out with their ``_backward`` ops). Memory: the entering state of every chunk, fp32 ``[H,
num_chunks_bound, P, N]`` (as mamba_ssm keeps), and in the backward its gradient.

GPU syncs: none when ``info`` came from host lengths / ``cu_seqlens``; from device position ids, the one
``PackedSeqInfo`` makes when ``num_seqs`` is first read (the chunk layout's size is bounded by it).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import autotune, dispatch
from ._checks import bool_arg, float_tensor_arg, int_arg, number_arg
from ._custom_op import custom_op
from .delta_rule import MAX_CHUNK_SIZE, ChunkTable, chunk_table
from .packing import PackedSeqInfo
from .reference.ssd import discretize

__all__ = ["packed_ssd_scan"]

# The intra-chunk kernels hold a chunk's [C, C] products and [C, N] rows in registers: larger chunks or widths run
# the intra-chunk part in torch (the scan over chunks stays on Triton).
_TRITON_INTRA_MAX_CHUNK = 64

# The op's backend is that of its scan over chunks (the rest is torch on either).
OP_SCAN = dispatch.register("ssd.state_scan")
# Launch parameters only; dispatched with the forward.
OP_SCAN_BACKWARD = "ssd.state_scan_backward"
# Keyed by the entering states' elements (H * chunks * P * N). Defaults: 1024 state elements per program (8
# programs per head of 64 x 128), each chunk's loads issued two chunks ahead (``stages``: with few programs, as
# Granite-4.0-H's 48 heads, they wait out the loads' latency otherwise); ``tune`` measures Nemotron-H /
# Granite-4.0-H widths (128 heads of 64 x 128) at T=8192 and 32768. The interpreter's 64 keeps the programs few
# (each costs the interpreter milliseconds); tests/test_ssd.py runs the kernels with 8 elements a program too.
for _op in (OP_SCAN, OP_SCAN_BACKWARD):
    autotune.register(
        _op,
        autotune.Tunable(
            {"BLOCK": 1024, "num_warps": 4, "stages": 3},
            sizes=(128 * 129 * 64 * 128, 128 * 513 * 64 * 128),
            grid={"BLOCK": (256, 512, 1024, 2048), "num_warps": (2, 4, 8), "stages": (1, 3)},
            interpreter={"BLOCK": 64},
        ),
    )


def _check(x, dt, A, B, C, info, D, dt_bias, dt_softplus, dt_limit, z, chunk_size, backend):
    """Every argument check; returns (dt_limit as floats, chunk_size, the backend of the scan over chunks)."""
    float_tensor_arg("x", x, getattr(x, "device", None), "x")
    if x.dim() != 4 or 0 in x.shape[2:]:
        raise ValueError(f"x must be [B, T, H, P] with H, P >= 1, got shape {tuple(x.shape)}")
    b, t, h, p = x.shape
    float_tensor_arg("dt", dt, x.device, "x", (b, t, h), "[B, T, H]")
    float_tensor_arg("A", A, x.device, "x", (h,), "[H]")
    float_tensor_arg("B", B, x.device, "x")
    if B.dim() != 4 or B.shape[:2] != x.shape[:2] or 0 in B.shape[2:] or h % B.shape[2]:
        raise ValueError(
            f"B must be [B, T, G, N] with x's [B, T] = {(b, t)}, N >= 1 and G dividing H = {h}, got {tuple(B.shape)}"
        )
    float_tensor_arg("C", C, x.device, "x", B.shape, "B's shape [B, T, G, N]")
    if D is not None:
        float_tensor_arg("D", D, x.device, "x")
        if tuple(D.shape) not in ((h,), (h, p)):
            raise ValueError(f"D must be [H] = {(h,)} or [H, P] = {(h, p)}, got {tuple(D.shape)}")
    if dt_bias is not None:
        float_tensor_arg("dt_bias", dt_bias, x.device, "x", (h,), "[H]")
    if z is not None:
        float_tensor_arg("z", z, x.device, "x", x.shape, "x's shape [B, T, H, P]")
    bool_arg("dt_softplus", dt_softplus)
    if not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2:
        raise TypeError(f"dt_limit must be a (low, high) pair of numbers, got {dt_limit!r}")
    low, high = (number_arg("dt_limit", v) for v in dt_limit)
    if not low <= high:
        raise ValueError(f"dt_limit must have low <= high, got {dt_limit!r}")
    if not isinstance(info, PackedSeqInfo):
        raise TypeError(f"info must be a fastft.PackedSeqInfo, got {type(info).__name__}")
    if info.num_tokens != b * t:
        raise ValueError(f"info has {info.num_tokens} tokens but x has B * T = {b * t}")
    if info.device != x.device:
        raise ValueError(f"info is on {info.device} but x is on {x.device}")
    chunk_size = int_arg("chunk_size", chunk_size, minimum=1)
    if chunk_size > MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be an int from 1 to {MAX_CHUNK_SIZE}, got {chunk_size}")
    return (low, high), chunk_size, dispatch.backend_for(OP_SCAN, x.device, backend)


def packed_ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    info: PackedSeqInfo,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    z: torch.Tensor | None = None,
    chunk_size: int = 64,
    backend: str | None = None,
) -> torch.Tensor:
    """Mamba-2's scan with its state reset to 0 at every document of ``info``.

    x ``[B, T, H, P]``; dt ``[B, T, H]`` (the step before ``dt_bias``, softplus and the clamp to ``dt_limit``,
    applied in that order as transformers does); A ``[H]`` (the decay rate, ``-exp(A_log)``: not checked to
    be negative, that would sync); B, C ``[B, T, G, N]`` with G dividing H (head h reads group
    ``h // (H // G)``); D ``[H]`` or ``[H, P]`` (the skip, ``y += D * x``); dt_bias ``[H]``; z like x (the
    gate, ``y *= silu(z)``); any floating dtypes. ``info``: the ``PackedSeqInfo`` of these ``B * T`` tokens,
    read in flat order. Returns y ``[B, T, H, P]`` in x's dtype; the math is fp32 (autocast is off inside).
    No initial state and no final state: every document starts from 0, as in training. ``chunk_size``: 1 to
    256 tokens per chunk (the model's own does not change the result). ``backend``: ``auto``, ``triton`` or
    ``torch`` (default ``FASTFT_BACKEND``): which scan over chunks runs. Differentiable (works under
    ``torch.utils.checkpoint``).
    """
    dt_limit, chunk_size, chosen = _check(
        x, dt, A, B, C, info, D, dt_bias, dt_softplus, dt_limit, z, chunk_size, backend
    )
    b, t, h, p = x.shape
    if b * t == 0:
        return x.new_zeros(x.shape)
    table = chunk_table(info, chunk_size)
    with torch.autocast(x.device.type, enabled=False):
        if chosen == "triton" and chunk_size <= _TRITON_INTRA_MAX_CHUNK and B.shape[-1] <= 256 and p <= 128:
            z = None if z is None else z.reshape(b * t, h, p)
            x, dt = x.reshape(b * t, h, p), dt.reshape(b * t, h)
            return _on_triton(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, table).view(b, t, h, p)
        step = discretize(dt.reshape(b * t, h), dt_bias, dt_softplus, dt_limit).float()
        xf = x.reshape(b * t, h, p).float()  # cast once: x's gradient is summed in fp32, rounded once
        y = _chunked(xf, step, A, B, C, table, chosen)  # [N, H, P]
        if D is not None:
            y = y + xf * (D.float()[:, None] if D.dim() == 1 else D.float())
        if z is not None:
            y = y * F.silu(z.reshape(b * t, h, p).float())
    return y.reshape(b, t, h, p).to(x.dtype)


def _slots(v: torch.Tensor, table: ChunkTable) -> torch.Tensor:
    """``[N, K, D]`` -> ``[K, num_chunks, C, D]``: each token in its slot of ``table``, zeros in the empty slots."""
    num_chunks, c = table.token_index.shape
    slots = v.new_zeros(v.shape[1], num_chunks * c, v.shape[-1])
    return slots.index_copy(1, table.slot, v.transpose(0, 1)).view(v.shape[1], num_chunks, c, -1)


def _chunked(x, dt, A, B, C, table: ChunkTable, backend: str) -> torch.Tensor:
    """y ``[N, H, P]`` fp32 (without D and z) for fp32 x ``[N, H, P]`` and discretized dt ``[N, H]``: the
    chunked SSD algorithm on ``table``'s layout, heads grouped as ``[G, H // G]``, the intra-chunk part in torch;
    the scan over chunks on ``backend``."""
    n, h, p = x.shape
    g, state_size = B.shape[-2:]
    c, num_chunks = table.chunk_size, table.num_chunks_bound
    log_decay = _slots((dt * A.float())[..., None], table).view(g, h // g, num_chunks, c)  # dt * A per token
    x_dt = _slots(x * dt[..., None], table).view(g, h // g, num_chunks, c, p)
    B, C = (_slots(v.reshape(n, g, state_size).float(), table).unsqueeze(1) for v in (B, C))  # [G, 1, chunks, C, N]

    # Sums of decays over ranges of tokens are summed as such (not as differences of cumulative sums, whose
    # rounding grows with the chunk's total decay).
    cum = log_decay.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    segment = log_decay[..., :, None].expand(*log_decay.shape, c).masked_fill(~lower.tril(-1), 0).cumsum(-2)
    pairwise_decay = segment.masked_fill(~lower, float("-inf")).exp()  # [i, j]: exp(a_{j+1} + ... + a_i)
    to_end = F.pad(log_decay[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))  # a_{j+1} + ... + a_last
    y = ((C @ B.transpose(-1, -2)) * pairwise_decay) @ x_dt  # within the chunk
    local = (x_dt * to_end.exp()[..., None]).transpose(-1, -2) @ B  # [G, H/G, chunks, P, N]
    scan = state_scan_op if backend == "triton" else scan_states
    states = scan(local.reshape(h, num_chunks, -1), cum[..., -1].exp().reshape(h, num_chunks), table.first)
    y = y + (C @ states.view(local.shape).transpose(-1, -2)) * cum.exp()[..., None]  # from the entering state
    return y.reshape(h, num_chunks * c, p).transpose(0, 1).index_select(0, table.slot)


def scan_states(local: torch.Tensor, decay: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The sequential part of the chunked scan, chunk after chunk, for each head: the state entering chunk i
    (zeroed where ``first[i]``) and the state leaving it, ``state * decay + local``.

    local ``[H, NC, E]`` (the state each chunk leaves from a zero entering state, flattened), decay ``[H, NC]``
    (one per chunk: the product of its tokens' decays) or ``[H, NC, E]`` (one per element), first bool ``[NC]``.
    Returns states ``[H, NC, E]``: each chunk's entering state.
    """
    h, num_chunks, e = local.shape
    state = local.new_zeros(h, e)
    states = []
    for i in range(num_chunks):
        state = torch.where(first[i], 0.0, state)
        states.append(state)
        state = state * (decay[:, i, None] if decay.dim() == 2 else decay[:, i]) + local[:, i]
    return torch.stack(states, 1) if states else local.new_zeros(local.shape)


# ---- the scan on Triton: custom ops, a kernel each way, no validation ---------------------------------------


@custom_op("fastft::ssd_state_scan")
def state_scan_op(local: torch.Tensor, decay: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``scan_states`` on the Triton kernels (fp32 output, local's shape); differentiable."""
    from .kernels import ssd as kernels

    cfg = autotune.params(OP_SCAN, local.device, local.numel())
    return kernels.state_scan(local, decay, first, **cfg)


@state_scan_op.register_fake
def _(local, decay, first):
    return local.new_empty(local.shape, dtype=torch.float32)


@custom_op("fastft::ssd_state_scan_backward")
def state_scan_backward_op(
    decay: torch.Tensor, first: torch.Tensor, states: torch.Tensor, dstates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dlocal, ddecay) fp32 of ``state_scan_op`` from its decay, first, output and the output's gradient."""
    from .kernels import ssd as kernels

    cfg = autotune.params(OP_SCAN_BACKWARD, states.device, states.numel())
    return kernels.state_scan_backward(decay, first, states, dstates, **cfg)


@state_scan_backward_op.register_fake
def _(decay, first, states, dstates):
    return states.new_empty(states.shape, dtype=torch.float32), decay.new_empty(decay.shape, dtype=torch.float32)


def _setup(ctx, inputs, output):
    local, decay, first = inputs
    ctx.save_for_backward(decay, first, output)


def _backward(ctx, dstates):
    decay, first, states = ctx.saved_tensors
    dlocal, ddecay = state_scan_backward_op(decay, first, states, dstates)
    return dlocal, ddecay, None


state_scan_op.register_autograd(_backward, setup_context=_setup)


# ---- the intra-chunk part on Triton --------------------------------------------------------------------------


@custom_op("fastft::ssd_intra_forward")
def intra_forward_op(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bc_exact: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.ssd.intra_forward``: (y, local, decay) fp32, not differentiable."""
    from .kernels import ssd as kernels

    return kernels.intra_forward(x, a, b, c, bc_exact=bc_exact)


@intra_forward_op.register_fake
def _(x, a, b, c, bc_exact):
    h, nc, cs, p = x.shape
    f32 = torch.float32
    return (
        x.new_empty(h, nc, cs, p, dtype=f32),
        x.new_empty(h, nc, p, b.shape[-1], dtype=f32),
        x.new_empty(h, nc, dtype=f32),
    )


@custom_op("fastft::ssd_intra_backward")
def intra_backward_op(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    dy: torch.Tensor,
    dlocal: torch.Tensor,
    ddecay: torch.Tensor,
    dcum: torch.Tensor,
    bc_exact: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.ssd.intra_backward``: (dx, db, dc, da) fp32."""
    from .kernels import ssd as kernels

    return kernels.intra_backward(x, a, b, c, dy, dlocal, ddecay, dcum, bc_exact=bc_exact)


@intra_backward_op.register_fake
def _(x, a, b, c, dy, dlocal, ddecay, dcum, bc_exact):
    f32 = torch.float32
    return (
        x.new_empty(x.shape, dtype=f32),
        b.new_empty(b.shape, dtype=f32),
        b.new_empty(b.shape, dtype=f32),
        a.new_empty(a.shape, dtype=f32),
    )


@custom_op("fastft::ssd_output_forward")
def output_forward_op(
    y: torch.Tensor, a: torch.Tensor, c: torch.Tensor, states: torch.Tensor, bc_exact: bool
) -> torch.Tensor:
    """``kernels.ssd.output_forward``: the output fp32, not differentiable."""
    from .kernels import ssd as kernels

    return kernels.output_forward(y, a, c, states, bc_exact=bc_exact)


@output_forward_op.register_fake
def _(y, a, c, states, bc_exact):
    return y.new_empty(y.shape, dtype=torch.float32)


@custom_op("fastft::ssd_output_backward")
def output_backward_op(
    dy: torch.Tensor, a: torch.Tensor, c: torch.Tensor, states: torch.Tensor, bc_exact: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.ssd.output_backward``: (dcum, dstates, dc) fp32."""
    from .kernels import ssd as kernels

    return kernels.output_backward(dy, a, c, states, bc_exact=bc_exact)


@output_backward_op.register_fake
def _(dy, a, c, states, bc_exact):
    return tuple(v.new_empty(v.shape, dtype=torch.float32) for v in (a, states, c))


# ---- the tokens into the chunk layout's slots and back, on Triton ----------------------------------------------


@custom_op("fastft::ssd_pack_forward")
def pack_forward_op(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    token_index: torch.Tensor,
    dt_bias: Optional[torch.Tensor],  # noqa: UP045  (torch.library.custom_op reads it: Optional spelled out)
    dt_softplus: bool,
    dt_low: float,
    dt_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.ssd.pack_forward``: (x_dt, a) fp32, not differentiable."""
    from .kernels import ssd as kernels

    return kernels.pack_forward(x, dt, A, token_index, dt_bias, dt_softplus, (dt_low, dt_high))


@pack_forward_op.register_fake
def _(x, dt, A, token_index, dt_bias, dt_softplus, dt_low, dt_high):
    h, p = x.shape[1:]
    nc, cs = token_index.shape
    return x.new_empty(h, nc, cs, p, dtype=torch.float32), x.new_empty(h, nc, cs, dtype=torch.float32)


@custom_op("fastft::ssd_pack_backward")
def pack_backward_op(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    slot: torch.Tensor,
    dx_dt: torch.Tensor,
    da: torch.Tensor,
    dx_skip: Optional[torch.Tensor],  # noqa: UP045
    dt_bias: Optional[torch.Tensor],  # noqa: UP045
    dt_softplus: bool,
    dt_low: float,
    dt_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.ssd.pack_backward``: (dx in x's dtype, ddt in dt's dtype, dA fp32, dt_bias's gradient fp32 or
    empty)."""
    from .kernels import ssd as kernels

    return kernels.pack_backward(x, dt, A, slot, dx_dt, da, dx_skip, dt_bias, dt_softplus, (dt_low, dt_high))


@pack_backward_op.register_fake
def _(x, dt, A, slot, dx_dt, da, dx_skip, dt_bias, dt_softplus, dt_low, dt_high):
    f32 = torch.float32
    dbias = A.new_empty(A.shape if dt_bias is not None else (0,), dtype=f32)
    return x.new_empty(x.shape), dt.new_empty(dt.shape), A.new_empty(A.shape, dtype=f32), dbias


@custom_op("fastft::ssd_unpack_forward")
def unpack_forward_op(
    y: torch.Tensor,
    x: torch.Tensor,
    slot: torch.Tensor,
    D: Optional[torch.Tensor],  # noqa: UP045
    z: Optional[torch.Tensor],  # noqa: UP045
) -> torch.Tensor:
    """``kernels.ssd.unpack_forward``: the output in x's dtype, not differentiable."""
    from .kernels import ssd as kernels

    return kernels.unpack_forward(y, x, slot, D, z)


@unpack_forward_op.register_fake
def _(y, x, slot, D, z):
    return x.new_empty(x.shape)


@custom_op("fastft::ssd_unpack_backward")
def unpack_backward_op(
    dout: torch.Tensor,
    y: Optional[torch.Tensor],  # noqa: UP045
    x: torch.Tensor,
    token_index: torch.Tensor,
    D: Optional[torch.Tensor],  # noqa: UP045
    z: Optional[torch.Tensor],  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.ssd.unpack_backward``: (dy fp32, D's share of dx fp32, dD fp32, dz in z's dtype); without D the
    second and third, without z the fourth, empty."""
    from .kernels import ssd as kernels

    return kernels.unpack_backward(dout, y, x, token_index, D, z)


@unpack_backward_op.register_fake
def _(dout, y, x, token_index, D, z):
    f32 = torch.float32
    h, p = x.shape[1:]
    nc, cs = token_index.shape
    return (
        x.new_empty(h, nc, cs, p, dtype=f32),
        x.new_empty(x.shape if D is not None else (0,), dtype=f32),
        x.new_empty(D.shape if D is not None else (0,), dtype=f32),
        x.new_empty(z.shape, dtype=z.dtype) if z is not None else x.new_empty(0, dtype=f32),
    )


@custom_op("fastft::ssd_bc_pack_forward")
def bc_pack_forward_op(
    B: torch.Tensor, C: torch.Tensor, token_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.ssd.bc_pack_forward``: B and C in the slots, fp32, not differentiable."""
    from .kernels import ssd as kernels

    return kernels.bc_pack_forward(B, C, token_index)


@bc_pack_forward_op.register_fake
def _(B, C, token_index):
    g, ns = B.shape[1:]
    nc, cs = token_index.shape
    return tuple(B.new_empty(g, nc, cs, ns, dtype=torch.float32) for _ in range(2))


@custom_op("fastft::ssd_bc_pack_backward")
def bc_pack_backward_op(
    db: torch.Tensor, dc: torch.Tensor, slot: torch.Tensor, b_dtype: torch.dtype, c_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.ssd.bc_pack_backward``: B's and C's gradients ``[N, G, NS]`` in ``b_dtype`` and ``c_dtype``."""
    from .kernels import ssd as kernels

    return kernels.bc_pack_backward(db, dc, slot, b_dtype, c_dtype)


@bc_pack_backward_op.register_fake
def _(db, dc, slot, b_dtype, c_dtype):
    g, _, _, ns = db.shape
    n = slot.shape[0]
    return db.new_empty(n, g, ns, dtype=b_dtype), db.new_empty(n, g, ns, dtype=c_dtype)


# ---- the op's Triton path --------------------------------------------------------------------------------------


def _on_triton(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, table: ChunkTable) -> torch.Tensor:
    """``packed_ssd_scan``'s output ``[N, H, P]`` in x's dtype on Triton, for x ``[N, H, P]``, dt ``[N, H]``
    (before its discretization), z ``[N, H, P]`` or None and the op's other arguments (B and C ``[B, T, G, N]``)."""
    n = x.shape[0]
    g, state_size = B.shape[-2:]
    b, c = (v.reshape(n, g, state_size) for v in (B, C))
    exact = all(v.dtype in (torch.bfloat16, torch.float16) for v in (B, C))  # their fp32 copies are exact in TF32
    D = None if D is None else D.float()
    tables = (table.token_index, table.slot, table.first)
    return _TritonScan.apply(x, dt, A.float(), b, c, D, z, *tables, exact, dt_bias, dt_softplus, *dt_limit)


class _TritonScan(torch.autograd.Function):
    """``packed_ssd_scan``'s math on Triton, its backward written out (the torch path's autograd graph is its
    specification): the tokens into the chunk layout's slots (``pack_forward_op``: ``x * step`` and ``step * A``),
    the chunked algorithm (``_chunks_forward``), the slots back to the tokens with the skip and the gate
    (``unpack_forward_op``). x's gradient is summed in fp32 over its two uses (``x * step`` and ``D * x``) and
    rounded once to x's dtype. The step's discretization runs inside the tokens' pass (and its gradient inside the
    pass back). B and C go into the slots and their gradients back (``bc_pack_forward_op``,
    ``bc_pack_backward_op``). Inputs: x ``[N, H, P]`` and z (or None) in their dtypes, dt ``[N, H]`` (before its
    bias, softplus and clamp), A ``[H]`` fp32, B and C ``[N, G, N]`` in their dtypes, D (or None) fp32, the
    chunk table's token_index, slot and first, whether B and C are exact in TF32 (16-bit inputs), dt_bias (or
    None), dt_softplus and dt_limit's two ends."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, token_index, slot, first, bc_exact, dt_bias, softplus, low, high):
        x_dt, a = pack_forward_op(x, dt, A, token_index, dt_bias, softplus, low, high)
        b, c = bc_pack_forward_op(B, C, token_index)
        y, decay, states = _chunks_forward(x_dt, a, b, c, first, bc_exact)
        ctx.args = (bc_exact, B.dtype, C.dtype, softplus, low, high)
        keep = y if z is not None else None  # dz reads the output before the gate
        ctx.save_for_backward(x, dt, A, b, c, D, z, token_index, slot, first, x_dt, a, decay, states, keep, dt_bias)
        return unpack_forward_op(y, x, slot, D, z)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):  # fp32, as the forward (autocast is off there)
            x, dt, A, b, c, D, z, token_index, slot, first, x_dt, a, decay, states, y, dt_bias = ctx.saved_tensors
            bc_exact, b_dtype, c_dtype, softplus, low, high = ctx.args
            dy, dx_skip, dD, dz = unpack_backward_op(dout, y, x, token_index, D, z)
            dx_dt, da, db, dc = _chunks_backward(x_dt, a, b, c, first, decay, states, dy, bc_exact)
            skip = None if D is None else dx_skip
            dx, ddt, dA, dbias = pack_backward_op(x, dt, A, slot, dx_dt, da, skip, dt_bias, softplus, low, high)
            dB, dC = bc_pack_backward_op(db, dc, slot, b_dtype, c_dtype)
        dD, dz = None if D is None else dD, None if z is None else dz
        dbias = None if dt_bias is None else dbias.to(dt_bias.dtype)
        return dx, ddt, dA, dB, dC, dD, dz, None, None, None, None, dbias, None, None, None


def _chunks_forward(x, a, b, c, first, bc_exact=False):
    """``_chunked``'s algorithm on Triton (``intra_forward_op``, ``state_scan_op``, ``output_forward_op``): per head
    and chunk, with ``cum`` the cumulative log decay, ``y = y_intra + exp(cum) * (C states^T)``, ``states`` the scan
    over chunks of the intra-chunk kernel's ``local`` and ``decay``. Inputs fp32: x (x * dt) ``[H, NC, C, P]``, a
    (dt * A) ``[H, NC, C]``, B and C ``[G, NC, C, N]``, first ``[NC]``; returns (y ``[H, NC, C, P]``, decay, states)
    (the last two for ``_chunks_backward``). ``bc_exact``: B and C are exact in TF32 (``kernels.ssd.intra_forward``)."""
    h, nc, _, p = x.shape
    n = b.shape[-1]
    y, local, decay = intra_forward_op(x, a, b, c, bc_exact)
    states = state_scan_op(local.view(h, nc, p * n), decay, first)
    return output_forward_op(y, a, c, states.view(h, nc, p, n), bc_exact), decay, states


def _chunks_backward(x, a, b, c, first, decay, states, dy, bc_exact=False):
    """``_chunks_forward``'s backward: (dx, da, db, dc) fp32 from its inputs, decay and states and y's gradient."""
    h, nc, _, p = x.shape
    n = b.shape[-1]
    dy = dy.contiguous()
    dcum, dstates, dc_off = output_backward_op(dy, a, c, states.view(h, nc, p, n), bc_exact)
    dlocal, ddecay = state_scan_backward_op(decay, first, states, dstates.view(h, nc, p * n))
    dx, db, dc, da = intra_backward_op(x, a, b, c, dy, dlocal.view(h, nc, p, n), ddecay, dcum, bc_exact)
    return dx, da, db, dc + dc_off
