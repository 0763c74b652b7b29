"""Benchmark and autotune specs for packed-sequence metadata (``fastft.packing``)."""

from __future__ import annotations

import torch

import fastft
from fastft import dispatch, packing
from fastft.reference import packing as reference
from fastft.selfcheck import BLOCK_MASK_FIELDS
from fastft.testing import assert_same
from fastft.testing import packed_position_ids as documents

from .common import Row, host_us, time_ms, write_bandwidth_ms


def naive_boundaries(position_ids: torch.Tensor):
    """The glue fastft replaces: boundaries from position ids with data-dependent shapes and host syncs."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()  # syncs for the output size
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).int()
    max_seqlen = int(cu.diff().max().item())  # syncs again
    return cu, max_seqlen


def run(device: torch.device, quick: bool) -> list[Row]:
    rows: list[Row] = []
    backend = dispatch.backend_for(packing.OP_SDPA_MASK, device)
    gpu = device.type == "cuda"

    # 1) Boundaries from device position ids: a fresh build, as the first layer of a batch pays it.
    for t in (4096,) if quick else (16384, 131072):
        pos = documents(t, max(1, t // 512), device)

        def build():
            info = packing.from_position_ids(pos, device, None)
            return info.cu_seqlens, info.max_seqlen

        assert torch.equal(build()[0], naive_boundaries(pos)[0])
        rows.append(
            Row(
                "boundaries: first build",
                f"T={t}",
                "nonzero + .item()",
                time_ms(lambda: naive_boundaries(pos), device),
                time_ms(build, device),
                backend,
                "both sync once",
            )
        )

    # 2) Dense SDPA mask.
    t = 512 if quick else 16384
    doc = fastft.packed_seq_info(position_ids=documents(t, 32, device)).doc_ids.view(1, t)
    for dtype in (torch.bool, torch.bfloat16):
        ours = lambda: packing.sdpa_mask_op(doc, 0, dtype, backend)  # noqa: E731
        assert_same(ours(), reference.sdpa_mask(doc, 0, dtype))
        floor = write_bandwidth_ms(t * t * torch.empty((), dtype=dtype).element_size(), device)
        fast = time_ms(ours, device)
        rows.append(
            Row(
                f"sdpa_mask {dtype}",
                f"T={t}, 32 docs",
                "torch reference (vectorised)",
                time_ms(lambda: reference.sdpa_mask(doc, 0, dtype), device),
                fast,
                backend,
                f"{fast / floor:.2f}x the write floor ({floor:.4f} ms)",
            )
        )

    # 3) FlexAttention BlockMask, against create_block_mask with the same document mask_mod.
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = torch.compile(create_block_mask) if gpu else None
    for t in (1024,) if quick else (32768, 131072):
        doc = fastft.packed_seq_info(position_ids=documents(t, max(1, t // 512), device)).doc_ids.view(1, t)
        mask_mod = packing.document_mask_mod(doc)

        def ours():
            return packing.make_block_mask(packing.block_tables_op(doc, 0, 128, backend), doc, 0, 128)

        def theirs(fn=compiled or create_block_mask):
            return fn(mask_mod, 1, 1, t, t, device=device, BLOCK_SIZE=128)

        expected = theirs()
        got = ours()
        assert_same(
            {f: getattr(got, f) for f in BLOCK_MASK_FIELDS}, {f: getattr(expected, f) for f in BLOCK_MASK_FIELDS}
        )
        fast = time_ms(ours, device)
        label = "create_block_mask (compiled)" if gpu else "create_block_mask"
        rows.append(Row("flex_block_mask", f"T={t}", label, time_ms(theirs, device), fast, backend, "tables identical"))
        if gpu and t <= 32768:
            rows.append(
                Row(
                    "flex_block_mask",
                    f"T={t}",
                    "create_block_mask (eager)",
                    time_ms(lambda: theirs(create_block_mask), device),
                    fast,
                    backend,
                    "tables identical",
                )
            )

    # 4) Per-layer lookups after the first layer: host time, no device work.
    t = 1024 if quick else 16384
    pos = documents(t, 32, device)
    fastft.packed_seq_info(position_ids=pos).sdpa_mask()

    def layer():
        return fastft.packed_seq_info(position_ids=pos).sdpa_mask()

    def naive_layer():
        return naive_boundaries(pos)

    rows.append(
        Row(
            "per-layer lookup (host)",
            f"T={t}, one layer",
            "per-layer rebuild with syncs",
            host_us(naive_layer) / 1000,
            host_us(layer) / 1000,
            backend,
            "cached info + mask, no sync",
        )
    )
    return rows


# ---- autotune ---------------------------------------------------------------------------------------------


def tune_launchers(device: torch.device) -> dict:
    """op -> make(size) -> fn(cfg) that launches the op's kernel once with launch parameters ``cfg``
    (the sizes and the candidate grid are the op's ``autotune.Tunable``, in fastft/packing.py)."""
    from fastft.kernels import packing as kernels

    def boundaries(t):
        pos = documents(t, max(1, t // 512), device)
        return lambda cfg: kernels.boundaries_from_position_ids(pos, **cfg)

    def from_cu(t):
        cu = fastft.packed_seq_info(position_ids=documents(t, max(1, t // 512), device)).cu_seqlens
        return lambda cfg: kernels.boundaries_from_cu_seqlens(cu, t, **cfg)

    def mask(t):
        doc = fastft.packed_seq_info(position_ids=documents(t, 32, device)).doc_ids.view(1, t)
        return lambda cfg: kernels.sdpa_mask(doc, 0, torch.bool, **cfg)

    def tables(t):
        doc = fastft.packed_seq_info(position_ids=documents(t, max(1, t // 512), device)).doc_ids.view(1, t)
        return lambda cfg: kernels.block_mask_tables(doc, 0, 128, **cfg)

    return {
        packing.OP_BOUNDARIES: boundaries,
        packing.OP_FROM_CU_SEQLENS: from_cu,
        packing.OP_SDPA_MASK: mask,
        packing.OP_BLOCK_TABLES: tables,
    }
