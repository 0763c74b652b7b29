"""Benchmark for fastft.copy: pack of strided tensors into one buffer vs torch copies into slices of it."""

from __future__ import annotations

import torch

from fastft import copy, dispatch

from .common import Row, time_ms


def run(device: torch.device, quick: bool) -> list[Row]:
    rows: list[Row] = []
    backend = dispatch.backend_for(copy.OP_PACK, device)
    n = 1 << (12 if quick else 26)
    base = torch.randn(2 * n // 1024, 1024, device=device, dtype=torch.bfloat16)
    tensors = [base[:, ::2], base[: n // 1024].t(), torch.randn(n, device=device, dtype=torch.bfloat16)]
    buf, layout = copy.pack(tensors)

    def torch_pack():
        for t, e in zip(tensors, layout.entries):
            buf[e.offset : e.offset + e.nbytes].view(t.dtype).view(t.shape).copy_(t)

    moved = 2 * layout.nbytes
    ms_torch = time_ms(torch_pack, device)
    ms_ours = time_ms(lambda: copy.pack(tensors, out=buf), device)
    note = f"{moved / (ms_ours * 1e6):.0f} GB/s read+write" if device.type == "cuda" else ""
    rows.append(
        Row(
            "copy.pack",
            f"3 bf16 tensors (strided, transposed, contiguous), {layout.nbytes >> 20} MiB",
            "torch copy_ per tensor",
            ms_torch,
            ms_ours,
            backend,
            note,
        )
    )
    return rows
