"""Benchmark for fastft.rms_norm: the RMSNorm layers of a 16k-token step at the e2e models' widths (a decoder
layer's hidden rows; Qwen3's per-head query norm), forward and forward + backward, against transformers' modules
as they are written (Llama's and Qwen3's norm; Qwen3.5's ``1 + weight``), bf16 rows, the weights frozen (LoRA)
and trained. Time, traffic against the HBM floor (a device copy's bandwidth), and peak memory."""

from __future__ import annotations

import torch

import fastft
from fastft import dispatch
from fastft.rms_norm import OP_RMS_NORM

from .common import Row, copy_gbs, fwd_and_bwd

BASELINE = "transformers' RMSNorm (torch ops)"

# name -> (rows, width, offset: 0 Llama's form, 1 Gemma's / Qwen3.5's, the weight trained: a full fine-tune)
SHAPES = {
    "Qwen3-8B hidden": (16384, 4096, 0.0, False),
    "Qwen3-8B hidden, trained weight": (16384, 4096, 0.0, True),
    "Qwen3-8B query heads": (16384 * 32, 128, 0.0, False),
    "Qwen3.5 hidden": (16384, 4096, 1.0, False),
}


def transformers_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` (offset 0) and ``Qwen3_5RMSNorm.forward`` (offset 1) as transformers writes them."""
    if offset:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (out * (1.0 + weight.float())).type_as(x)
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def run(device: torch.device, quick: bool) -> list[Row]:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    backend = dispatch.backend_for(OP_RMS_NORM, device)
    copy_bw = copy_gbs(device)
    rows = []
    shapes = SHAPES if gpu else {"tiny": (48, 24, 0.0, True)}
    for name, (count, width, offset, trained) in shapes.items():
        count = count // 16 if quick and gpu else count
        g = torch.Generator().manual_seed(0)
        x = torch.randn(count, width, generator=g).to(device, dtype).requires_grad_()
        w = (1 + 0.1 * torch.randn(width, generator=g)).to(device, dtype).requires_grad_(trained)
        grad = torch.randn(count, width, generator=g).to(device, dtype)
        forwards = {
            "ours": lambda: fastft.rms_norm(x, w, 1e-6, offset=offset),
            BASELINE: lambda: transformers_norm(x, w, 1e-6, offset),
        }
        torch.testing.assert_close(forwards["ours"]().float(), forwards[BASELINE]().float(), atol=2e-2, rtol=2e-2)
        element = x.element_size()
        nbytes = {
            "fwd": 2 * count * width * element,  # read x, write out
            "fwd+bwd": 5 * count * width * element,  # and read x and dout, write dx
        }
        rep = 200 if gpu else 1
        leaves = (x, w) if trained else x
        for mode, ms, peak, note in fwd_and_bwd(
            forwards, leaves, grad, device, nbytes=nbytes, copy_bw=copy_bw, rep_ms=rep
        ):
            if note:
                note += f"; peak {peak['ours']:.2f} GiB vs {peak[BASELINE]:.2f} GiB"
            form = "1 + weight" if offset else "weight"
            case = f"{name}: {count} rows x H={width} ({form}), {dtype}, {mode}"
            rows.append(Row("rms_norm", case, BASELINE, ms[BASELINE], ms["ours"], backend, note))
    return rows
