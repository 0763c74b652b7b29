"""Benchmarks for fastft.ssd (Mamba-2's scan) and fastft.selective_scan (Mamba-1's), forward + backward over one
packed row, on the backend ``auto`` picks (Triton on a GPU), against transformers 5.17's torch paths
(``mamba2_chunk_scan`` of Nemotron-H, ``mamba_selective_scan`` of Jamba) on the whole row (what stock packing
runs: every document reads the state of the ones before it) and run once per document (correct; a Python loop of
launches). Peak memory beside time, and each op's floors: the HBM bytes its inputs, outputs and gradients must
move at the measured copy bandwidth, and (Mamba-2) the FLOPs of its chunked matmuls at the card's dense bf16
peak.

Widths: Nemotron-H 8B / Granite-4.0-H (128 heads of 64, state 128, 8 groups; chunk 64 for fastft, the models'
own 128 / 256 for transformers) and Jamba (Dm = 8192, N = 16). On CPU, tiny widths (the interpreter runs the
kernels)."""

from __future__ import annotations

import inspect

import torch

import fastft
from fastft import dispatch, ssd
from fastft import selective_scan as mamba1

from .common import Row, copy_gbs, peak_gib, time_ms

SSD_HEADS, SSD_HEAD_DIM, SSD_GROUPS, SSD_STATE, SSD_CHUNK = 128, 64, 8, 128, 64  # Nemotron-H 8B
MAMBA_CHANNELS, MAMBA_STATE = 8192, 16  # Jamba: mamba_expand * hidden_size, mamba_d_state
DENSE_BF16_TFLOPS = 989.0  # H100 SXM dense bf16 peak; fastft's chunked matmuls run in fp32, so this is a floor


def _lengths(tokens: int, docs: int) -> list[int]:
    g = torch.Generator().manual_seed(tokens + docs)
    cuts = torch.randperm(tokens - 1, generator=g)[: docs - 1].add(1).sort().values.tolist()
    return [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]


def _time_or_none(fn, device) -> tuple[float | None, float | None]:
    """(ms, peak GiB) of ``fn``, or (None, None) where it runs out of GPU memory (transformers' torch Mamba-2
    scan materialises ``[chunks, C, C, H, P]`` products: tens of GiB on a packed row at these widths)."""
    try:
        return time_ms(fn, device), peak_gib(fn, device)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None


def _floor_ms(inputs: int, outputs: int, itemsize: int, device) -> float | None:
    """The HBM floor of a forward + backward: every input read in the forward and again in the backward, the
    output written, its gradient read and every input's gradient written (``3 * inputs + 2 * outputs``
    elements), at the measured copy bandwidth. None off CUDA."""
    gbs = copy_gbs(device)
    return None if gbs is None else (3 * inputs + 2 * outputs) * itemsize / gbs / 1e6


def run(device: torch.device, quick: bool) -> list[Row]:
    try:
        from transformers.models.jamba import modeling_jamba
        from transformers.models.nemotron_h import modeling_nemotron_h
    except ImportError:
        print("ssd bench: transformers is not installed, skipped")
        return []
    gpu = device.type == "cuda"
    sizes = (8192,) if quick or not gpu else (8192, 32768)
    return [
        *_ssd_rows(inspect.unwrap(modeling_nemotron_h.mamba2_chunk_scan), device, sizes if gpu else (128,)),
        *_selective_rows(inspect.unwrap(modeling_jamba.mamba_selective_scan), device, (2048,) if gpu else (64,)),
    ]


def _ssd_rows(stock, device, sizes) -> list[Row]:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    h, p, groups, n = (SSD_HEADS, SSD_HEAD_DIM, SSD_GROUPS, SSD_STATE) if gpu else (4, 8, 2, 8)
    rows = []
    for tokens in sizes:
        lengths = _lengths(tokens, max(2, tokens // 1024))
        info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, tokens, h, p, generator=g)
        dt = torch.randn(1, tokens, h, generator=g)
        A = -torch.rand(h, generator=g) * 4
        B, C = (torch.randn(1, tokens, groups, n, generator=g) * n**-0.5 for _ in range(2))
        D, dt_bias = torch.randn(h, generator=g), torch.randn(h, generator=g) * 0.5
        inputs = [v.to(device, dtype).requires_grad_() for v in (x, dt, A, B, C, D, dt_bias)]
        grad = torch.randn(1, tokens, h, p, generator=g).to(device, dtype)
        chosen = dispatch.backend_for(ssd.OP_SCAN, device)
        kw = dict(dt_softplus=True)

        def ours(backend=chosen):
            x, dt, A, B, C, D, dt_bias = inputs
            return ssd.packed_ssd_scan(
                x, dt, A, B, C, info, D=D, dt_bias=dt_bias, chunk_size=SSD_CHUNK, backend=backend, **kw
            )

        def packed():
            x, dt, A, B, C, D, dt_bias = inputs
            return stock(x, dt, A, B, C, chunk_size=128, D=D, dt_bias=dt_bias, **kw)

        def per_document(values=inputs):
            x, dt, A, B, C, D, dt_bias = values
            outs, start = [], 0
            for m in lengths:
                part = (v[:, start : start + m] for v in (x, dt, B, C))
                xs, dts, Bs, Cs = part
                outs.append(stock(xs, dts, A, Bs, Cs, chunk_size=128, D=D, dt_bias=dt_bias, **kw))
                start += m
            return torch.cat(outs, 1)

        def step(forward):
            return lambda: torch.autograd.grad(forward(), inputs, grad)

        # against transformers' path in fp32 on the same inputs
        with torch.no_grad():
            want = per_document([v.detach().float() for v in inputs])
        torch.testing.assert_close(ours().float(), want, rtol=3e-2, atol=3e-2)
        fast = time_ms(step(ours), device)
        peak = peak_gib(step(ours), device)
        shape = f"T={tokens}, {len(lengths)} docs, {h}x{p}, G={groups}, N={n}, {str(dtype).removeprefix('torch.')}"
        floor = _floor_ms(tokens * (h * p + h + 2 * groups * n), tokens * h * p, dtype.itemsize, device)
        # the chunked algorithm's matmuls at chunk 64: C B^T, its product with x, the chunk states and C @ states
        # (forward; the backward twice that)
        flops = 3 * 2 * tokens * (groups * SSD_CHUNK * n + h * SSD_CHUNK * p + 2 * h * p * n)
        bounds = f"HBM floor {floor:.3f} ms, bf16-peak floor {flops / DENSE_BF16_TFLOPS / 1e9:.3f} ms" if floor else ""
        baselines = [("hf torch chunked, packed (leaks)", packed), ("hf torch chunked, per document", per_document)]
        if chosen == "triton":
            baselines.insert(0, ("fastft, torch loop over chunks", lambda: ours("torch")))
        for label, fn in baselines:
            ms, their_peak = _time_or_none(step(fn), device)
            memory = "" if peak is None else f"peak {their_peak or float('nan'):.2f} GiB vs fastft {peak:.2f} GiB; "
            rows.append(Row("packed_ssd_scan fwd+bwd", shape, label, ms, fast, chosen, memory + bounds))
    return rows


def _selective_rows(stock, device, sizes) -> list[Row]:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    dm, n = (MAMBA_CHANNELS, MAMBA_STATE) if gpu else (16, 4)
    rows = []
    for tokens in sizes:
        lengths = _lengths(tokens, max(2, tokens // 512))
        info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
        g = torch.Generator().manual_seed(0)
        u, delta, z = (torch.randn(1, dm, tokens, generator=g) for _ in range(3))
        A = -(torch.rand(dm, n, generator=g) * 4 + 0.1)
        B, C = (torch.randn(1, n, tokens, generator=g) for _ in range(2))
        D, bias = torch.randn(dm, generator=g), torch.randn(dm, generator=g) * 0.5
        inputs = [v.to(device, dtype).requires_grad_() for v in (u, delta, A, B, C, D, z, bias)]
        grad = torch.randn(1, dm, tokens, generator=g).to(device, dtype)
        chosen = dispatch.backend_for(mamba1.OP, device)

        def ours(backend=chosen):
            u, delta, A, B, C, D, z, bias = inputs
            return mamba1.packed_selective_scan(
                u, delta, A, B, C, info, D=D, z=z, delta_bias=bias, delta_softplus=True, backend=backend
            )

        def packed():
            u, delta, A, B, C, D, z, bias = inputs
            return stock(u, delta, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True)

        def per_document(values=inputs):
            u, delta, A, B, C, D, z, bias = values
            outs, start = [], 0
            for m in lengths:
                us, ds, Bs, Cs, zs = (v[..., start : start + m] for v in (u, delta, B, C, z))
                outs.append(stock(us, ds, A, Bs, Cs, D=D, z=zs, delta_bias=bias, delta_softplus=True))
                start += m
            return torch.cat(outs, -1)

        def step(forward):
            return lambda: torch.autograd.grad(forward(), inputs, grad)

        # against transformers' path in fp32 on the same inputs (in bf16 its state is rounded every token)
        with torch.no_grad():
            want = per_document([v.detach().float() for v in inputs])
        torch.testing.assert_close(ours().float(), want, rtol=3e-2, atol=3e-2)
        fast = time_ms(step(ours), device)
        peak = peak_gib(step(ours), device)
        shape = f"T={tokens}, {len(lengths)} docs, Dm={dm}, N={n}, {str(dtype).removeprefix('torch.')}"
        floor = _floor_ms(tokens * (3 * dm + 2 * n), tokens * dm, dtype.itemsize, device)
        bounds = f"HBM floor {floor:.3f} ms" if floor else ""
        baselines = [
            ("hf torch sequential, packed (leaks)", packed),
            ("hf torch sequential, per document", per_document),
        ]
        if chosen == "triton":
            baselines.insert(0, ("fastft, torch chunk loop", lambda: ours("torch")))
        for label, fn in baselines:
            ms, their_peak = _time_or_none(step(fn), device)
            memory = "" if peak is None else f"peak {their_peak or float('nan'):.2f} GiB vs fastft {peak:.2f} GiB; "
            rows.append(Row("packed_selective_scan fwd+bwd", shape, label, ms, fast, chosen, memory + bounds))
    return rows


def tune_launchers(device: torch.device) -> dict:
    """op -> make(size) -> fn(cfg) that runs the op's kernels once with launch parameters ``cfg``, at the widths
    of the op's ``autotune.Tunable`` sizes: the scan over chunks (Nemotron-H's 128 heads of 64 x 128; size = the
    entering states' elements) forward and backward, and Mamba-1's chunk kernels (Jamba's Dm = 8192, N = 16;
    size = T * Dm) forward and backward."""
    from fastft.delta_rule import chunk_table
    from fastft.kernels import selective_scan as mamba1_kernels
    from fastft.kernels import ssd as ssd_kernels

    def state_inputs(size):
        e = SSD_HEAD_DIM * SSD_STATE
        nc = max(1, size // (SSD_HEADS * e))
        g = torch.Generator().manual_seed(2)
        local = torch.randn(SSD_HEADS, nc, e, generator=g).to(device)
        decay = torch.rand(SSD_HEADS, nc, generator=g).to(device)
        first = (torch.arange(nc) % 16 == 0).to(device)
        return local, decay, first

    def state_forward(size):
        local, decay, first = state_inputs(size)
        return lambda cfg: ssd_kernels.state_scan(local, decay, first, **cfg)

    def state_backward(size):
        local, decay, first = state_inputs(size)
        states = ssd_kernels.state_scan(local, decay, first)
        dstates = torch.randn_like(states)
        return lambda cfg: ssd_kernels.state_scan_backward(decay, first, states, dstates, **cfg)

    def mamba1_inputs(size):
        tokens = max(1, size // MAMBA_CHANNELS)
        g = torch.Generator().manual_seed(3)
        u, delta, dy = (torch.randn(tokens, MAMBA_CHANNELS, generator=g).to(device) for _ in range(3))
        delta = torch.nn.functional.softplus(delta)
        A = -torch.rand(MAMBA_CHANNELS, MAMBA_STATE, generator=g).to(device)
        B, C = (torch.randn(tokens, MAMBA_STATE, generator=g).to(device) for _ in range(2))
        table = chunk_table(fastft.packed_seq_info(seq_lengths=_lengths(tokens, max(1, tokens // 1024)), device=device))
        states, decay = mamba1.chunk_states(u, delta, A, B, table.start, table.length, table.first)
        return u, delta, A, B, C, dy, table, states, decay

    def mamba1_forward(size):
        u, delta, A, B, C, _, table, states, _ = mamba1_inputs(size)

        def run(cfg):
            mamba1_kernels.chunk_ends(u, delta, A, B, table.start, table.length, **cfg)
            mamba1_kernels.chunk_outputs(u, delta, A, B, C, table.start, table.length, states, **cfg)

        return run

    def mamba1_backward(size):
        u, delta, A, B, C, dy, table, states, _ = mamba1_inputs(size)
        dT = torch.randn_like(states)

        def run(cfg):
            block = {"BD": cfg["BD"], "num_warps": cfg["num_warps"], "STAGES": cfg["STAGES"]}
            mamba1_kernels.chunk_start_grads(delta, A, C, dy, table.start, table.length, **block)
            programs = mamba1.backward_programs(device, cfg["PROGRAMS_PER_SM"])
            mamba1_kernels.chunk_grads(
                u, delta, A, B, C, dy, table.start, table.length, states, dT, table.chunk_size, PROGRAMS=programs,
                **block,
            )  # fmt: skip

        return run

    return {
        ssd.OP_SCAN: state_forward,
        ssd.OP_SCAN_BACKWARD: state_backward,
        mamba1.OP: mamba1_forward,
        mamba1.OP_BACKWARD: mamba1_backward,
    }
