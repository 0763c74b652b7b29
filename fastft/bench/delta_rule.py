"""Benchmark for fastft.delta_rule: the gated delta rule (Qwen3.5 / Qwen3-Next widths: 32 value heads of 128,
chunk 64) forward + backward over one packed row, on the backend ``auto`` picks (the Triton scan over chunks on
a GPU), against the op with the torch loop over chunks (``backend='torch'``) and transformers 5.17's torch path
(``torch_chunk_gated_delta_rule``) on the whole row (what stock packing runs: fast but every document reads
the state of the ones before it) and run once per document (correct; a Python loop of launches, and a sync
per batch to read the lengths when they are on the GPU). Peak memory beside time. On a GPU, the scan over
chunks alone too, forward and forward + backward: the Triton kernels against the torch loop."""

from __future__ import annotations

import inspect

import torch

import fastft
from fastft import delta_rule, dispatch
from fastft.reference import delta_rule as reference

from .common import Row, peak_gib, time_ms

HEADS, HEAD_DIM, CHUNK = 32, 128, 64  # Qwen3_5TextConfig / Qwen3NextConfig: linear_num_value_heads, *_head_dim


def _lengths(tokens: int, docs: int) -> list[int]:
    g = torch.Generator().manual_seed(tokens + docs)
    cuts = torch.randperm(tokens - 1, generator=g)[: docs - 1].add(1).sort().values.tolist()
    return [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]


def _inputs(tokens, heads, dim, dtype, device):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, dim, generator=g) for _ in range(3))
    decay = -torch.rand(1, tokens, heads, generator=g)
    beta = torch.rand(1, tokens, heads, generator=g)
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v, decay, beta)]


def run(device: torch.device, quick: bool) -> list[Row]:
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
    except ImportError:
        print("delta_rule bench: transformers is not installed, skipped")
        return []
    stock = inspect.unwrap(qwen.torch_chunk_gated_delta_rule)  # the torch path, not an installed kernel
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    heads, dim = (HEADS, HEAD_DIM) if gpu else (2, 16)  # CPU: the interpreter runs the kernels, slowly
    rows = []
    for tokens in (8192, 32768) if gpu and not quick else (512 if gpu else 256,):
        lengths = _lengths(tokens, max(2, tokens // 1024))
        info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
        inputs = _inputs(tokens, heads, dim, dtype, device)
        grad = torch.randn(1, tokens, heads, dim, device=device, dtype=dtype)

        def step(forward):
            return lambda: torch.autograd.grad(forward(), inputs, grad)

        chosen = dispatch.backend_for(delta_rule.OP_SCAN, device)

        def ours():
            return delta_rule.gated_delta_rule(*inputs, info, chunk_size=CHUNK, backend=chosen)

        def torch_loop():
            return delta_rule.gated_delta_rule(*inputs, info, chunk_size=CHUNK, backend="torch")

        def packed():
            return stock(*inputs, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True)[0]

        def per_document():
            outs, start = [], 0
            for n in lengths:
                doc = (x[:, start : start + n] for x in inputs)
                outs.append(stock(*doc, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True)[0])
                start += n
            return torch.cat(outs, 1)

        torch.testing.assert_close(ours().float(), per_document().float(), rtol=2e-2, atol=2e-2)
        fast = time_ms(step(ours), device)
        peak = peak_gib(step(ours), device)
        shape = f"T={tokens}, {len(lengths)} docs, {heads}x{dim}, {str(dtype).removeprefix('torch.')}"
        baselines = [("hf torch chunked, packed (leaks)", packed), ("hf torch chunked, per document", per_document)]
        if chosen == "triton":
            baselines.insert(0, ("fastft, torch loop over chunks", torch_loop))
        for label, fn in baselines:
            their_peak = peak_gib(step(fn), device)
            memory = "" if peak is None else f"peak {their_peak:.2f} GiB vs fastft {peak:.2f} GiB"
            rows.append(Row("gated_delta_rule fwd+bwd", shape, label, time_ms(step(fn), device), fast, chosen, memory))
        if not gpu:  # the specification, a loop over tokens: CPU sizes only
            ref = lambda: reference.gated_delta_rule(*inputs, info.position_ids, dim**-0.5, True)  # noqa: E731
            rows.append(
                Row(
                    "gated_delta_rule fwd",
                    shape,
                    "token-by-token reference",
                    time_ms(ref, device),
                    time_ms(ours, device),
                    chosen,
                )
            )
        if gpu:  # the sequential part alone: the Triton kernels against the torch loop
            rows += _scan_rows(info, heads, dim, shape, device)
    return rows


def _scan_rows(info, heads, dim, shape, device) -> list[Row]:
    table = delta_rule.chunk_table(info, CHUNK)
    g = torch.Generator().manual_seed(1)
    nc = table.num_chunks_bound
    w, kd = (torch.randn(heads, nc, CHUNK, dim, generator=g).to(device) * 0.05 for _ in range(2))
    u = torch.randn(heads, nc, CHUNK, dim, generator=g).to(device)
    decay = torch.rand(heads, nc, generator=g).to(device)
    inputs = [x.requires_grad_() for x in (w, u, kd, decay)]
    grads = [torch.randn(heads, nc, *size, generator=g).to(device) for size in ((dim, dim), (CHUNK, dim))]
    ours = lambda: delta_rule.chunk_scan_op(*inputs, table.first)  # noqa: E731
    theirs = lambda: delta_rule.scan_chunks(*inputs, table.first)  # noqa: E731
    for a, e in zip(ours(), theirs()):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)

    def forward(scan):
        return lambda: torch.no_grad()(scan)()

    def forward_backward(scan):
        return lambda: torch.autograd.grad(scan(), inputs, grads)

    return [
        Row(
            f"scan over chunks, {label}",
            shape,
            "torch loop (backend='torch')",
            time_ms(timed(theirs), device),
            time_ms(timed(ours), device),
            "triton",
            f"{nc} chunks, fp32",
        )
        for label, timed in (("fwd", forward), ("fwd+bwd", forward_backward))
    ]


def tune_launchers(device: torch.device) -> dict:
    """op -> make(size) -> fn(cfg) that runs the scan kernel (forward, or the reverse scan) once with launch
    parameters ``cfg``; size is w's elements at Qwen3.5's widths (the op's ``autotune.Tunable``)."""
    from fastft.kernels import delta_rule as kernels

    def inputs(size):
        nc = max(1, size // (HEADS * CHUNK * HEAD_DIM))
        g = torch.Generator().manual_seed(2)
        w, kd = (torch.randn(HEADS, nc, CHUNK, HEAD_DIM, generator=g).to(device) * 0.05 for _ in range(2))
        u = torch.randn(HEADS, nc, CHUNK, HEAD_DIM, generator=g).to(device)
        decay = torch.rand(HEADS, nc, generator=g).to(device)
        first = (torch.arange(nc) % 16 == 0).to(device)
        return w, u, kd, decay, first

    def forward(size):
        w, u, kd, decay, first = inputs(size)
        return lambda cfg: kernels.chunk_scan(w, u, kd, decay, first, **cfg)

    def backward(size):
        w, u, kd, decay, first = inputs(size)
        states, v_new = kernels.chunk_scan(w, u, kd, decay, first)
        dstates, dv_new = torch.randn_like(states), torch.randn_like(v_new)
        return lambda cfg: kernels.chunk_scan_backward(w, kd, decay, first, dstates, dv_new, **cfg)

    return {delta_rule.OP_SCAN: forward, delta_rule.OP_SCAN_BACKWARD: backward}
