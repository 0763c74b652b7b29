"""Benchmark for fastft.linear_cross_entropy: a language-model head's loss over a 16k-token step at the e2e models'
widths and vocabularies, forward + backward (the op forms its gradients in the forward), against transformers'
``ForCausalLMLoss`` (the head's logits for every token, upcast to fp32, ``F.cross_entropy``; Gemma's soft cap
``c * tanh(logits / c)`` in the logits' dtype before, as its forward does). The head frozen (LoRA: only the
hidden states' gradient) and trained. Time, the GEMMs' share (the same products alone, as
``F.linear`` calls: what any loss must run) and peak memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fastft
from fastft import dispatch
from fastft.linear_cross_entropy import OP_CROSS_ENTROPY

from .common import Row, peak_gib, time_ms

BASELINE = "transformers' ForCausalLMLoss (all logits)"

# name -> (hidden width, vocabulary, soft cap) of the e2e models and Gemma-2-9B (a capped 256k vocabulary)
SHAPES = {"Qwen3-8B": (4096, 151936, None), "Qwen3.5": (4096, 248320, None), "Gemma-2-9B": (3584, 256000, 30.0)}


def stock_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    logits = F.linear(h, w)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), y)


def run(device: torch.device, quick: bool) -> list[Row]:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    backend = dispatch.backend_for(OP_CROSS_ENTROPY, device)
    rows = []
    tokens = 16384 if gpu and not quick else 2048 if gpu else 40
    shapes = SHAPES if gpu else {"tiny": (16, 97, None)}
    for name, (width, vocab, cap) in shapes.items():
        g = torch.Generator().manual_seed(0)
        h = torch.randn(tokens, width, generator=g).to(device, dtype).requires_grad_()
        w = (torch.randn(vocab, width, generator=g) * width**-0.5).to(device, dtype)
        y = torch.randint(0, vocab, (tokens,), generator=g).to(device)
        for trained in (False, True):
            w.requires_grad_(trained)
            leaves = (h, w) if trained else (h,)
            fns = {
                "ours": lambda: torch.autograd.grad(fastft.linear_cross_entropy(h, w, y, softcap=cap), leaves),
                BASELINE: lambda: torch.autograd.grad(stock_loss(h, w, y, cap), leaves),
            }
            got, want = fns["ours"](), fns[BASELINE]()
            for a, b in zip(got, want):
                torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
            rep = 200 if gpu else 1
            order = list(fns) if trained else list(fns)[::-1]  # each first once
            ms = {k: time_ms(fns[k], device, rep_ms=rep) for k in order}
            peak = {k: peak_gib(fns[k], device) for k in order}
            note = ""
            if gpu:
                gemm = time_ms(lambda: F.linear(h.detach(), w.detach()), device, rep_ms=rep)
                gemms = (3 if trained else 2) * gemm  # logits, hidden's gradient (and the head's)
                note = f"{ms['ours'] / gemms:.2f}x its GEMMs alone ({gemms:.2f} ms); "
                note += f"peak {peak['ours']:.2f} GiB vs {peak[BASELINE]:.2f} GiB"
            head = "trained head" if trained else "frozen head (LoRA)"
            capped = f", capped at {cap:g}" if cap is not None else ""
            case = f"{name} head: {tokens} tokens x H={width} -> V={vocab}{capped}, {dtype}, {head}, fwd+bwd"
            rows.append(Row("linear_cross_entropy", case, BASELINE, ms[BASELINE], ms["ours"], backend, note))
    return rows
