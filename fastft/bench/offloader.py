"""Benchmark for fastft.offloader: an Offloader round trip (device -> pinned host -> device) against the
same bytes copied with torch's own pinned tensors, and the link's bandwidth each way. GPU only."""

from __future__ import annotations

import torch

from .common import Row, time_ms


def run(device: torch.device, quick: bool) -> list[Row]:
    if device.type != "cuda":
        print("the offloader benchmark needs a GPU: skipped")
        return []
    from fastft.offloader import Offloader

    rows: list[Row] = []
    nbytes = 1 << (22 if quick else 28)
    x = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buf = x.view(torch.uint8)
    d2h = time_ms(lambda: host.copy_(buf, non_blocking=True), device)
    h2d = time_ms(lambda: buf.copy_(host, non_blocking=True), device)
    mib = nbytes >> 20
    rows.append(
        Row("pinned copy", f"{mib} MiB", "-", None, d2h, "cuda", f"device->host {nbytes / (d2h * 1e6):.1f} GB/s")
    )
    rows.append(
        Row("pinned copy", f"{mib} MiB", "-", None, h2d, "cuda", f"host->device {nbytes / (h2d * 1e6):.1f} GB/s")
    )

    off = Offloader(device)
    back = torch.empty_like(x)

    def theirs():  # torch's own: a pinned host tensor each way
        host.view(torch.bfloat16).copy_(x, non_blocking=True)
        back.copy_(host.view(torch.bfloat16), non_blocking=True)

    def ours():
        saved = off.offload(x)
        saved.on_device = None  # force the host round trip (offload keeps its newest tensor on the GPU)
        off.reload(saved).wait()

    rows.append(
        Row(
            "Offloader offload+reload",
            f"{mib} MiB bf16",
            "torch pinned copy_ both ways",
            time_ms(theirs, device),
            time_ms(ours, device),
            "cuda",
            "pooled exact-size pinned memory",
        )
    )
    return rows
