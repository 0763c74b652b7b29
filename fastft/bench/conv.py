"""Benchmark for fastft.packed_conv1d: the short causal depthwise convolution of hybrid models over one packed
row, forward and forward + backward, against transformers' torch path (transpose + ``F.conv1d`` + SiLU over
the whole row, which leaks across documents) and against fastft's torch backend (correct: masked shifted
sums). Time, bandwidth against the HBM floor (a device copy's bandwidth), and peak memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fastft
from fastft import conv, dispatch
from fastft.testing import packed_position_ids

from .common import Row, copy_gbs, fwd_and_bwd

# name -> (channels, kernel width, bias, activation): the defaults of each family's transformers config
SHAPES = {
    # Qwen3_5TextConfig: linear_key_head_dim 128 x 16 key heads x 2 + linear_value_head_dim 128 x 32 value heads
    "Qwen3.5 Gated DeltaNet": (8192, 4, False, "silu"),
    # Lfm2Config: hidden_size 2560, conv_L_cache 3, conv_bias False, no activation
    "LFM2 short conv": (2560, 3, False, None),
    # GraniteMoeHybridConfig (Mamba-2): mamba_expand 2 x hidden 4096 + 2 x 1 group x d_state 256, bias, SiLU
    "Granite-MoE-Hybrid Mamba-2": (8704, 4, True, "silu"),
}


def stock_conv1d(x, weight, bias, activation):
    """transformers' ``causal_conv1d_fn`` torch fallback on ``[B, T, C]``: one convolution over each row."""
    t, c = x.shape[1], x.shape[2]
    out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, bias, padding=weight.shape[-1] - 1, groups=c)
    out = out[..., :t]
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype).transpose(1, 2)


def run(device: torch.device, quick: bool) -> list[Row]:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    tokens = 24 if not gpu else 256 if quick else 16384  # 24: the interpreter's speed on a CPU
    backend = dispatch.backend_for(conv.OP_CONV, device)
    copy_bw = copy_gbs(device)
    rows = []
    shapes = SHAPES if gpu else dict(list(SHAPES.items())[-1:])  # the interpreter: one shape, bias and SiLU
    for name, (channels, width, has_bias, activation) in shapes.items():
        channels = 8 if not gpu else channels // 64 if quick else channels
        num_docs = max(4, tokens // 512)
        info = fastft.packed_seq_info(position_ids=packed_position_ids(tokens, num_docs, device)[None])
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, tokens, channels, generator=g).to(device, dtype).requires_grad_()
        weight = torch.randn(channels, 1, width, generator=g).to(device, dtype).requires_grad_()
        bias = torch.randn(channels, generator=g).to(device, dtype).requires_grad_() if has_bias else None
        grad = torch.randn(x.shape, generator=g).to(device, dtype)
        leaves = [x, weight] + ([bias] if has_bias else [])

        def fastft_fn(chosen):
            return lambda: fastft.packed_conv1d(x, weight, info, bias=bias, activation=activation, backend=chosen)

        forwards = {
            "ours": fastft_fn(backend),
            "transformers' torch path (leaks across documents)": lambda: stock_conv1d(x, weight, bias, activation),
            "fastft torch backend (correct)": fastft_fn("torch"),
        }
        torch.testing.assert_close(
            forwards["ours"](), forwards["fastft torch backend (correct)"](), atol=2e-2, rtol=1e-2
        )
        element = x.element_size()
        nbytes = {
            "fwd": 2 * tokens * channels * element,  # read x, write out
            "fwd+bwd": 5 * tokens * channels * element,  # and read dout and x, write dx
        }
        rep = 200 if gpu else 1
        for mode, ms, peak, note in fwd_and_bwd(
            forwards, leaves, grad, device, nbytes=nbytes, copy_bw=copy_bw, rep_ms=rep
        ):
            if note:
                note += f"; peak {peak['ours']:.2f} GiB vs {{}} GiB"
            case = f"{name}: {tokens} tokens, {num_docs} docs, C={channels}, W={width}"
            case += f"{', bias' if has_bias else ''}{', SiLU' if activation else ''}, {dtype}, {mode}"
            for label in list(forwards)[1:]:
                row_note = note.format(f"{peak[label]:.2f}") if note else ""
                rows.append(Row("packed_conv1d", case, label, ms[label], ms["ours"], backend, row_note))
    return rows
