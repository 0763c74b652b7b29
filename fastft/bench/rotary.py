"""Benchmark for fastft.rotary: the rotary embedding of a 16k-token step's queries and keys at the e2e models'
widths (Qwen3-8B's full rotary, Qwen3.5's partial one), forward and forward + backward, against transformers'
``apply_rotary_pos_emb`` as it is written (Llama's; the partial form's), bf16, ``q`` and ``k`` as transformers
hands them (``[B, T, H, D]`` memory seen as ``[B, H, T, D]``). Time, traffic against the HBM floor (a device
copy's bandwidth), and peak memory."""

from __future__ import annotations

import torch

import fastft
from fastft import dispatch
from fastft.rotary import OP_ROTARY

from .common import Row, copy_gbs, fwd_and_bwd

BASELINE = "transformers' apply_rotary_pos_emb (torch ops)"

# name -> (tokens, query heads, key heads, head width, rotated channels)
SHAPES = {
    "Qwen3-8B": (16384, 32, 8, 128, 128),
    "Qwen3.5 (partial)": (16384, 16, 4, 256, 64),
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def transformers_rotary(q, k, cos, sin):
    """Llama's ``apply_rotary_pos_emb`` (``R = D``) and its partial form (GPT-NeoX's, Qwen3.5's) as written."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    q_rot, q_pass = q[..., :r], q[..., r:]
    k_rot, k_pass = k[..., :r], k[..., r:]
    q_embed = q_rot * cos + _rotate_half(q_rot) * sin
    k_embed = k_rot * cos + _rotate_half(k_rot) * sin
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def run(device: torch.device, quick: bool) -> list[Row]:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    backend = dispatch.backend_for(OP_ROTARY, device)
    copy_bw = copy_gbs(device)
    rows = []
    shapes = SHAPES if gpu else {"tiny": (24, 4, 2, 16, 8)}
    for name, (tokens, heads_q, heads_k, width, r) in shapes.items():
        tokens = tokens // 16 if quick and gpu else tokens
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, tokens, heads_q, width, generator=g).to(device, dtype).transpose(1, 2).requires_grad_()
        k = torch.randn(1, tokens, heads_k, width, generator=g).to(device, dtype).transpose(1, 2).requires_grad_()
        angles = torch.randn(1, tokens, r // 2, generator=g).repeat(1, 1, 2).to(device)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        grad = tuple(torch.randn(t.shape, generator=g).to(device, dtype) for t in (q, k))
        forwards = {
            "ours": lambda: fastft.rotary(q, k, cos, sin),
            BASELINE: lambda: transformers_rotary(q, k, cos, sin),
        }
        for a, b in zip(forwards["ours"](), forwards[BASELINE]()):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
        element = q.element_size()
        qk = tokens * (heads_q + heads_k) * width * element
        nbytes = {"fwd": 2 * qk, "fwd+bwd": 4 * qk}  # read q and k, write theirs; and the backward the same
        rep = 200 if gpu else 1
        for mode, ms, peak, note in fwd_and_bwd(
            forwards, (q, k), grad, device, nbytes=nbytes, copy_bw=copy_bw, rep_ms=rep
        ):
            if note:
                note += f"; peak {peak['ours']:.2f} GiB vs {peak[BASELINE]:.2f} GiB"
            case = f"{name}: {tokens} tokens x {heads_q} + {heads_k} heads x D={width} (R={r}), {dtype}, {mode}"
            rows.append(Row("rotary", case, BASELINE, ms[BASELINE], ms["ours"], backend, note))
    return rows
