"""Benchmark for offloaded gradient checkpointing (``fastft.offload``) and pack/unpack (``fastft.copy``).

A stack of decoder layers (RMSNorm, GQA attention through SDPA's causal flash kernel, SwiGLU MLP; bf16
weights that all take gradients; no rotary embedding) runs forward + backward with, side by side:
plain recompute checkpointing (``torch.utils.checkpoint``, non-reentrant), fastft's offload with one GPU
buffer, and with two. Reported: median step time, peak GPU memory in the step, and how much of the
reload copy time the compute stream did not wait for (CUDA events around every reload and every wait).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fastft
from fastft import offload
from fastft.e2e.models import MODEL_CONFIGS

from .common import Row, time_ms

_QWEN = MODEL_CONFIGS["Qwen3-0.6B"][1]
# name -> (hidden, heads, kv heads, head dim, intermediate); Llama-3.1-8B is not in the model table (no e2e run)
SHAPES = {
    "Llama-3.1-8B": (4096, 32, 8, 128, 14336),
    "Qwen3-0.6B": tuple(
        _QWEN[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    ),
}
CASES = [("Llama-3.1-8B", 8192), ("Llama-3.1-8B", 16384), ("Qwen3-0.6B", 16384)]
LAYERS = 8


class DecoderLayer(torch.nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, inter, device, dtype):
        super().__init__()

        def w(i, o):
            return torch.nn.Parameter(torch.randn(i, o, device=device, dtype=dtype) / i**0.5)

        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1 = torch.nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))
        self.norm2 = torch.nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))
        self.qkv = w(hidden, (heads + 2 * kv_heads) * head_dim)
        self.o = w(heads * head_dim, hidden)
        self.gate_up = w(hidden, 2 * inter)
        self.down = w(inter, hidden)

    def forward(self, x):
        t = x.shape[0]
        q, k, v = (F.rms_norm(x, x.shape[-1:], self.norm1) @ self.qkv).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1
        )
        q = q.view(1, t, self.heads, self.head_dim).transpose(1, 2)
        # k/v repeated per query head, 4-D: SDPA's flash kernel (enable_gqa or 3-D inputs take the math path)
        k = k.view(1, t, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, 1)
        v = v.view(1, t, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0]
        x = x + a.transpose(0, 1).reshape(t, -1) @ self.o
        gate, up = (F.rms_norm(x, x.shape[-1:], self.norm2) @ self.gate_up).chunk(2, -1)
        return x + (F.silu(gate) * up) @ self.down


def _step(layers, x, ckpt):
    h = x
    for layer in layers:
        h = ckpt(layer, h)
    h.float().square().mean().backward()


def _checkpoint_fns():
    def plain(f, h):
        return checkpoint(f, h, use_reentrant=False)

    def single(f, h):
        return fastft.offloaded_checkpoint(
            f, h, offload_config=offload.OffloadConfig(enabled=True, double_buffer=False)
        )

    def double(f, h):
        return fastft.offloaded_checkpoint(f, h, offload_config=offload.OffloadConfig(enabled=True, double_buffer=True))

    return {"checkpoint": plain, "offload 1 buffer": single, "offload 2 buffers": double}


def _measure(layers, x, fns: dict, steps: int) -> dict:
    """label -> (median step ms, peak bytes above the steady state). Steps of the variants alternate, so
    clock and thermal drift spread over all of them alike."""
    peaks = {}
    for label, ckpt in fns.items():
        for _ in range(2):
            _step(layers, x, ckpt)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(layers, x, ckpt)
        torch.cuda.synchronize()
        peaks[label] = torch.cuda.max_memory_allocated() - base
    times: dict = {label: [] for label in fns}
    for _ in range(steps):
        for label, ckpt in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(layers, x, ckpt)
            end.record()
            torch.cuda.synchronize()
            times[label].append(start.elapsed_time(end))
    return {label: (statistics.median(times[label]), peaks[label]) for label in fns}


def _hidden_fraction(layers, x, ckpt, off) -> tuple[float, float]:
    """(reload copy ms per step, fraction of it the compute stream did not wait for), from one step."""
    off.timeline = []
    _step(layers, x, ckpt)
    torch.cuda.synchronize()
    events, off.timeline = off.timeline, None
    copy_ms = sum(a.elapsed_time(b) for kind, a, b in events if kind == "copy")
    stall_ms = sum(a.elapsed_time(b) for kind, a, b in events if kind == "stall")
    return copy_ms, 1 - stall_ms / copy_ms if copy_ms else 0.0


def run_offload(device: torch.device, quick: bool) -> list[Row]:
    rows: list[Row] = []
    fns = _checkpoint_fns()
    if device.type != "cuda":  # tiny stack; offloaded_checkpoint is plain checkpointing on CPU
        layers = [DecoderLayer(64, 4, 2, 16, 128, device, torch.float32) for _ in range(2)]
        x = torch.randn(64, 64, device=device, requires_grad=True)
        plain_ms, ms = (
            time_ms(lambda f=fns[k]: _step(layers, x, f), device) for k in ("checkpoint", "offload 2 buffers")
        )
        rows.append(
            Row(
                "offloaded_checkpoint",
                "tiny 2-layer stack, 64 tokens",
                "torch checkpoint",
                plain_ms,
                ms,
                "torch",
                "CPU: plain checkpointing, no offload",
            )
        )
        return rows
    steps = 3 if quick else 15
    cases = [("Qwen3-0.6B", 4096)] if quick else CASES
    for name, tokens in cases:
        hidden, heads, kv, hd, inter = SHAPES[name]
        torch.manual_seed(0)
        layers = [DecoderLayer(hidden, heads, kv, hd, inter, device, torch.bfloat16) for _ in range(LAYERS)]
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        size = x.numel() * x.element_size()
        results = _measure(layers, x, fns, steps)
        plain_ms, plain_peak = results["checkpoint"]
        shape = f"{name} x{LAYERS} layers, {tokens} tokens"
        for label, buffers in (("offload 1 buffer", 1), ("offload 2 buffers", 2)):
            ms, peak = results[label]
            off = offload.offloader_for(x, offload.OffloadConfig(enabled=True, double_buffer=buffers == 2))
            copy_ms, hidden_frac = _hidden_fraction(layers, x, fns[label], off)
            saved = (plain_peak - peak) / size
            rows.append(
                Row(
                    f"offloaded_checkpoint ({label})",
                    shape,
                    "torch checkpoint",
                    plain_ms,
                    ms,
                    "cuda",
                    f"{ms / plain_ms:.3f}x checkpoint's step; peak {peak / 2**30:.2f} GiB vs "
                    f"{plain_peak / 2**30:.2f} GiB "
                    f"({saved:.1f} layer inputs less); reload {copy_ms:.2f} ms/step, {100 * hidden_frac:.0f}% hidden",
                )
            )
        del layers, x
        torch.cuda.empty_cache()
    return rows


def run(device: torch.device, quick: bool) -> list[Row]:
    return run_offload(device, quick)
