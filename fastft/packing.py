"""Packed-sequence metadata, built once per batch and reused by every attention layer.

``packed_seq_info(...)`` turns one source of document boundaries (position ids, sequence lengths or
``cu_seqlens``) into a ``PackedSeqInfo``: ``cu_seqlens``, lengths, ``max_seqlen``, per-token document ids
and positions, and on request the SDPA mask, the FlexAttention ``BlockMask`` and the flash-attn varlen
arguments. Calls with the same input tensor (same object, unchanged since) return the same info, so
calling it in every layer costs a dictionary lookup and no GPU sync.

Rules (the torch reference in ``fastft/reference/packing.py`` is the specification):
- from position ids (``[T]`` or ``[B, T]``): a document starts at the first token of each row and at
  every token whose position id is not the previous one plus 1; documents never cross rows;
- from lengths / ``cu_seqlens``: zero-length sequences are dropped; if the lengths cover fewer tokens than
  ``num_tokens``, the rest is one more sequence, so ``cu_seqlens[-1]`` is always the token count;
- query ``q`` may attend key ``k`` iff same document, ``k <= q`` and (no window or ``q - k < window``).

GPU syncs: host lengths / host ``cu_seqlens`` -> none; device position ids -> none for the document ids,
positions and masks, one the first time ``cu_seqlens``/``seq_lengths``/``max_seqlen``/``num_seqs`` is
read; device lengths / ``cu_seqlens`` -> one (they are validated on the host); later calls -> none.
"""

from __future__ import annotations

import collections
import os
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from . import autotune, capabilities, dispatch
from ._checks import int_arg, is_int
from ._custom_op import custom_op
from .reference import packing as reference

__all__ = ["packed_seq_info", "PackedSeqInfo", "document_mask_mod"]

OP_BOUNDARIES = dispatch.register("packing.boundaries")
OP_FROM_CU_SEQLENS = dispatch.register("packing.from_cu_seqlens")
OP_SDPA_MASK = dispatch.register("packing.sdpa_mask")
OP_BLOCK_TABLES = dispatch.register("packing.block_tables")

autotune.register(
    OP_BOUNDARIES,
    autotune.Tunable(
        {"BLOCK": 1024, "num_warps": 4},
        (16384, 131072, 1048576),
        {"BLOCK": [512, 1024, 2048, 4096], "num_warps": [4, 8]},
    ),
)
autotune.register(
    OP_FROM_CU_SEQLENS,
    autotune.Tunable(
        {"BLOCK": 1024, "num_warps": 4},
        (16384, 131072, 1048576),
        {"BLOCK": [256, 512, 1024, 2048], "num_warps": [2, 4, 8]},
    ),
)
autotune.register(
    OP_SDPA_MASK,
    autotune.Tunable(
        {"BLOCK_Q": 32, "BLOCK_K": 256, "num_warps": 4},
        (4096, 16384),
        {"BLOCK_Q": [8, 16, 32, 64], "BLOCK_K": [128, 256, 512], "num_warps": [4, 8]},
    ),
)
autotune.register(OP_BLOCK_TABLES, autotune.Tunable({"num_warps": 4}, (32768, 131072), {"num_warps": [1, 2, 4, 8]}))

_INT32_MAX = 2**31 - 1
_MASK_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64)  # floats that hold -inf
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8) + tuple(
    getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)
)


# ---- custom ops (opaque to torch.compile), with fake impls that give the output shapes -----------------
# The ``*_op`` functions are fastft's internal op layer: one kernel (or its reference) per call, on the
# backend named by the caller, with no validation. Benchmarks and tests call them to time or check a kernel.


@custom_op("fastft::packing_boundaries")
def boundaries_op(
    position_ids: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "torch":
        return reference.boundaries_from_position_ids(position_ids)
    from .kernels import packing as kernels

    cfg = autotune.params(OP_BOUNDARIES, position_ids.device, position_ids.numel())
    return kernels.boundaries_from_position_ids(position_ids, **cfg)


@boundaries_op.register_fake
def _(position_ids, backend):
    n = position_ids.numel()
    return (
        position_ids.new_empty(position_ids.shape, dtype=torch.int32),
        position_ids.new_empty(position_ids.shape, dtype=torch.int64),
        position_ids.new_empty((n + 1,), dtype=torch.int32),
        position_ids.new_empty((2,), dtype=torch.int32),
    )


@custom_op("fastft::packing_from_cu_seqlens")
def from_cu_seqlens_op(cu_seqlens: torch.Tensor, num_tokens: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "torch" or num_tokens == 0:
        return reference.boundaries_from_cu_seqlens(cu_seqlens, num_tokens)
    from .kernels import packing as kernels

    cfg = autotune.params(OP_FROM_CU_SEQLENS, cu_seqlens.device, num_tokens)
    return kernels.boundaries_from_cu_seqlens(cu_seqlens, num_tokens, **cfg)


@from_cu_seqlens_op.register_fake
def _(cu_seqlens, num_tokens, backend):
    return cu_seqlens.new_empty((num_tokens,), dtype=torch.int32), cu_seqlens.new_empty(
        (num_tokens,), dtype=torch.int64
    )


@custom_op("fastft::packing_sdpa_mask")
def sdpa_mask_op(doc_ids: torch.Tensor, window: int, dtype: torch.dtype, backend: str) -> torch.Tensor:
    if backend == "torch" or doc_ids.numel() == 0:
        return reference.sdpa_mask(doc_ids, window, dtype)
    from .kernels import packing as kernels

    cfg = autotune.params(OP_SDPA_MASK, doc_ids.device, doc_ids.shape[-1])
    return kernels.sdpa_mask(doc_ids, window, dtype, **cfg)


@sdpa_mask_op.register_fake
def _(doc_ids, window, dtype, backend):
    b, t = doc_ids.shape
    return doc_ids.new_empty((b, 1, t, t), dtype=dtype)


@custom_op("fastft::packing_block_tables")
def block_tables_op(
    doc_ids: torch.Tensor, window: int, block_size: int, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num [4, B, 1, nb], idx [4, B, 1, nb, nb]): the 8 tables; index 0-3 = kv partial, kv full, q partial,
    q full."""
    if backend == "torch":
        tables = reference.block_mask_tables(doc_ids, window, block_size)
        return torch.stack(tables[0::2]), torch.stack(tables[1::2])
    from .kernels import packing as kernels

    cfg = autotune.params(OP_BLOCK_TABLES, doc_ids.device, doc_ids.shape[-1])
    return kernels.block_mask_tables(doc_ids, window, block_size, **cfg)


@block_tables_op.register_fake
def _(doc_ids, window, block_size, backend):
    b, t = doc_ids.shape
    nb = -(-t // block_size)
    return doc_ids.new_empty((4, b, 1, nb), dtype=torch.int32), doc_ids.new_empty((4, b, 1, nb, nb), dtype=torch.int32)


# ---- the info -----------------------------------------------------------------------------------------


def _window(window) -> int:
    """0 for none; a window past any int32 token count is the same as one of ``_INT32_MAX`` keys."""
    return 0 if window is None else min(max(int_arg("window", window), 0), _INT32_MAX)


class PackedSeqInfo:
    """Document boundaries of one packed batch. Immutable; masks are built on first request and kept.

    Attributes (tensors on ``device``):
      cu_seqlens   int32 [num_seqs + 1]: start offset of each sequence in the flattened token stream;
                   ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == num_tokens``.
      seq_lengths  int32 [num_seqs]: ``cu_seqlens[1:] - cu_seqlens[:-1]``, all > 0 (but ``padded``'s).
      max_seqlen   int: the longest sequence (0 when there are no tokens; ``padded``'s: a bound).
      num_seqs     int: number of sequences (documents).
      doc_ids      int32, ``[B, T]`` for ``[B, T]`` position ids, else ``[T]``: global index of each
                   token's document.
      position_ids int64, same shape as ``doc_ids``: each token's position inside its document.
      num_tokens   int: tokens in the batch (``B * T``).
      device       torch.device of every tensor above.
    """

    __slots__ = ("num_tokens", "device", "_shape", "_backend", "_memo", "_pending", "__weakref__")

    def __init__(self, *, num_tokens, device, shape, backend, memo, pending=None):
        set_ = object.__setattr__
        set_(self, "num_tokens", num_tokens)
        set_(self, "device", device)
        set_(self, "_shape", shape)  # (B, T) of the token layout
        set_(self, "_backend", backend)  # the caller's backend= (None: FASTFT_BACKEND / auto)
        set_(self, "_memo", memo)  # name or (kind, window, ...) -> built value
        set_(self, "_pending", pending)  # (starts, summary) of device position ids, awaiting the one sync

    def __setattr__(self, name, value):
        raise AttributeError("PackedSeqInfo is immutable")

    @property
    def shape(self) -> tuple[int, int]:
        """(B, T): the token layout, ``[B, T]`` position ids' shape, else ``(1, num_tokens)``."""
        return tuple(self._shape)

    def __repr__(self):
        return (
            f"PackedSeqInfo(num_tokens={self.num_tokens}, shape={tuple(self._shape)}, device={self.device}, "
            f"host_boundaries={'cu_seqlens' in self._memo})"
        )

    # -- boundaries
    def _host_boundaries(self) -> None:
        """Completes cu_seqlens & co. from device position ids with one device-to-host sync."""
        starts, summary = self._pending
        num_seqs, longest = summary.tolist()
        cu = starts[: num_seqs + 1]
        self._memo.update(cu_seqlens=cu, seq_lengths=cu[1:] - cu[:-1], max_seqlen=int(longest), num_seqs=int(num_seqs))

    def _get(self, name):
        if name not in self._memo:
            if name == "seq_lengths" and "cu_seqlens" in self._memo:  # a padded info: derived where it is read
                cu = self._memo["cu_seqlens"]
                self._memo["seq_lengths"] = cu[1:] - cu[:-1]
            elif name in ("doc_ids", "position_ids"):
                backend = dispatch.backend_for(OP_FROM_CU_SEQLENS, self.device, self._backend)
                doc, pos = from_cu_seqlens_op(self._memo["cu_seqlens"], self.num_tokens, backend)
                shape = self._memo.get("ids_shape", (self.num_tokens,))
                self._memo.update(doc_ids=doc.view(shape), position_ids=pos.view(shape))
            else:
                self._host_boundaries()
        return self._memo[name]

    cu_seqlens = property(lambda self: self._get("cu_seqlens"))
    seq_lengths = property(lambda self: self._get("seq_lengths"))
    max_seqlen = property(lambda self: self._get("max_seqlen"))
    num_seqs = property(lambda self: self._get("num_seqs"))
    doc_ids = property(lambda self: self._get("doc_ids"))
    position_ids = property(lambda self: self._get("position_ids"))

    def padded(
        self, num_seqs: int, max_seqlen: int, out: torch.Tensor | None = None, *, fill: bool = True
    ) -> PackedSeqInfo:
        """The same documents as an info of exactly ``num_seqs`` sequences, the extra ones empty at the end
        (their ``cu_seqlens`` entries repeat ``num_tokens``), with ``max_seqlen`` as the bound on their
        length: static shapes for CUDA graphs (flash's variable-length kernels do no work for an empty
        sequence). ``out``: a contiguous int32 ``[num_seqs + 1]`` tensor on ``device`` to write ``cu_seqlens`` into,
        which the result reads; ``fill=False``: ``out`` holds them already (a CUDA graph's static input), no
        kernel runs. Its ``seq_lengths``, ``doc_ids`` and ``position_ids`` are derived from ``cu_seqlens``
        when first read, in this info's layout (``[B, T]`` for ``[B, T]`` position ids). Reads
        ``num_seqs``/``max_seqlen`` (one sync for device position ids, as they cost anyway).
        ``num_seqs`` is at most ``num_tokens`` (more sequences would only lengthen ``cu_seqlens``)."""
        int_arg("num_seqs", num_seqs, minimum=0)
        int_arg("max_seqlen", max_seqlen, minimum=0)
        if not isinstance(fill, bool):
            raise TypeError(f"fill must be True or False, got {type(fill).__name__} {fill!r}")
        if num_seqs > self.num_tokens:
            raise ValueError(f"num_seqs={num_seqs} is more than this batch's {self.num_tokens} tokens")
        if num_seqs < self.num_seqs:
            raise ValueError(f"num_seqs={num_seqs} is less than this batch's {self.num_seqs} sequences")
        if not self.max_seqlen <= max_seqlen <= self.num_tokens:
            raise ValueError(
                f"max_seqlen={max_seqlen} must be from the longest sequence ({self.max_seqlen}) to num_tokens "
                f"({self.num_tokens})"
            )
        if out is None:
            if not fill:
                raise ValueError("fill=False needs out, the buffer that holds the padded cu_seqlens")
            out = torch.empty(num_seqs + 1, dtype=torch.int32, device=self.device)
        elif not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a tensor or None, got {type(out).__name__}")
        elif (
            out.dtype != torch.int32
            or tuple(out.shape) != (num_seqs + 1,)
            or out.device != self.device
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out must be a contiguous int32 [{num_seqs + 1}] tensor on {self.device}, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}" + ("" if out.is_contiguous() else f", strides {out.stride()}")
            )
        if fill:
            n = self.num_seqs
            out[: n + 1].copy_(self.cu_seqlens)
            out[n + 1 :].fill_(self.num_tokens)
        memo = {"cu_seqlens": out, "max_seqlen": max_seqlen, "num_seqs": num_seqs, "ids_shape": self._ids_shape()}
        return PackedSeqInfo(
            num_tokens=self.num_tokens, device=self.device, shape=self._shape, backend=self._backend, memo=memo
        )

    def to(self, device: torch.device | str | int, non_blocking: bool = False) -> PackedSeqInfo:
        """This info on ``device`` (``torch.device``, ``"cuda:1"``, or a CUDA index): itself when it is there
        already, else a copy made on the first call and kept with this info, so that every layer on that
        device gets the same one. The boundaries and ids are copied (device to device: no host sync); masks
        are built again on first request there. accelerate's ``device_map`` hooks call this on a layer's
        keyword arguments, so a model split over GPUs hands each layer the info on its own device.
        ``TypeError``/``ValueError`` for what is not a device, or the meta device."""
        if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
            raise TypeError(f"device must be a torch.device, str or int, got {type(device).__name__}")
        device = _placed(torch.device(device))
        if device.type == "meta":
            raise ValueError("device must not be meta: a PackedSeqInfo holds values")
        if device == self.device:
            return self
        key = ("to", device)
        moved = self._memo.get(key)
        if moved is None:

            def copy(v):
                return v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v

            memo = {k: copy(v) for k, v in self._memo.items() if isinstance(k, str)}  # masks: built there
            pending = None if self._pending is None else tuple(copy(t) for t in self._pending)
            moved = self._memo[key] = PackedSeqInfo(
                num_tokens=self.num_tokens,
                device=device,
                shape=self._shape,
                backend=self._backend,
                memo=memo,
                pending=pending,
            )
        return moved

    def _ids_shape(self) -> tuple:
        """The shape of ``doc_ids``/``position_ids``: ``[B, T]`` position ids' own, else ``[T]``."""
        return tuple(self._memo.get("ids_shape", (self.num_tokens,)))

    def _doc_rows(self) -> torch.Tensor:
        return self.doc_ids.reshape(self._shape)

    # -- attention arguments
    def sdpa_mask(self, window: int | None = None, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """``[B, 1, T, T]`` mask for ``scaled_dot_product_attention``.

        bool: True where attention is allowed; float16, bfloat16, float32 or float64: 0 there and -inf
        elsewhere (``TypeError`` for other dtypes).
        ``window`` counts keys including the query itself; ``None`` or <= 0 means no window.
        """
        w = _window(window)
        if dtype not in _MASK_DTYPES:
            raise TypeError(
                f"dtype must be torch.bool or a floating dtype that holds -inf (float16, bfloat16, "
                f"float32, float64), got {dtype}"
            )
        key = ("sdpa", w, dtype)
        if key not in self._memo:
            backend = dispatch.backend_for(OP_SDPA_MASK, self.device, self._backend)
            self._memo[key] = sdpa_mask_op(self._doc_rows(), w, dtype, backend)
        return self._memo[key]

    def flex_block_mask(self, window: int | None = None, block_size: int = 128):
        """FlexAttention ``BlockMask`` of the document-causal mask (B rows, 1 head), built from the
        boundaries by a kernel, identical to ``create_block_mask`` with the same ``mask_mod``."""
        w = _window(window)
        block_size = int_arg("block_size", block_size, minimum=1)
        if self.num_tokens == 0:
            raise ValueError("flex_block_mask needs at least one token")
        key = ("flex", w, block_size)
        if key not in self._memo:
            backend = dispatch.backend_for(OP_BLOCK_TABLES, self.device, self._backend)
            doc = self._doc_rows()
            tables = block_tables_op(doc, w, block_size, backend)
            self._memo[key] = make_block_mask(tables, doc, w, block_size)
        return self._memo[key]

    def varlen_kwargs(self, window: int | None = None) -> dict:
        """Arguments for flash-attn's ``flash_attn_varlen_func`` (causal, flash-attn's ``(left, right)``
        window: ``left = window - 1``, -1 for none). For ``torch.nn.attention.varlen.varlen_attn`` pass
        ``cu_seq_q=cu_seqlens_q, cu_seq_k=cu_seqlens_k, max_q=max_seqlen_q, max_k=max_seqlen_k``."""
        w = _window(window)
        key = ("varlen", w)
        if key not in self._memo:
            self._memo[key] = {
                "cu_seqlens_q": self.cu_seqlens,
                "cu_seqlens_k": self.cu_seqlens,
                "max_seqlen_q": self.max_seqlen,
                "max_seqlen_k": self.max_seqlen,
                "causal": True,
                "window_size": (w - 1 if w > 0 else -1, 0),
            }
        return dict(self._memo[key])


def document_mask_mod(doc_ids: torch.Tensor, window: int | None = None):
    """FlexAttention ``mask_mod`` for ``[B, T]`` integer document ids: same doc, causal, optional window."""
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"doc_ids must be a [B, T] integer tensor, got {type(doc_ids).__name__}")
    if doc_ids.dim() != 2 or doc_ids.dtype not in _INT_DTYPES:
        raise ValueError(
            f"doc_ids must be a [B, T] integer tensor, got {doc_ids.dtype} of shape {tuple(doc_ids.shape)}"
        )
    w = _window(window)

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)
        if w > 0:
            allowed = allowed & (q_idx - kv_idx < w)
        return allowed

    return mask_mod


def make_block_mask(tables, doc_ids, window, block_size):
    """The ``BlockMask`` of ``block_tables_op``'s tables for ``[B, T]`` doc ids (torch >= 2.7 skips deriving
    the q tables, which the kernel already wrote)."""
    from torch.nn.attention.flex_attention import BlockMask

    # One unbind per table stack: indexing the eight views one by one costs more host time than the kernel.
    kv_num, kv_full_num, q_num, q_full_num = tables[0].unbind(0)
    kv_idx, kv_full_idx, q_idx, q_full_idx = tables[1].unbind(0)
    t = doc_ids.shape[-1]
    kwargs = dict(BLOCK_SIZE=block_size, mask_mod=document_mask_mod(doc_ids, window), seq_lengths=(t, t))
    kv = (kv_num, kv_idx, kv_full_num, kv_full_idx)
    if not capabilities.BLOCK_MASK_TAKES_Q_TABLES:
        return BlockMask.from_kv_blocks(*kv, **kwargs)
    mask = BlockMask.from_kv_blocks(*kv, compute_q_blocks=False, **kwargs)
    mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices = (
        q_num,
        q_idx,
        q_full_num,
        q_full_idx,
    )
    return mask


# ---- building it --------------------------------------------------------------------------------------


def _check_int_tensor(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must have an integer dtype (int8-int64, uint8-uint64), got {t.dtype}")
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: packed_seq_info needs its values")


def _lengths_key(name: str, value) -> tuple:
    """The validated lengths / cu_seqlens ``value`` (not a tensor) as a tuple of Python ints."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not (np.issubdtype(value.dtype, np.integer) and value.dtype != np.bool_):
            raise ValueError(
                f"{name} as a numpy array must be 1-D with an integer dtype, got {value.ndim}-D {value.dtype}"
            )
        return _in_int64(name, tuple(value.tolist()))
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"{name} must be a list/tuple of ints, a 1-D integer numpy array or tensor, got {type(value).__name__}"
        )
    for v in value:
        if not is_int(v):
            raise ValueError(
                f"{name} must be a list/tuple of ints (Python or numpy integers); it holds {type(v).__name__} {v!r}"
            )
    return _in_int64(name, tuple(int(v) for v in value))


def _in_int64(name: str, values: tuple) -> tuple:
    """``values``, or ``ValueError`` for one past int64 (the host tensors are int64; the int32 bounds are
    checked on them)."""
    for v in values:
        if not -(2**63) <= v < 2**63:
            raise ValueError(f"{name} holds {v}; cu_seqlens is int32, so at most {_INT32_MAX}")
    return values


def _host_ints(name: str, value) -> torch.Tensor:
    """A 1-D int64 CPU tensor from validated lengths: a tuple of ints or a 1-D integer tensor (one sync
    if on a GPU)."""
    if isinstance(value, torch.Tensor):
        ints = value.detach().to("cpu", torch.int64)
        if value.dtype == torch.uint64 and (ints < 0).any():
            raise ValueError(f"{name} has a value past 2**63 - 1")
        return ints
    return torch.tensor(value, dtype=torch.int64).reshape(-1)


def _placed(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` is the current CUDA device (one memo key, one info per device)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _from_host_cu(cu: torch.Tensor, num_tokens, max_seqlen, device, backend, arg: str) -> PackedSeqInfo:
    if cu.numel() == 0 or cu[0] != 0:
        raise ValueError(f"{arg} must start at 0")
    lengths = cu[1:] - cu[:-1]
    if (cu < 0).any() or (lengths < 0).any():  # from 0 and never negative: the differences do not wrap
        raise ValueError(f"{arg} must be non-decreasing")
    total = int(cu[-1])
    if num_tokens is None:
        num_tokens = total
    if total > num_tokens:
        raise ValueError(f"{arg} covers {total} tokens, more than num_tokens={num_tokens}")
    if num_tokens > _INT32_MAX:
        raise ValueError(f"num_tokens={num_tokens} does not fit int32 cu_seqlens")
    lengths = lengths[lengths > 0]
    if num_tokens > total:
        lengths = torch.cat([lengths, lengths.new_tensor([num_tokens - total])])
    longest = int(lengths.max()) if lengths.numel() else 0
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen!r} is less than the longest sequence ({longest})")
    cu32 = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    cu_dev = _to_device(cu32, device)
    memo = {
        "cu_seqlens": cu_dev,
        "seq_lengths": cu_dev[1:] - cu_dev[:-1],
        "max_seqlen": longest,
        "num_seqs": lengths.numel(),
    }
    return PackedSeqInfo(num_tokens=num_tokens, device=device, shape=(1, num_tokens), backend=backend, memo=memo)


def from_position_ids(position_ids: torch.Tensor, device, backend) -> PackedSeqInfo:
    n = position_ids.numel()
    pos = position_ids.detach().to(device)
    if pos.dtype not in (torch.int32, torch.int64):
        pos = pos.long()
    pos = pos.contiguous()
    shape = (1, n) if pos.dim() == 1 else tuple(pos.shape)
    if n == 0:
        empty = torch.zeros(1, dtype=torch.int32, device=device)
        memo = {
            "cu_seqlens": empty,
            "seq_lengths": empty[:0],
            "max_seqlen": 0,
            "num_seqs": 0,
            "doc_ids": pos.new_empty(pos.shape, dtype=torch.int32),
            "position_ids": pos.new_empty(pos.shape, dtype=torch.int64),
            "ids_shape": tuple(pos.shape),
        }
        return PackedSeqInfo(num_tokens=0, device=device, shape=shape, backend=backend, memo=memo)
    doc, out_pos, starts, summary = boundaries_op(pos, dispatch.backend_for(OP_BOUNDARIES, device, backend))
    memo = {"doc_ids": doc, "position_ids": out_pos, "ids_shape": tuple(pos.shape)}
    return PackedSeqInfo(
        num_tokens=n, device=device, shape=shape, backend=backend, memo=memo, pending=(starts, summary)
    )


def _validate(position_ids, seq_lengths, cu_seqlens, max_seqlen, num_tokens, device, backend):
    """(source name, source value, its values as ints for a non-tensor source) after every check that needs
    no GPU data. Runs on every call, memo hit or not, so that whether a call is accepted never depends on
    earlier calls."""
    sources = {"position_ids": position_ids, "seq_lengths": seq_lengths, "cu_seqlens": cu_seqlens}
    given = [k for k, v in sources.items() if v is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one of position_ids, seq_lengths, cu_seqlens (got {given or 'none'})")
    arg = given[0]
    value = sources[arg]
    for name, n in (("max_seqlen", max_seqlen), ("num_tokens", num_tokens)):
        if n is not None:
            int_arg(name, n, minimum=0)
    if max_seqlen is not None and arg != "cu_seqlens":
        raise ValueError("max_seqlen is only taken with cu_seqlens")
    if num_tokens is not None and num_tokens > _INT32_MAX:
        raise ValueError(f"num_tokens={num_tokens} does not fit int32 cu_seqlens (at most {_INT32_MAX})")
    if device is not None and not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be a torch.device, str or None, got {type(device).__name__}")
    if device is not None and torch.device(device).type == "meta":
        raise ValueError("device must not be meta: packed_seq_info computes values")
    dispatch.requested_backend(backend)
    if isinstance(value, torch.Tensor):
        _check_int_tensor(arg, value)
        if arg == "position_ids":
            if value.dim() not in (1, 2):
                raise ValueError(f"position_ids must be [T] or [B, T], got shape {tuple(value.shape)}")
            n = value.numel()
            if num_tokens is not None and num_tokens != n:
                raise ValueError(f"num_tokens={num_tokens} but position_ids has {n} tokens")
            if n > _INT32_MAX:
                raise ValueError(f"position_ids has {n} tokens; cu_seqlens is int32, so at most {_INT32_MAX}")
        elif value.dim() != 1:
            raise ValueError(f"{arg} must be 1-D, got shape {tuple(value.shape)}")
        return arg, value, None
    if arg == "position_ids":
        raise TypeError(f"position_ids must be a tensor, got {type(value).__name__}")
    return arg, value, _lengths_key(arg, value)


def _int_or_none(n):
    return None if n is None else int(n)


_CACHE_SIZE = 16
_cache: collections.OrderedDict = collections.OrderedDict()  # key -> (weakref to the input or None, info)


def packed_seq_info(
    *,
    position_ids: torch.Tensor | None = None,
    seq_lengths: Sequence[int] | torch.Tensor | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    max_seqlen: int | None = None,
    num_tokens: int | None = None,
    device: torch.device | str | None = None,
    backend: str | None = None,
) -> PackedSeqInfo:
    """Boundary metadata of a packed batch from exactly one of ``position_ids``, ``seq_lengths`` or
    ``cu_seqlens``. See the module docstring for the rules and the GPU syncs each source costs.

    ``max_seqlen`` (only with ``cu_seqlens``) is checked to be at least the longest sequence.
    ``num_tokens`` is the token count when it exceeds the lengths' sum (the rest becomes one sequence).
    ``device`` is where the tensors go (default: the input tensor's device, CPU for lists).
    ``backend`` overrides ``FASTFT_BACKEND`` for this info's kernels: ``auto``, ``triton`` or ``torch``.

    Lengths and ``cu_seqlens`` may be lists/tuples of Python or numpy integers, 1-D integer numpy arrays
    or 1-D integer tensors (signed or unsigned). Every argument is checked on every call, before the memo.

    Raises ``ValueError`` naming the argument for: not exactly one source, non-integer dtypes or values,
    negative lengths, lengths summing past ``num_tokens``, ``cu_seqlens`` not starting at 0 or decreasing,
    a negative ``max_seqlen``/``num_tokens``, meta tensors; ``TypeError`` for non-tensor ``position_ids``
    and a ``max_seqlen``/``num_tokens`` that is not an int.
    """
    arg, value, ints = _validate(position_ids, seq_lengths, cu_seqlens, max_seqlen, num_tokens, device, backend)
    max_seqlen, num_tokens = _int_or_none(max_seqlen), _int_or_none(num_tokens)  # numpy integers -> int
    # Every layer after the first hits this memo: one dictionary lookup, no GPU sync. A tensor is keyed on its
    # identity and version counter (inference tensors have none: not memoized).
    tensor = isinstance(value, torch.Tensor)
    memoize = not torch.compiler.is_compiling() and not (tensor and value.is_inference())
    if device is not None:
        device = _placed(torch.device(device))  # "cuda": the current device, which the memo key must name
    if memoize:
        ident = (id(value), value._version) if tensor else ints
        key = (arg, ident, max_seqlen, num_tokens, device, backend, os.environ.get("FASTFT_BACKEND"))
        hit = _cache.get(key)
        if hit is not None and (hit[0] is None or hit[0]() is value):
            return hit[1]

    if device is None:
        device = value.device if isinstance(value, torch.Tensor) else torch.device("cpu")

    if arg == "position_ids":
        info = from_position_ids(value, device, backend)
    elif arg == "seq_lengths":
        lengths = _host_ints("seq_lengths", value if tensor else ints)
        if (lengths < 0).any():
            raise ValueError("seq_lengths must be non-negative")
        if (lengths > _INT32_MAX).any():  # each fits int32, so their int64 sum cannot wrap
            raise ValueError(f"seq_lengths holds {int(lengths.max())}; cu_seqlens is int32, so at most {_INT32_MAX}")
        cu = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        info = _from_host_cu(cu, num_tokens, None, device, backend, "seq_lengths")
    else:
        cu = _host_ints("cu_seqlens", value if tensor else ints)
        info = _from_host_cu(cu, num_tokens, max_seqlen, device, backend, "cu_seqlens")

    if memoize:
        _cache[key] = (weakref.ref(value) if isinstance(value, torch.Tensor) else None, info)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return info
