"""Benchmark for fastft.packed_attention: forward + backward over one packed row, against what a packed
batch costs without it: SDPA with a dense ``[T, T]`` document mask (stock transformers' ``sdpa`` with packed
position ids), and for attention sinks transformers' gpt-oss eager attention with the same mask. Peak
memory beside time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fastft
from fastft import attention
from fastft.e2e.models import MODEL_CONFIGS

from .common import Row, peak_gib, time_ms


def _heads(name: str) -> tuple[int, int, int]:
    fields = MODEL_CONFIGS[name][1]
    return fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"]


# name -> (query heads, key/value heads, head dim, sinks), from the model table
SHAPES = {
    "Llama-3.2-1B": (*_heads("Llama-3.2-1B"), False),
    "Qwen3-8B": (*_heads("Qwen3-8B"), False),
    "gpt-oss-20b (sinks)": (*_heads("gpt-oss-20b"), True),
}


def _dense_sinks(q, k, v, mask, sinks):
    """gpt-oss eager attention: scores, the sink column, softmax, drop the sink (transformers' own steps)."""
    groups = q.shape[2] // k.shape[2]
    qh, kh, vh = (
        q.transpose(1, 2),
        k.transpose(1, 2).repeat_interleave(groups, 1),
        v.transpose(1, 2).repeat_interleave(groups, 1),
    )
    scores = qh @ kh.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).float().softmax(dim=-1)[..., :-1].to(q.dtype)
    return (probs @ vh).transpose(1, 2)


def run(device: torch.device, quick: bool) -> list[Row]:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    rows = []
    for name, (heads, kv_heads, dim, has_sinks) in SHAPES.items():
        tokens = 256 if quick or not gpu else (4096 if has_sinks else 16384)
        if not gpu:
            heads, kv_heads, dim = heads // 8, kv_heads // 4, 16
        g = torch.Generator().manual_seed(0)
        lengths = []
        while sum(lengths) < tokens:
            lengths.append(int(torch.randint(16, max(17, tokens // 8), (), generator=g)))
        lengths[-1] -= sum(lengths) - tokens
        positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
        info = fastft.packed_seq_info(position_ids=positions)
        q = torch.randn(1, tokens, heads, dim, generator=g).to(device, dtype).requires_grad_()
        k, v = (torch.randn(1, tokens, kv_heads, dim, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
        sinks = torch.randn(heads, generator=g).to(device, dtype).requires_grad_() if has_sinks else None
        grad = torch.randn(1, tokens, heads, dim, generator=g).to(device, dtype)

        def ours():
            fastft.packed_attention(q, k, v, info, sinks=sinks).backward(grad)

        if has_sinks:
            mask = info.sdpa_mask(dtype=dtype)
            label = "gpt-oss eager attention, dense mask"

            def theirs():
                _dense_sinks(q, k, v, mask, sinks).backward(grad)
        else:
            mask = info.sdpa_mask()
            label = "SDPA, dense document mask"

            def theirs():
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
                )
                out.transpose(1, 2).backward(grad)

        path = "flash" if attention.flash_reason(q, k, sinks, 0.0, None) is None else "dense"
        fast = time_ms(ours, device, rep_ms=300 if gpu else 50)
        try:
            slow, slow_peak = time_ms(theirs, device, rep_ms=300 if gpu else 50), peak_gib(theirs, device)
        except torch.OutOfMemoryError:
            slow, slow_peak = None, None
        ours_peak = peak_gib(ours, device)
        memory = (
            ""
            if ours_peak is None
            else f"; peak {ours_peak:.2f} GiB vs "
            + (f"{slow_peak:.2f} GiB" if slow_peak is not None else "out of memory")
        )
        shape = f"{name}: {tokens} tokens, {len(lengths)} docs, {heads}/{kv_heads} heads x {dim}, fwd+bwd"
        rows.append(Row("packed_attention", shape, label, slow, fast, path, f"mask build not timed{memory}"))
    return rows
