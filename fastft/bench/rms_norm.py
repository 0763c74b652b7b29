"""Benchmark for fastft.rms_norm: the RMSNorm layers of a 16k-token step at the e2e models' widths (a decoder
layer's hidden rows; Qwen3's per-head query norm; the gated norms after Qwen3.5's and Kimi-Linear's delta rules
and Granite-4.0-H's and Nemotron-H's scans), forward and forward + backward, against transformers' modules as they
are written (Llama's and Qwen3's norm; Qwen3.5's ``1 + weight``; Qwen3.5's, Kimi-Linear's, Mamba-2's and
Nemotron-H's grouped gated norms), bf16 rows, the weights frozen (LoRA) and trained. Time, traffic against the
HBM floor (a device copy's bandwidth), and peak memory."""

from __future__ import annotations

import torch

import fastft
from fastft import dispatch
from fastft.rms_norm import OP_RMS_NORM

from .common import Row, copy_gbs, fwd_and_bwd

BASELINE = "transformers' RMSNorm (torch ops)"

# name -> (rows, width, offset: 0 Llama's form, 1 Gemma's / Qwen3.5's, the weight trained: a full fine-tune,
# the gate: None, silu(gate) "after" the norm (Qwen3.5's) or "first" (Mamba-2's), "sigmoid" after it (Kimi's),
# channels a group: None for the whole row)
SHAPES = {
    "Qwen3-8B hidden": (16384, 4096, 0.0, False, None, None),
    "Qwen3-8B hidden, trained weight": (16384, 4096, 0.0, True, None, None),
    "Qwen3-8B query heads": (16384 * 32, 128, 0.0, False, None, None),
    "Qwen3.5 hidden": (16384, 4096, 1.0, False, None, None),
    "Qwen3.5 gated, value heads": (16384 * 32, 128, 0.0, False, "after", None),
    "Granite-4.0-H gated": (16384, 3072, 0.0, False, "first", None),
    "Kimi-Linear gated, heads": (16384 * 32, 128, 0.0, False, "sigmoid", None),
    "Nemotron-H 8B gated, 8 groups": (16384, 8192, 0.0, False, "first", 1024),
}


def transformers_norm(x, weight, eps: float, offset: float, gate=None, where=None, group_size=None) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` (offset 0), ``Qwen3_5RMSNorm.forward`` (offset 1), ``Qwen3_5RMSNormGated.forward``
    (a gate after), ``MambaRMSNormGated.forward`` (a gate first; in groups: ``Zamba2RMSNormGated.forward``,
    Nemotron-H's) and ``KimiLinearRMSNormGated.forward`` (a sigmoid gate after) as transformers writes them."""
    if where == "sigmoid":
        xf = x.to(torch.float32)
        xf = weight.to(torch.float32) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
        return (xf * torch.sigmoid(gate.to(torch.float32))).to(x.dtype)
    if where == "after":
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (weight * xf.to(x.dtype) * torch.nn.functional.silu(gate.to(torch.float32))).to(x.dtype)
    if where == "first":
        xf = x.to(torch.float32) * torch.nn.functional.silu(gate.to(torch.float32))
        xf = xf.unflatten(-1, (-1, group_size or xf.shape[-1]))
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
        return weight * xf.to(x.dtype)
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
    shapes = SHAPES
    if not gpu:
        shapes = {
            "tiny": (48, 24, 0.0, True, None, None),
            "tiny gated": (48, 24, 0.0, False, "first", None),
            "tiny sigmoid-gated": (48, 24, 0.0, False, "sigmoid", None),
            "tiny gated, 3 groups": (48, 24, 0.0, False, "first", 8),
        }
    for name, (count, width, offset, trained, where, group_size) in shapes.items():
        count = count // 16 if quick and gpu else count
        g = torch.Generator().manual_seed(0)
        x = torch.randn(count, width, generator=g).to(device, dtype).requires_grad_()
        w = (1 + 0.1 * torch.randn(width, generator=g)).to(device, dtype).requires_grad_(trained)
        z = torch.randn(count, width, generator=g).to(device, dtype).requires_grad_() if where else None
        grad = torch.randn(count, width, generator=g).to(device, dtype)
        activation = "sigmoid" if where == "sigmoid" else "silu"
        gate = dict(gate=z, gate_first=where == "first", gate_activation=activation) if where else {}
        forwards = {
            "ours": lambda: fastft.rms_norm(x, w, 1e-6, offset=offset, **gate, group_size=group_size),
            BASELINE: lambda: transformers_norm(x, w, 1e-6, offset, z, where, group_size),
        }
        torch.testing.assert_close(forwards["ours"]().float(), forwards[BASELINE]().float(), atol=2e-2, rtol=2e-2)
        element = x.element_size()
        tensors = 2 if where else 1  # x, and the gate
        nbytes = {
            "fwd": (tensors + 1) * count * width * element,  # read x (and z), write out
            "fwd+bwd": (3 * tensors + 2) * count * width * element,  # and read x (z) and dout, write dx (dz)
        }
        rep = 200 if gpu else 1
        leaves = tuple(t for t in (x, w if trained else None, z) if t is not None)
        leaves = leaves[0] if len(leaves) == 1 else leaves
        for mode, ms, peak, note in fwd_and_bwd(
            forwards, leaves, grad, device, nbytes=nbytes, copy_bw=copy_bw, rep_ms=rep
        ):
            if note:
                note += f"; peak {peak['ours']:.2f} GiB vs {peak[BASELINE]:.2f} GiB"
            form = ("1 + weight" if offset else "weight") + (
                f", {activation}(gate) {'first' if where == 'first' else 'after'}" if where else ""
            )
            form += f", groups of {group_size}" if group_size else ""
            case = f"{name}: {count} rows x H={width} ({form}), {dtype}, {mode}"
            rows.append(Row("rms_norm", case, BASELINE, ms[BASELINE], ms["ours"], backend, note))
    return rows
