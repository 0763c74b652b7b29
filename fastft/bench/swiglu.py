"""Benchmark for fastft.swiglu: the gate between a MoE expert's gate-up and down projections, on the routed rows
of a 16k-token step of the e2e MoE models, and a dense MLP's ``act_fn(gate_proj(x)) * up_proj(x)`` (gate and up
apart) at Qwen3-8B's widths with SiLU and Gemma-3-12B's with GELU's tanh form (GeGLU), forward and forward +
backward, against transformers' gates in torch ops (the default ``silu(gate) * up`` over the halves; gpt-oss's
clamped, interleaved gate; LlamaMLP's and GemmaMLP's products). Time, traffic against the HBM floor (a device
copy's bandwidth), and peak memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fastft
from fastft import dispatch
from fastft.swiglu import OP_SWIGLU

from .common import Row, copy_gbs, fwd_and_bwd

BASELINE = "transformers' gate (torch ops)"
GPT_OSS = dict(interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)

# name -> (routed rows of a 16,384-token step: tokens x top-k, expert width W, fastft.swiglu's constants)
SHAPES = {
    "Qwen3-30B-A3B": (16384 * 8, 768, {}),
    "gpt-oss-20b": (16384 * 4, 2880, GPT_OSS),
    "Qwen3.5-MoE": (16384 * 8, 512, {}),
    "Qwen3-8B MLP": (16384, 12288, None),  # None: gate and up apart, a dense MLP's (SiLU)
    "Gemma-3-12B MLP": (16384, 15360, "gelu_tanh"),  # a string: gate and up apart, that activation
}
_ACTS = {None: ("silu", F.silu), "gelu_tanh": ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))}


def transformers_gate(x: torch.Tensor, interleaved=False, alpha=1.0, limit=None, up_shift=0.0) -> torch.Tensor:
    """transformers' experts gates as they are written: ``_default_apply_gate`` with SiLU, gpt-oss's
    ``GptOssExperts._apply_gate``."""
    if not interleaved:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate, up = x[..., ::2], x[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + up_shift) * (gate * torch.sigmoid(gate * alpha))


def run(device: torch.device, quick: bool) -> list[Row]:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    backend = dispatch.backend_for(OP_SWIGLU, device)
    copy_bw = copy_gbs(device)
    rows = []
    shapes = SHAPES if gpu else {"gpt-oss-20b": SHAPES["gpt-oss-20b"]}  # the interpreter: one shape
    for name, (count, width, kw) in shapes.items():
        count, width = (count // 64, width) if quick and gpu else (count, width) if gpu else (48, 24)
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(count, 2 * width, generator=g) * 3).to(device, dtype).requires_grad_()
        grad = torch.randn(count, width, generator=g).to(device, dtype)
        apart = kw is None or isinstance(kw, str)
        if apart:  # two tensors, as two projections' outputs
            activation, act = _ACTS[kw]
            gate, up = (x.detach()[:, :width].contiguous().requires_grad_(), x.detach()[:, width:].contiguous())
            up.requires_grad_()
            x = (gate, up)
            forwards = {
                "ours": lambda: fastft.swiglu(gate, up, activation=activation),
                BASELINE: lambda: act(gate) * up,
            }
            want = act(gate.float()) * up.float()
        else:
            forwards = {
                "ours": lambda: fastft.swiglu(x, **kw),
                BASELINE: lambda: transformers_gate(x, **kw),
            }
            want = transformers_gate(x.float(), **kw)
        torch.testing.assert_close(forwards["ours"]().float(), want, atol=2e-2, rtol=2e-2)
        element = grad.element_size()
        nbytes = {
            "fwd": 3 * count * width * element,  # read gate_up, write out
            "fwd+bwd": 8 * count * width * element,  # and read gate_up and dout, write dgate_up
        }
        rep = 200 if gpu else 1
        for mode, ms, peak, note in fwd_and_bwd(forwards, x, grad, device, nbytes=nbytes, copy_bw=copy_bw, rep_ms=rep):
            if note:
                note += f"; peak {peak['ours']:.2f} GiB vs {peak[BASELINE]:.2f} GiB"
            if apart:
                case = f"{name}: {count} rows x W={width} (gate and up apart, {activation}), {dtype}, {mode}"
            else:
                layout = "interleaved, clamped" if kw.get("interleaved") else "halves"
                case = f"{name} experts' gate: {count} rows x W={width} ({layout}), {dtype}, {mode}"
            rows.append(Row("swiglu", case, BASELINE, ms[BASELINE], ms["ours"], backend, note))
    return rows
