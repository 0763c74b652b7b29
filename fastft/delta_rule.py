"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3.5-MoE, Qwen3-Next; Kimi Delta Attention: Kimi-Linear)
over packed documents.

``gated_delta_rule(q, k, v, g, beta, info)`` is transformers 5.17's ``torch_chunk_gated_delta_rule`` with the
recurrent state reset to 0 at every document of ``info``: on a row that holds one document it computes the
same thing; on a packed row no document sees the state of the one before it. With one decay per key channel
(``g`` ``[B, T, H, Dk]``) it is ``chunk_kimi_delta_attention`` (Kimi-Linear) with the reset. The specification
is the token-by-token loop in ``fastft/reference/delta_rule.py``.

The op runs the chunked WY/UT-transform algorithm on a chunk layout in which no chunk spans two documents.
``chunk_table(info, chunk_size)`` builds that layout: tokens are gathered into ``[num_chunks_bound, chunk_size]``
slots (empty slots hold zeros: g = 0, beta = 0, q = k = v = 0), the intra-chunk part runs batched over all chunks,
the state is carried from chunk to chunk and zeroed where a chunk starts a document, and the outputs are gathered
back. Backends: ``torch`` (the intra-chunk part batched in torch with autograd for its backward, the carry
``scan_chunks``, a Python loop over chunks: the specification) and ``triton`` (the carry ``chunk_scan_op``, a
Triton scan forward and a reverse scan backward; with one decay per head, chunks of at most 64 tokens and heads of
at most 128 the whole op, ``_TritonChunks``: the tokens into the slots with q's and k's l2norm ``pack_forward_op``,
``intra_forward_op``, ``output_forward_op``, the slots back to the tokens ``unpack_forward_op``, their backward
ops, ``kernels/delta_rule.py``, and the backward written out; otherwise the rest stays torch). The Triton
backward reads the entering states the forward returned (the op keeps them anyway, for ``query @ states``) and
writes the gradient of every chunk's leaving state, one more fp32 ``[H, num_chunks_bound, Dk, Dv]`` tensor (64 KiB
per chunk and head at 128 x 128: 270 MiB at T=8192, 32 heads, chunk 64) alive during the op's backward.

GPU syncs: none when ``info`` came from host lengths / ``cu_seqlens``; from device position ids, the one
``PackedSeqInfo`` makes when ``num_seqs`` is first read (the chunk layout's size is bounded by it).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import torch

from . import autotune, dispatch
from ._checks import int_arg, number_arg
from ._custom_op import custom_op
from .kernels._launch import next_power_of_2
from .packing import PackedSeqInfo
from .reference.delta_rule import l2norm

MAX_CHUNK_SIZE = 256
# The intra-chunk kernels hold a chunk's [C, C] products and [C, D] rows in registers: larger chunks or heads run
# the intra-chunk part in torch (the scan over chunks stays on Triton).
_TRITON_INTRA_MAX_CHUNK = 64
_TRITON_INTRA_MAX_WIDTH = 128

# The op's backend is that of its scan over chunks (the rest is torch on either).
OP_SCAN = dispatch.register("delta_rule.chunk_scan")
# Launch parameters only; dispatched with the forward.
OP_SCAN_BACKWARD = "delta_rule.chunk_scan_backward"
# Keyed by w's elements (H * chunks * C * Dk). Defaults: 32 value columns of the state per program (128
# programs at 32 heads of 128); ``tune`` measures Qwen3.5's widths at T=8192 and 32768. The interpreter's 16
# makes small test inputs span several programs. The grid holds the configurations checked against the torch
# loop on a GPU: Triton 3.6 compiles 8 warps at BV=16 to an illegal memory access (both kernels), and 8 warps
# or BV=64 were never faster than the defaults where they ran.
for _op in (OP_SCAN, OP_SCAN_BACKWARD):
    autotune.register(
        _op,
        autotune.Tunable(
            {"BV": 32, "num_warps": 4},
            sizes=(32 * 135 * 64 * 128, 32 * 543 * 64 * 128),
            grid={"BV": (16, 32), "num_warps": (2, 4)},
            interpreter={"BV": 16},
        ),
    )


@dataclasses.dataclass(frozen=True)
class ChunkTable:
    """Chunks of at most ``chunk_size`` tokens that never span two documents, for one ``PackedSeqInfo``.

    A document of length L starting at flat token s is cut into chunks starting at s, s + C, s + 2C, ...;
    chunks are numbered in token order. Tensors are on the info's device; slots past ``num_chunks`` are
    padding (``length`` 0).
    """

    chunk_size: int  # C: the most tokens in one chunk
    num_chunks_bound: int  # host bound on the chunk count, every tensor's length: min(N, (N + num_seqs*(C-1)) // C)
    num_chunks: torch.Tensor  # int64 0-dim: chunks actually used (the first ``num_chunks`` entries)
    doc: torch.Tensor  # int32 [bound]: each chunk's document (global index); num_seqs for padding chunks
    start: torch.Tensor  # int32 [bound]: flat index of each chunk's first token; num_tokens for padding chunks
    length: torch.Tensor  # int32 [bound]: tokens in each chunk, 1..C; 0 for padding chunks
    first: torch.Tensor  # bool [bound]: the chunk starts its document (the state is reset before it)
    token_index: torch.Tensor  # int64 [bound, C]: the flat token in each slot (start + j), num_tokens if empty
    slot: torch.Tensor  # int64 [num_tokens]: each token's slot in ``token_index.view(-1)`` (chunk * C + j)


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # info -> {chunk_size: ChunkTable}


def _check_chunk_size(chunk_size) -> int:
    chunk_size = int_arg("chunk_size", chunk_size, minimum=1)
    if chunk_size > MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be an int from 1 to {MAX_CHUNK_SIZE}, got {chunk_size}")
    return chunk_size


def chunk_table(info: PackedSeqInfo, chunk_size: int = 64) -> ChunkTable:
    """The ``ChunkTable`` of ``info`` for ``chunk_size`` (1 to 256), built on the info's device from its
    ``position_ids`` and ``doc_ids`` and kept for later calls with the same info. No GPU sync when the info
    came from host lengths; from device position ids, reading ``num_seqs`` syncs once (per info)."""
    if not isinstance(info, PackedSeqInfo):
        raise TypeError(f"info must be a fastft.PackedSeqInfo, got {type(info).__name__}")
    chunk_size = _check_chunk_size(chunk_size)
    memo = not torch.compiler.is_compiling()
    if memo and chunk_size in _tables.get(info, {}):
        return _tables[info][chunk_size]
    table = _build_table(info, chunk_size)
    if memo:
        _tables.setdefault(info, {})[chunk_size] = table
    return table


def _build_table(info: PackedSeqInfo, c: int) -> ChunkTable:
    n, num_seqs, device = info.num_tokens, info.num_seqs, info.device
    bound = min(n, (n + num_seqs * (c - 1)) // c)
    pos = info.position_ids.reshape(-1)
    offset = pos % c
    starts_chunk = offset == 0
    chunk = torch.cumsum(starts_chunk, 0) - 1
    slot = chunk * c + offset
    tokens = torch.arange(n, device=device)
    token_index = torch.full((bound * c,), n, dtype=torch.int64, device=device).scatter_(0, slot, tokens)
    token_index = token_index.view(bound, c)
    start = token_index[:, 0]
    # Per-token values with one more entry at index n, read by the padding chunks.
    doc = torch.cat([info.doc_ids.reshape(-1), info.doc_ids.new_full((1,), num_seqs)])[start]
    first = torch.cat([pos == 0, pos.new_zeros(1, dtype=torch.bool)])[start]
    return ChunkTable(
        chunk_size=c,
        num_chunks_bound=bound,
        num_chunks=starts_chunk.sum(),
        doc=doc.to(torch.int32),
        start=start.to(torch.int32),
        length=(token_index < n).sum(1).to(torch.int32),
        first=first,
        token_index=token_index,
        slot=slot,
    )


# ---- the op -------------------------------------------------------------------------------------------


def _check(q, k, v, g, beta, info, scale, use_qk_l2norm, backend) -> str:
    """Every argument check; returns the backend of the scan over chunks."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, Dk], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} (repeat heads before the call), got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, Dv] with q's [B, T, H] = {tuple(q.shape[:3])}, got {tuple(v.shape)}")
    if 0 in (q.shape[2], q.shape[3], v.shape[3]):
        raise ValueError(f"H, Dk and Dv must be >= 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if g.shape not in (q.shape[:3], q.shape):
        raise ValueError(
            f"g must be [B, T, H] = {tuple(q.shape[:3])} or [B, T, H, Dk] = {tuple(q.shape)}, got {tuple(g.shape)}"
        )
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    if not isinstance(info, PackedSeqInfo):
        raise TypeError(f"info must be a fastft.PackedSeqInfo, got {type(info).__name__}")
    if info.num_tokens != q.shape[0] * q.shape[1]:
        raise ValueError(f"info has {info.num_tokens} tokens but q has B * T = {q.shape[0] * q.shape[1]}")
    if info.device != q.device:
        raise ValueError(f"info is on {info.device} but q is on {q.device}")
    if scale is not None:
        number_arg("scale", scale)
    if not isinstance(use_qk_l2norm, bool):
        raise TypeError(f"use_qk_l2norm must be a bool, got {type(use_qk_l2norm).__name__}")
    return dispatch.backend_for(OP_SCAN, q.device, backend)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    info: PackedSeqInfo,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    backend: str | None = None,
) -> torch.Tensor:
    """The gated delta rule with its state reset to 0 at every document of ``info``.

    q, k ``[B, T, H, Dk]``; v ``[B, T, H, Dv]`` (heads already repeated to the value heads, as transformers
    does before its call); g, the log decay (<= 0: not checked, that would sync), ``[B, T, H]`` (Gated
    DeltaNet) or ``[B, T, H, Dk]`` (one per key channel: Kimi Delta Attention); beta ``[B, T, H]``; any
    floating dtypes. ``info``: the ``PackedSeqInfo`` of these ``B * T`` tokens, read in flat order.
    ``use_qk_l2norm`` normalises q and k over the head dim (transformers' ``use_qk_l2norm_in_kernel``),
    ``scale`` multiplies q (default ``Dk ** -0.5``). Returns o ``[B, T, H, Dv]`` in q's dtype; the math is
    fp32 (autocast is off inside). No ``initial_state`` and no final state: every document starts from 0,
    as in training. ``backend``: ``auto``, ``triton`` or ``torch`` (default ``FASTFT_BACKEND``): which
    scan over chunks runs, the Triton kernels or the torch loop; the rest is torch either way.
    Differentiable (works under ``torch.utils.checkpoint``).
    """
    chosen = _check(q, k, v, g, beta, info, scale, use_qk_l2norm, backend)
    chunk_size = _check_chunk_size(chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if b * t == 0:
        return q.new_zeros(b, t, h, dv)
    table = chunk_table(info, chunk_size)
    with torch.autocast(q.device.type, enabled=False):
        o = _chunked(q, k, v, g, beta, table, scale, use_qk_l2norm, chosen)
    return o.reshape(b, t, h, dv).to(q.dtype)


def _chunked(q, k, v, g, beta, table: ChunkTable, scale: float, use_qk_l2norm: bool, backend: str) -> torch.Tensor:
    """o ``[N, H, Dv]`` (fp32; in q's dtype on the whole Triton path): transformers' chunked algorithm, its
    steps and names, on ``table``'s layout; the scan over chunks on ``backend``."""
    b, t, h, _ = q.shape
    n, c, num_chunks = b * t, table.chunk_size, table.num_chunks_bound
    per_channel = g.dim() == 4
    triton_intra = c <= _TRITON_INTRA_MAX_CHUNK and max(q.shape[-1], v.shape[-1]) <= _TRITON_INTRA_MAX_WIDTH
    if backend == "triton" and not per_channel and triton_intra:
        q, k, v = (x.reshape(n, h, x.shape[-1]) for x in (q, k, v))
        g, beta = g.reshape(n, h), beta.reshape(n, h)
        return _TritonChunks.apply(q, k, v, g, beta, table.token_index, table.slot, table.first, scale, use_qk_l2norm)
    q, k, v = (x.reshape(n, h, x.shape[-1]).float() for x in (q, k, v))
    g, beta = g.reshape(n, h, -1).float(), beta.reshape(n, h, 1).float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale

    def chunks(x):  # [N, H, D] -> [H, num_chunks, C, D], zeros in the empty slots
        slots = x.new_zeros(h, num_chunks * c, x.shape[-1])
        return slots.index_copy(1, table.slot, x.transpose(0, 1)).view(h, num_chunks, c, -1)

    query, key, value = chunks(q), chunks(k), chunks(v)
    beta = chunks(beta).squeeze(-1)
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    if per_channel:
        return _chunked_per_channel(query, key, v_beta, k_beta, chunks(g), table, backend)
    decay = chunks(g).squeeze(-1)

    strictly_upper_mask = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    cum_decay = decay.cumsum(dim=-1)
    pairwise_decay = (cum_decay.unsqueeze(-1) - cum_decay.unsqueeze(-2)).masked_fill(strictly_upper_mask, float("-inf"))
    pairwise_decay = pairwise_decay.exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    query = query * cum_decay.exp().unsqueeze(-1)
    key_decayed = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    scan = chunk_scan_op if backend == "triton" else scan_chunks
    states, v_news = scan(k_cumdecay, new_values, key_decayed, cum_decay[..., -1].exp(), table.first)
    out = query @ states + intra_chunk_attn @ v_news  # [H, num_chunks, C, Dv]
    return out.view(h, num_chunks * c, -1).transpose(0, 1).index_select(0, table.slot)


def _chunked_per_channel(query, key, v_beta, k_beta, decay, table: ChunkTable, backend: str) -> torch.Tensor:
    """``_chunked``'s algorithm with one log decay per key channel (``decay`` ``[H, num_chunks, C, Dk]``), as
    transformers' ``chunk_kimi_delta_attention``: the decays between two tokens differ per channel, so the
    products that the per-head form scales by one decay are taken channel by channel (``pairwise``)."""
    h, num_chunks, c, _ = query.shape
    # fp64 sums: strong decays (tens a token) make the sums large, and fp32 would lose the small differences
    # between them (a decay near 0 next to strong ones) that the factors below exponentiate
    cum_decay = decay.double().cumsum(dim=-2)
    ut_system = pairwise(k_beta, key, cum_decay)
    intra_chunk_attn = pairwise(query, key, cum_decay)
    decayed_k_beta = k_beta * cum_decay.float().exp()
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    query = query * cum_decay.float().exp()
    key_decayed = key * (cum_decay[..., -1:, :] - cum_decay).float().exp()
    scan = chunk_scan_op if backend == "triton" else scan_chunks
    states, v_news = scan(k_cumdecay, new_values, key_decayed, cum_decay[..., -1, :].float().exp(), table.first)
    out = query @ states + intra_chunk_attn @ v_news  # [H, num_chunks, C, Dv]
    return out.view(h, num_chunks * c, -1).transpose(0, 1).index_select(0, table.slot)


def pairwise(a: torch.Tensor, b: torch.Tensor, cum_decay: torch.Tensor) -> torch.Tensor:
    """``[..., C, C]``: ``sum_d a[i, d] b[j, d] exp(cum_decay[i, d] - cum_decay[j, d])`` for ``j <= i``, 0
    above the diagonal, for a, b, cum_decay ``[..., C, Dk]`` (cum_decay non-increasing along C, as cumulative
    sums of log decays <= 0 are; it may be wider than a and b: the differences are taken in its dtype, then
    cast to theirs).

    No factor is ever above 1, however strong the decay: the chunk is halved recursively, and the block of
    rows in the lower half against columns in the upper half is one matmul of rows scaled by
    ``exp(cum[i] - cum[r])`` and columns by ``exp(cum[r] - cum[j])``, ``r`` the first row of the lower half
    (``j < r <= i``); each pair ``j < i`` falls in exactly one such block, the diagonal is a plain sum."""
    *lead, c, dk = a.shape
    size = next_power_of_2(c)
    if size != c:  # zero rows past the chunk, their decay that of its last token (no factor above 1)
        a, b = (torch.nn.functional.pad(x, (0, 0, 0, size - c)) for x in (a, b))
        cum_decay = torch.cat([cum_decay, cum_decay[..., -1:, :].expand(*lead, size - c, dk)], -2)
    values = [(a * b).sum(-1)]
    span = size
    while span > 1:
        half, blocks = span // 2, size // span
        av, bv, cv = (x.reshape(*lead, blocks, 2, half, dk) for x in (a, b, cum_decay))
        ref = cv[..., 1, :1, :]
        rows = av[..., 1, :, :] * (cv[..., 1, :, :] - ref).to(a.dtype).exp()
        cols = bv[..., 0, :, :] * (ref - cv[..., 0, :, :]).to(a.dtype).exp()
        values.append((rows @ cols.transpose(-1, -2)).reshape(*lead, -1))
        span = half
    out = a.new_zeros(*lead, size * size).index_copy(-1, _pairwise_index(size, a.device), torch.cat(values, -1))
    return out.view(*lead, size, size)[..., :c, :c]


@functools.cache
def _pairwise_index(size: int, device: torch.device) -> torch.Tensor:
    """Where ``pairwise``'s values go in the flat ``[size, size]`` result, in the order it computes them."""
    index = [torch.arange(size, device=device) * (size + 1)]
    span = size
    while span > 1:
        half, blocks = span // 2, size // span
        ranges = (torch.arange(m, device=device) for m in (blocks, half, half))
        block, i, j = (x.reshape(-1) for x in torch.meshgrid(*ranges, indexing="ij"))
        index.append((block * span + half + i) * size + block * span + j)
        span = half
    return torch.cat(index)


def scan_chunks(w, u, k_decayed, chunk_decay, first):
    """The sequential part of the chunked algorithm, chunk after chunk, for each head: the state entering
    chunk i (zeroed where ``first[i]``), the chunk's corrected values ``v_new = u - w @ state``, and the state
    leaving it, ``state * chunk_decay + k_decayed^T @ v_new``.

    w ``[H, NC, C, Dk]`` (transformers' ``k_cumdecay``), u ``[H, NC, C, Dv]`` (its ``new_values``),
    k_decayed ``[H, NC, C, Dk]`` (keys decayed to the chunk's end), chunk_decay ``[H, NC]`` (or ``[H, NC, Dk]``:
    one per row of the state), first bool ``[NC]``. Returns (states ``[H, NC, Dk, Dv]``: each chunk's entering
    state, v_new ``[H, NC, C, Dv]``).
    """
    h, num_chunks, _, dk = w.shape
    k_t = k_decayed.transpose(-1, -2)
    state = w.new_zeros(h, dk, u.shape[-1])
    states, v_news = [], []
    for i in range(num_chunks):
        state = torch.where(first[i], 0.0, state)
        v_new = torch.baddbmm(u[:, i], w[:, i], state, alpha=-1)
        states.append(state)
        v_news.append(v_new)
        decay = chunk_decay[:, i, None, None] if chunk_decay.dim() == 2 else chunk_decay[:, i, :, None]
        state = torch.baddbmm(state * decay, k_t[:, i], v_new)
    return torch.stack(states, 1), torch.stack(v_news, 1)


# ---- the scan on Triton: custom ops, a kernel pair each way, no validation ---------------------------------


@custom_op("fastft::delta_rule_chunk_scan")
def chunk_scan_op(
    w: torch.Tensor, u: torch.Tensor, k_decayed: torch.Tensor, chunk_decay: torch.Tensor, first: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scan_chunks`` on the Triton kernels (fp32 inputs and outputs, same shapes); differentiable."""
    from .kernels import delta_rule as kernels

    cfg = autotune.params(OP_SCAN, w.device, w.numel())
    return kernels.chunk_scan(w, u, k_decayed, chunk_decay, first, **cfg)


@chunk_scan_op.register_fake
def _(w, u, k_decayed, chunk_decay, first):
    h, nc, c, dk = w.shape
    dv = u.shape[-1]
    return w.new_empty(h, nc, dk, dv, dtype=torch.float32), w.new_empty(h, nc, c, dv, dtype=torch.float32)


@custom_op("fastft::delta_rule_chunk_scan_backward")
def chunk_scan_backward_op(
    w: torch.Tensor,
    k_decayed: torch.Tensor,
    chunk_decay: torch.Tensor,
    first: torch.Tensor,
    states: torch.Tensor,
    v_new: torch.Tensor,
    dstates: torch.Tensor,
    dv_new: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dw, du, dk_decayed, dchunk_decay) fp32 of ``chunk_scan_op`` from its inputs, outputs and their
    gradients: the reverse scan on Triton, then the two products over all chunks at once."""
    from .kernels import delta_rule as kernels

    cfg = autotune.params(OP_SCAN_BACKWARD, w.device, w.numel())
    ds, du = kernels.chunk_scan_backward(w, k_decayed, chunk_decay, first, dstates, dv_new, **cfg)
    dw = torch.matmul(du, states.transpose(-1, -2)).neg_()  # v_new = u - w @ state
    dk_decayed = torch.matmul(v_new, ds.transpose(-1, -2))  # leaving state += k_decayed^T @ v_new
    # leaving state = entering state * chunk_decay + ...: per head and chunk a sum over the whole state, or
    # over each row of it
    ddecay = (states * ds).sum(-1)
    if chunk_decay.dim() == 2:
        ddecay = ddecay.sum(-1)
    return dw, du, dk_decayed, ddecay


@chunk_scan_backward_op.register_fake
def _(w, k_decayed, chunk_decay, first, states, v_new, dstates, dv_new):
    f32 = torch.float32
    return (
        w.new_empty(w.shape, dtype=f32),
        v_new.new_empty(v_new.shape, dtype=f32),
        w.new_empty(w.shape, dtype=f32),
        w.new_empty(chunk_decay.shape, dtype=f32),
    )


def _setup(ctx, inputs, output):
    w, u, k_decayed, chunk_decay, first = inputs
    ctx.save_for_backward(w, k_decayed, chunk_decay, first, *output)


def _backward(ctx, dstates, dv_new):
    w, k_decayed, chunk_decay, first, states, v_new = ctx.saved_tensors
    dstates = torch.zeros_like(states) if dstates is None else dstates
    dv_new = torch.zeros_like(v_new) if dv_new is None else dv_new
    dw, du, dk_decayed, ddecay = chunk_scan_backward_op(
        w, k_decayed, chunk_decay, first, states, v_new, dstates, dv_new
    )
    return dw, du, dk_decayed, ddecay, None


chunk_scan_op.register_autograd(_backward, setup_context=_setup)


# ---- the whole chunked algorithm on Triton (one decay per head) --------------------------------------------


@custom_op("fastft::delta_rule_intra_forward")
def intra_forward_op(
    k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.delta_rule.intra_forward``: (T, w, u, k_decayed, chunk_decay, cum) fp32, not differentiable."""
    from .kernels import delta_rule as kernels

    return kernels.intra_forward(k, v, beta, g)


@intra_forward_op.register_fake
def _(k, v, beta, g):
    h, nc, c, dk = k.shape
    f32 = torch.float32
    return (
        k.new_empty(h, nc, c, c, dtype=f32),
        k.new_empty(h, nc, c, dk, dtype=f32),
        k.new_empty(h, nc, c, v.shape[-1], dtype=f32),
        k.new_empty(h, nc, c, dk, dtype=f32),
        k.new_empty(h, nc, dtype=f32),
        k.new_empty(h, nc, c, dtype=f32),
    )


@custom_op("fastft::delta_rule_intra_backward")
def intra_backward_op(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    cum: torch.Tensor,
    t: torch.Tensor,
    u: torch.Tensor,
    w: torch.Tensor,
    du: torch.Tensor,
    dw: torch.Tensor,
    dk_decayed: torch.Tensor,
    dchunk_decay: torch.Tensor,
    dk: torch.Tensor,
    dcum: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.delta_rule.intra_backward``: (dk, dv, dbeta, dg) fp32."""
    from .kernels import delta_rule as kernels

    return kernels.intra_backward(k, v, beta, cum, t, u, w, du, dw, dk_decayed, dchunk_decay, dk, dcum)


@intra_backward_op.register_fake
def _(k, v, beta, cum, t, u, w, du, dw, dk_decayed, dchunk_decay, dk, dcum):
    f32 = torch.float32
    return (
        k.new_empty(k.shape, dtype=f32),
        v.new_empty(v.shape, dtype=f32),
        k.new_empty(beta.shape, dtype=f32),
        k.new_empty(cum.shape, dtype=f32),
    )


@custom_op("fastft::delta_rule_output_forward")
def output_forward_op(
    q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor, states: torch.Tensor, v_new: torch.Tensor
) -> torch.Tensor:
    """``kernels.delta_rule.output_forward``: the output fp32, not differentiable."""
    from .kernels import delta_rule as kernels

    return kernels.output_forward(q, k, cum, states, v_new)


@output_forward_op.register_fake
def _(q, k, cum, states, v_new):
    return v_new.new_empty(v_new.shape, dtype=torch.float32)


@custom_op("fastft::delta_rule_output_backward")
def output_backward_op(
    q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor, states: torch.Tensor, v_new: torch.Tensor, d_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.delta_rule.output_backward``: (dq, dk, dcum, dstates, dv_new) fp32."""
    from .kernels import delta_rule as kernels

    return kernels.output_backward(q, k, cum, states, v_new, d_out)


@output_backward_op.register_fake
def _(q, k, cum, states, v_new, d_out):
    f32 = torch.float32
    return tuple(x.new_empty(x.shape, dtype=f32) for x in (q, k, cum, states, v_new))


@custom_op("fastft::delta_rule_pack_forward")
def pack_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    token_index: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.delta_rule.pack_forward``: (query, key, value, g, beta) in the slots, fp32, not differentiable."""
    from .kernels import delta_rule as kernels

    return kernels.pack_forward(q, k, v, g, beta, token_index, scale, use_qk_l2norm)


@pack_forward_op.register_fake
def _(q, k, v, g, beta, token_index, scale, use_qk_l2norm):
    h, dk = q.shape[1:]
    nc, cs = token_index.shape
    f32 = torch.float32
    query, key = (q.new_empty(h, nc, cs, dk, dtype=f32) for _ in range(2))
    g_slots, beta_slots = (q.new_empty(h, nc, cs, dtype=f32) for _ in range(2))
    return query, key, q.new_empty(h, nc, cs, v.shape[-1], dtype=f32), g_slots, beta_slots


@custom_op("fastft::delta_rule_pack_backward")
def pack_backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    slot: torch.Tensor,
    dquery: torch.Tensor,
    dkey: torch.Tensor,
    dvalue: torch.Tensor,
    dg: torch.Tensor,
    dbeta: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    v_dtype: torch.dtype,
    g_dtype: torch.dtype,
    beta_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.delta_rule.pack_backward``: the gradients of q, k, v, g and beta in their dtypes."""
    from .kernels import delta_rule as kernels

    dtypes = (q.dtype, k.dtype, v_dtype, g_dtype, beta_dtype)
    return kernels.pack_backward(q, k, slot, dquery, dkey, dvalue, dg, dbeta, scale, use_qk_l2norm, dtypes)


@pack_backward_op.register_fake
def _(q, k, slot, dquery, dkey, dvalue, dg, dbeta, scale, use_qk_l2norm, v_dtype, g_dtype, beta_dtype):
    n, h, dk = q.shape
    return (
        q.new_empty(n, h, dk),
        k.new_empty(n, h, dk),
        q.new_empty(n, h, dvalue.shape[-1], dtype=v_dtype),
        q.new_empty(n, h, dtype=g_dtype),
        q.new_empty(n, h, dtype=beta_dtype),
    )


@custom_op("fastft::delta_rule_unpack_forward")
def unpack_forward_op(o: torch.Tensor, slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.delta_rule.unpack_forward``: the output ``[N, H, Dv]`` in ``dtype``, not differentiable."""
    from .kernels import delta_rule as kernels

    return kernels.unpack_forward(o, slot, dtype)


@unpack_forward_op.register_fake
def _(o, slot, dtype):
    return o.new_empty(slot.shape[0], o.shape[0], o.shape[-1], dtype=dtype)


@custom_op("fastft::delta_rule_unpack_backward")
def unpack_backward_op(dout: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """``kernels.delta_rule.unpack_backward``: the slots' output gradient, fp32."""
    from .kernels import delta_rule as kernels

    return kernels.unpack_backward(dout, token_index)


@unpack_backward_op.register_fake
def _(dout, token_index):
    return dout.new_empty(dout.shape[1], *token_index.shape, dout.shape[-1], dtype=torch.float32)


class _TritonChunks(torch.autograd.Function):
    """``_chunked``'s algorithm for one log decay per head on Triton, from the tokens to the tokens, and its
    backward written out (``_chunked``'s autograd graph is its specification): the tokens into the slots
    (``pack_forward_op``: q and k l2-normalised, q scaled), ``intra_forward_op``, ``chunk_scan_op``,
    ``output_forward_op``, the slots back to the tokens (``unpack_forward_op``). With per chunk ``cum`` the
    cumulative log decay, ``G_ij = exp(cum_i - cum_j)`` (j <= i), ``L`` the strictly lower part of ``(k beta) k^T
    * G`` and ``T = (I + L)^-1``: ``u = T (v beta)``, ``w = T (k beta exp(cum))``, the scan over chunks (states,
    v_new), and ``o = (q exp(cum)) states + ((q k^T) * G) v_new``. Backward through ``T``: ``d(v beta) = T^T
    du``, ``dx = T^T dw``, ``dL = -(d(v beta) u^T + dx w^T)`` on the strictly lower part. Inputs: q, k ``[N, H,
    Dk]``, v ``[N, H, Dv]``, g, beta ``[N, H]`` in their dtypes, the chunk table's token_index, slot and first,
    the scale and whether q and k are l2-normalised; the output ``[N, H, Dv]`` in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, token_index, slot, first, scale, use_qk_l2norm):
        query, key, value, decay, beta_s = pack_forward_op(q, k, v, g, beta, token_index, scale, use_qk_l2norm)
        t, w, u, k_decayed, chunk_decay, cum = intra_forward_op(key, value, beta_s, decay)
        states, v_new = chunk_scan_op(w, u, k_decayed, chunk_decay, first)
        out = output_forward_op(query, key, cum, states, v_new)
        ctx.args = (scale, use_qk_l2norm, v.dtype, g.dtype, beta.dtype)
        ctx.save_for_backward(
            q, k, token_index, slot, query, key, value, beta_s, first, t, w, u, k_decayed, chunk_decay, cum, states,
            v_new,
        )  # fmt: skip
        return unpack_forward_op(out, slot, q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        with torch.autocast(d_out.device.type, enabled=False):  # fp32, as the forward (autocast is off there)
            return _TritonChunks._backward(ctx, d_out)

    @staticmethod
    def _backward(ctx, d_out):
        q, k, token_index, slot, query, key, value, beta, first, t, w, u, k_decayed, chunk_decay, cum, states, v_new = (
            ctx.saved_tensors
        )
        scale, use_qk_l2norm, v_dtype, g_dtype, beta_dtype = ctx.args
        d_out = unpack_backward_op(d_out, token_index)
        dq, dk_out, dcum, dstates, dv_new = output_backward_op(query, key, cum, states, v_new, d_out)
        dw, du, dkd, dcd = chunk_scan_backward_op(w, k_decayed, chunk_decay, first, states, v_new, dstates, dv_new)
        dk, dv, dbeta, ddecay = intra_backward_op(key, value, beta, cum, t, u, w, du, dw, dkd, dcd, dk_out, dcum)
        grads = pack_backward_op(
            q, k, slot, dq, dk, dv, ddecay, dbeta, scale, use_qk_l2norm, v_dtype, g_dtype, beta_dtype
        )
        return *grads, None, None, None, None, None
