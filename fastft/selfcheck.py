"""fastft's self-check: one random case of each op, run on the Triton and the torch backends (or against its
reference) and compared (``CHECKS``: op family -> check); ``python -m fastft check`` and the tests run them.
Users fuzzing their own kernels want ``fastft.testing``; the public entries' argument checks are
``fastft._checks``."""

from __future__ import annotations

import dataclasses

import torch

import fastft

from .testing import (
    assert_same,
    bits,
    differential,
    randint,
    random_position_ids,
    random_seq_lengths,
    random_strided_tensor,
    random_topk_ids,
    seeds_strategy,
)

# ---- packing: one differential case ----------------------------------------------------------------------


BLOCK_MASK_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def packing_outputs(source: dict, *, windows=(None,), block_sizes=(128,), mask_dtypes=(torch.bool,), backend=None):
    """Everything ``packed_seq_info(**source)`` produces, as a dict of tensors/ints (for ``differential``)."""
    info = fastft.packed_seq_info(**source, backend=backend)
    out = {
        name: getattr(info, name)
        for name in ("cu_seqlens", "seq_lengths", "max_seqlen", "num_seqs", "doc_ids", "position_ids")
    }
    for w in windows:
        out[f"varlen_window_size[{w}]"] = info.varlen_kwargs(w)["window_size"]
        for dtype in mask_dtypes:
            out[f"sdpa_mask[{w},{dtype}]"] = info.sdpa_mask(w, dtype)
        if info.num_tokens:
            for bs in block_sizes:
                bm = info.flex_block_mask(w, bs)
                out[f"flex_block_mask[{w},{bs}]"] = {f: getattr(bm, f) for f in BLOCK_MASK_FIELDS}
    return out


def random_packing_case(g: torch.Generator, device, max_tokens: int) -> dict:
    """Keyword arguments for one random ``packing_outputs`` call."""
    tokens = randint(g, 0, max_tokens)
    kind = randint(g, 0, 2)
    if kind == 0:
        rows = None if randint(g, 0, 1) else randint(g, 1, 3)
        dtype = torch.int32 if randint(g, 0, 1) else torch.int64
        pos = random_position_ids(g, rows, tokens, max(1, randint(g, 1, max_tokens // 2)), dtype).to(device)
        source = {"position_ids": pos}
    else:
        lengths = random_seq_lengths(g, tokens, max(1, randint(g, 1, max_tokens // 2)))
        extra = randint(g, 0, 5)
        name = "seq_lengths" if kind == 1 else "cu_seqlens"
        values = lengths if kind == 1 else [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        source = {name: values, "num_tokens": sum(lengths) + extra, "device": device}
    windows = (None, randint(g, -1, 2), randint(g, 1, max_tokens))
    block_sizes = (randint(g, 1, 4) * 16, 2 ** randint(g, 0, 3) if tokens <= 64 else 128)
    return dict(source=source, windows=windows, block_sizes=block_sizes, mask_dtypes=(torch.bool, torch.bfloat16))


def check_packing(g: torch.Generator, device, max_tokens: int) -> None:
    case = random_packing_case(g, device, max_tokens)
    try:
        differential(lambda backend: packing_outputs(**case, backend=backend))
    except AssertionError as e:
        raise AssertionError(f"{e}\ncase: {case}") from None


# ---- routing: one differential case ----------------------------------------------------------------------


def routing_fields(routing) -> dict:
    """A ``MoERouting``'s tensors and ints, without the backend that built it."""
    return {f.name: getattr(routing, f.name) for f in dataclasses.fields(routing) if f.name != "backend"}


def random_routing_case(g: torch.Generator, device, max_tokens: int) -> dict:
    """Keyword arguments of ``routing_outputs``: router ids, routing options and float inputs."""
    tokens = randint(g, 0, max_tokens)
    top_k = randint(g, 1, 8)
    num_experts = [1, 2, 3, 7, 8, 32, 100, 1030][randint(g, 0, 7)]
    ids = random_topk_ids(
        g,
        tokens,
        top_k,
        num_experts,
        unrouted=[0.0, 0.1, 0.9][randint(g, 0, 2)],
        dtype=torch.int32 if randint(g, 0, 1) else torch.int64,
        strided=bool(randint(g, 0, 1)),
    ).to(device)
    options = {"num_experts": num_experts, "block_size": [1, 1, 2, 16, 128][randint(g, 0, 4)]}
    if randint(g, 0, 2) == 0:
        local = randint(g, 1, num_experts)
        mapping = torch.full((num_experts,), -1, dtype=torch.int32)
        mapping[torch.randperm(num_experts, generator=g)[:local]] = torch.randperm(local, generator=g).int()
        options.update(expert_map=mapping.to(device), num_local_experts=local)
    local = options.get("num_local_experts", num_experts)
    dtype = torch.float32 if randint(g, 0, 1) else torch.bfloat16
    hidden = randint(g, 1, 48)
    data = torch.Generator().manual_seed(randint(g, 0, 2**62))
    rand = lambda *shape: torch.randn(*shape, generator=data).to(device, dtype)  # noqa: E731
    return dict(
        topk_ids=ids,
        options=options,
        x=rand(tokens, hidden),
        weights=rand(tokens, top_k),
        table=rand(local, randint(g, 1, 40)),
        seed=randint(g, 0, 2**62),
    )


def routing_outputs(topk_ids, options, x, weights, table, seed, *, backend=None) -> tuple[dict, dict]:
    """(exact, approximate) results of every routing op and its backward on one case.

    Exact: the routing, permute, unpermute (fixed fp32 order), and the gradients of x, ys and the
    unweighted combine. Approximate (summation order differs): dweights and the expert table's gradient."""
    r = fastft.moe_route(topk_ids, backend=backend, **options)
    data = torch.Generator().manual_seed(seed)
    ys = torch.randn(r.capacity, x.shape[1], generator=data).to(x.device, x.dtype)
    dy = torch.randn(x.shape, generator=data).to(x.device, x.dtype)
    drows = torch.randn(r.capacity, table.shape[1], generator=data).to(x.device, x.dtype)
    x, ys, weights, table = (t.detach().requires_grad_() for t in (x, ys, weights, table))
    xs = fastft.moe_permute(x, r, backend=backend)
    y = fastft.moe_unpermute(ys, r, weights, backend=backend)
    y_plain = fastft.moe_unpermute(ys, r, backend=backend)
    rows = fastft.moe_expert_rows(table, r, backend=backend)
    (dx,) = torch.autograd.grad(xs, x, ys)
    dys, dweights = torch.autograd.grad(y, (ys, weights), dy)
    (dys_plain,) = torch.autograd.grad(y_plain, ys, dy)
    (dtable,) = torch.autograd.grad(rows, table, drows)
    exact = {
        **routing_fields(r),
        "permute": xs,
        "unpermute": y,
        "unpermute_unweighted": y_plain,
        "expert_rows": rows,
        "dx": dx,
        "dys": dys,
        "dys_unweighted": dys_plain,
    }
    return exact, {"dweights": dweights, "dtable": dtable}


def check_routing_case(case: dict) -> None:
    """Triton vs torch on one ``random_routing_case``: integers and fixed-order sums exactly, the rest
    within fp32 (1e-4) or bf16 (2e-2) tolerance plus 4 fp32 ulps per summed term. Triton's CPU interpreter
    truncates fp32 -> bf16 where a GPU rounds to nearest even, so there bf16 results of fp32 sums may differ
    by one bf16 ulp."""
    try:
        got, expected = (routing_outputs(**case, backend=b) for b in ("triton", "torch"))
        bf16 = case["x"].dtype == torch.bfloat16
        ulp = 2.0**-7 if bf16 and case["x"].device.type == "cpu" else 0.0
        assert_same(got[0], expected[0], rtol=ulp, path="triton vs torch")
        # fp32 sums of up to T*K terms in another order: the error grows with the number of terms.
        tol = (2e-2 if bf16 else 1e-4) + 4 * 2.0**-23 * case["topk_ids"].numel()
        assert_same(got[1], expected[1], atol=tol, rtol=tol, path="triton vs torch")
    except AssertionError as e:
        shown = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        raise AssertionError(f"{e}\ncase: {shown}") from None


def check_routing(g: torch.Generator, device, max_tokens: int) -> None:
    check_routing_case(random_routing_case(g, device, max_tokens))


def routing_case_strategy(max_tokens: int = 96, device="cpu"):
    """Cases for ``check_routing_case`` (see ``random_routing_case``), drawn from a hypothesis seed."""
    return seeds_strategy().map(
        lambda seed: random_routing_case(torch.Generator().manual_seed(seed), device, max_tokens)
    )


# ---- copy (pack / unpack) ------------------------------------------------------------------------------------


def random_copy_case(g: torch.Generator, device, max_numel: int) -> list[torch.Tensor]:
    """0-4 tensors from ``random_strided_tensor``, for ``check_copy_case``."""
    return [random_strided_tensor(g, device, max_numel) for _ in range(randint(g, 0, 4))]


def check_copy_case(tensors, *, backend=None) -> None:
    """``fastft.copy.pack``/``unpack`` on ``backend`` (default: the dispatched one) against the torch
    reference: packed bytes equal per entry, unpack returns the inputs bit for bit with their strides where
    they do not overlap, and unpacking into outputs of other strides works too."""
    from fastft import copy

    buf, layout = copy.pack(tensors, backend=backend)
    ref, ref_layout = copy.pack(tensors, backend="torch")
    assert layout == ref_layout
    for i, e in enumerate(layout.entries):
        assert_same(buf[e.offset : e.offset + e.nbytes], ref[e.offset : e.offset + e.nbytes], path=f"pack entry {i}")
    outs = copy.unpack(buf, layout, backend=backend)
    for i, (t, o) in enumerate(zip(tensors, outs)):
        assert_same(bits(o), bits(t), path=f"unpack[{i}]")
        if copy.non_overlapping(t.shape, t.stride()):
            assert o.stride() == t.stride() or o.numel() <= 1, f"unpack[{i}] strides {o.stride()} != {t.stride()}"
    into = [
        torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).permute(list(range(t.dim()))[::-1]) for t in tensors
    ]
    outs = copy.unpack(buf, layout, out=into, backend=backend)
    for i, (t, o) in enumerate(zip(tensors, outs)):
        assert o is into[i]
        assert_same(bits(o), bits(t), path=f"unpack(out=)[{i}]")


def check_copy(g: torch.Generator, device, max_tokens: int) -> None:
    check_copy_case(random_copy_case(g, device, max_tokens * 16))


# ---- lora ----------------------------------------------------------------------------------------------


def random_lora_case(g: torch.Generator, device, dtype, bias: bool = True) -> tuple:
    """Arguments of ``fastft.lora.lora_linear`` of random sizes: ``x`` ``[2, n, in]`` of ``dtype`` (requires
    grad), frozen ``weight``/``bias`` of ``dtype``, fp32 ``lora_a``/``lora_b`` (require grad), a scaling."""
    n, fan_in, fan_out, rank = (
        int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((1, 40), (1, 70), (1, 70), (1, 17))
    )
    x = torch.randn(2, n, fan_in, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(fan_out, fan_in, generator=g) / fan_in**0.5).to(device, dtype)
    b = torch.randn(fan_out, generator=g).to(device, dtype) if bias else None
    lora_a = (torch.randn(rank, fan_in, generator=g) / fan_in**0.5).to(device).requires_grad_()
    lora_b = torch.randn(fan_out, rank, generator=g).to(device).requires_grad_()
    return x, weight, b, lora_a, lora_b, float(torch.rand((), generator=g)) * 4


def check_lora_case(x, weight, bias, lora_a, lora_b, scaling, grad) -> None:
    """``fastft.lora.lora_linear`` against ``fastft.reference.lora``: the output and the gradients of ``x``,
    ``lora_a``, ``lora_b`` for the output gradient ``grad``; within 1e-5 of the largest value (or of 1) for
    fp32 ``x``, else within 1% (the adapter path runs in ``x``'s dtype, the reference's in the adapters')."""
    from fastft.lora import lora_linear
    from fastft.reference import lora as ref

    results = []
    for fn in (lora_linear, ref.lora_linear):
        for t in (x, lora_a, lora_b):
            t.grad = None
        y = fn(x, weight, bias, lora_a, lora_b, scaling)
        y.backward(grad)
        results.append((y.detach(), x.grad, lora_a.grad, lora_b.grad))
    assert (
        results[0][0].dtype == x.dtype and results[0][2].dtype == lora_a.dtype and results[0][3].dtype == lora_b.dtype
    )
    for name, got, want in zip(("out", "dx", "d lora_a", "d lora_b"), *results):
        scale = max(1.0, float(want.abs().max()))  # products are summed in another order: error scales with the values
        tol = dict(atol=1e-5 * scale, rtol=1e-5) if x.dtype == torch.float32 else dict(atol=1e-2 * scale, rtol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m, name=name: f"{name}: {m}")


def check_lora(g: torch.Generator, device, max_tokens: int) -> None:
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = random_lora_case(g, device, dtype, bias=bool(torch.randint(2, (), generator=g)))
    grad = torch.randn(args[0].shape[:-1] + (args[1].shape[0],), generator=g).to(device, dtype)
    check_lora_case(*args, grad)


# ---- packed attention ------------------------------------------------------------------------------------


def random_attention_case(g: torch.Generator, device, max_tokens: int) -> dict:
    """A packed batch for ``packed_attention``: q, k, v ``[B, T, H(_kv), D]``, position ids, window, sinks."""
    rows, kv_heads, groups = randint(g, 1, 3), randint(g, 1, 3), randint(g, 1, 4)
    pos = random_position_ids(g, rows, max(1, max_tokens // rows), max(1, max_tokens // 4))
    t = pos.shape[-1]
    dim = 8 * randint(g, 1, 9)
    q = torch.randn(rows, t, kv_heads * groups, dim, generator=g)
    k, v = torch.randn(2, rows, t, kv_heads, dim, generator=g)
    sinks = torch.randn(kv_heads * groups, generator=g) if randint(g, 0, 2) else None
    window = randint(g, 1, 2 * t + 2) if randint(g, 0, 2) else None
    return dict(
        q=q.to(device),
        k=k.to(device),
        v=v.to(device),
        position_ids=pos.to(device),
        window=window,
        sinks=None if sinks is None else sinks.to(device),
    )


def check_attention_case(case: dict) -> None:
    """``packed_attention`` (forward and gradients; bf16 flash on a GPU, fp32 dense on a CPU) against
    ``fastft/reference/attention.py`` in fp32."""
    from fastft.reference import attention as reference

    info = fastft.packed_seq_info(position_ids=case["position_ids"])
    inputs = [case[n] for n in ("q", "k", "v", "sinks")]
    gpu = inputs[0].is_cuda
    grad = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(0)).to(inputs[0].device)

    def run(fn, dtype):
        leaves = [None if x is None else x.detach().to(dtype).requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        return [out.detach().float()] + [None if x is None else x.grad.float() for x in leaves]

    window = case["window"]
    got = run(
        lambda q, k, v, s: fastft.packed_attention(q, k, v, info, window=window, sinks=s),
        torch.bfloat16 if gpu else torch.float32,
    )
    want = run(
        lambda q, k, v, s: reference.packed_attention(q, k, v, info.doc_ids, window or 0, s, q.shape[-1] ** -0.5),
        torch.float32,
    )
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        if b is not None:
            scale = float(b.abs().max()) if b.numel() else 0.0
            assert_same(a, b, atol=(3e-2 * scale) if gpu else 1e-4, rtol=3e-2 if gpu else 1e-4, path=name)


def check_attention(g: torch.Generator, device, max_tokens: int) -> None:
    check_attention_case(random_attention_case(g, device, min(max_tokens, 512)))


# op name -> fn(generator, device, max_tokens): one random differential case (``python -m fastft check``);
# lora (no Triton kernel) checks its op against its reference
def check_conv(g: torch.Generator, device, max_tokens: int) -> None:
    """``packed_conv1d`` on the dispatched backend against ``fastft.reference.conv`` (each document through
    ``F.conv1d`` alone): the output and x's gradient fp32 within 1e-5; weight's and bias's gradients, sums of a
    product per token taken in another order than the reference's, within twice the reference's own error
    against fp64 plus 1e-5 of their largest value."""
    from fastft.reference import conv as reference

    n, c, w = randint(g, 1, max_tokens), randint(g, 1, 40), randint(g, 1, fastft.conv.MAX_WIDTH)
    info = fastft.packed_seq_info(
        seq_lengths=random_seq_lengths(g, n, randint(g, 1, 2 * w + 2)), num_tokens=n, device=device
    )
    x = torch.randn(n, c, generator=g).to(device).requires_grad_()
    weight = torch.randn(c, w, generator=g).to(device).requires_grad_()
    bias = torch.randn(c, generator=g).to(device).requires_grad_() if randint(g, 0, 1) else None
    activation = "silu" if randint(g, 0, 1) else None
    grad = torch.randn(n, c, generator=g).to(device)
    leaves = [x, weight] + ([bias] if bias is not None else [])
    out = fastft.packed_conv1d(x, weight, info, bias=bias, activation=activation)
    expected = reference.packed_conv1d(x, weight, bias, info.cu_seqlens, activation is not None)
    got = (out, *torch.autograd.grad(out, leaves, grad))
    want = (expected, *torch.autograd.grad(expected, leaves, grad))
    for name, a, b in zip(("out", "dx"), got, want):
        assert_same(a, b, atol=1e-5, rtol=1e-5, path=f"packed_conv1d {name} (W={w}, {activation})")
    fp64 = [t.detach().double().requires_grad_() for t in leaves]
    fp64_bias = fp64[2] if bias is not None else None
    exact_out = reference.packed_conv1d(*fp64[:2], fp64_bias, info.cu_seqlens, activation is not None)
    exact = torch.autograd.grad(exact_out, fp64, grad.double())
    for name, a, b, e in zip(("dweight", "dbias"), got[2:], want[2:], exact[1:]):
        err, own = (a.double() - e).abs().max().item(), (b.double() - e).abs().max().item()
        bound = 2 * own + 1e-5 * (1 + e.abs().max().item())
        if not err <= bound:
            raise AssertionError(
                f"packed_conv1d {name} (W={w}, {activation}): {err:.3g} from fp64 > {bound:.3g} (twice the "
                f"reference's {own:.3g}, plus 1e-5 of the largest value)"
            )


def check_rms_norm(g: torch.Generator, device, max_tokens: int) -> None:
    """``fastft.rms_norm`` on the dispatched backend against ``fastft.reference.rms_norm`` on random rows,
    widths, offsets, eps, gates (none, after the norm, before it; SiLU or sigmoid) and groups: the output and x's
    and the gate's gradients fp32 within 1e-5; the weight's (a sum over the rows) within 1e-4 of its largest
    value."""
    from fastft.reference import rms_norm as reference

    # Groups (and rows) of at least 2 channels: one channel normalises to +-1 and its gradient is a cancellation
    # of terms of size 1/|x|, which two fp32 paths round differently by more than a fixed bound (the unit tests
    # check that case with a bound that counts those terms).
    rows, group_size, groups = randint(g, 1, max_tokens), randint(g, 2, 300), randint(g, 1, 4)
    width = group_size * groups
    x = (torch.randn(rows, width, generator=g) * 2).to(device).requires_grad_()
    w = torch.randn(width, generator=g).to(device).requires_grad_()
    kw = dict(eps=(1e-6, 1e-5, 0.0)[randint(g, 0, 2)], offset=(0.0, 1.0)[randint(g, 0, 1)])
    if groups > 1:
        kw.update(group_size=group_size)
    gated = randint(g, 0, 2)
    z = (torch.randn(rows, width, generator=g) * 2).to(device).requires_grad_()
    if gated:
        kw.update(gate=z, gate_first=gated == 2, gate_activation=("silu", "sigmoid")[randint(g, 0, 1)])
    grad = torch.randn(rows, width, generator=g).to(device)
    out = fastft.rms_norm(x, w, **kw)
    expected = reference.rms_norm(x, w, **kw)
    leaves = (x, w, z) if gated else (x, w)
    got = (out, *torch.autograd.grad(out, leaves, grad))
    want = (expected, *torch.autograd.grad(expected, leaves, grad))
    kw.pop("gate", None)
    for name, a, b in zip(("out", "dx", "", "dgate"), got, want):
        if name:
            assert_same(a, b, atol=1e-5, rtol=1e-5, path=f"rms_norm {name} ({rows} x {width}, {kw})")
    scale = max(1.0, want[2].abs().max().item())
    assert_same(got[2], want[2], atol=1e-4 * scale, rtol=1e-5, path=f"rms_norm dweight ({rows} x {width}, {kw})")


def check_rotary(g: torch.Generator, device, max_tokens: int) -> None:
    """``fastft.rotary`` on the dispatched backend against ``fastft.reference.rotary`` on random batches, heads,
    tokens, head and rotary widths and pairings (halves, interleaved), with ``q`` and ``k`` as transposed views
    (transformers' layout): both outputs and gradients, fp32 within 1e-5."""
    from fastft.reference import rotary as reference

    batch, tokens = randint(g, 1, 2), randint(g, 1, max(1, max_tokens // 2))
    heads_q, heads_k, width = randint(g, 1, 6), randint(g, 1, 3), 2 * randint(g, 1, 40)
    r = 2 * randint(g, 1, width // 2)
    q = torch.randn(batch, tokens, heads_q, width, generator=g).to(device).transpose(1, 2).requires_grad_()
    k = torch.randn(batch, tokens, heads_k, width, generator=g).to(device).transpose(1, 2).requires_grad_()
    angles = torch.randn((batch, 1)[randint(g, 0, 1)], tokens, r, generator=g).to(device)
    cos, sin = angles.cos(), angles.sin()
    grads = [torch.randn(t.shape, generator=g).to(device) for t in (q, k)]
    interleaved = bool(randint(g, 0, 1))
    out = fastft.rotary(q, k, cos, sin, interleaved=interleaved)
    expected = reference.rotary(q, k, cos, sin, interleaved)
    got = (*out, *torch.autograd.grad(out, (q, k), grads))
    want = (*expected, *torch.autograd.grad(expected, (q, k), grads))
    case = f"({tuple(q.shape)}, k {tuple(k.shape)}, R={r}, interleaved={interleaved})"
    for name, a, b in zip(("q", "k", "dq", "dk"), got, want):
        assert_same(a, b, atol=1e-5, rtol=1e-5, path=f"rotary {name} {case}")


def check_swiglu(g: torch.Generator, device, max_tokens: int) -> None:
    """``fastft.swiglu`` on the dispatched backend against ``fastft.reference.swiglu`` on random rows, widths,
    layouts (the gate and up fused, interleaved or apart), activations (SiLU, GELU's tanh form) and constants
    (gpt-oss's clamped gate among them): the output and its gradients, fp32 within 1e-5."""
    from fastft.reference import swiglu as reference

    rows, width = randint(g, 0, max_tokens), randint(g, 1, 48)
    layout = ("side by side", "interleaved", "apart")[randint(g, 0, 2)]
    kw = dict(
        alpha=(1.0, 1.702)[randint(g, 0, 1)],
        limit=(None, 7.0, 0.5)[randint(g, 0, 2)],
        up_shift=float(randint(g, 0, 1)),
        activation=("silu", "gelu_tanh")[randint(g, 0, 1)],
    )
    if kw["activation"] == "gelu_tanh":
        kw["alpha"] = 1.0
    if layout == "apart":
        inputs = [(torch.randn(rows, width, generator=g) * 4).to(device).requires_grad_() for _ in range(2)]
    else:
        kw["interleaved"] = layout == "interleaved"
        inputs = [(torch.randn(rows, 2 * width, generator=g) * 4).to(device).requires_grad_()]
    grad = torch.randn(rows, width, generator=g).to(device)
    out = fastft.swiglu(*inputs, **kw)
    expected = reference.swiglu(*inputs, **kw)
    got = (out, *torch.autograd.grad(out, inputs, grad))
    want = (expected, *torch.autograd.grad(expected, inputs, grad))
    for name, a, b in zip(("out", "dgate", "dup") if layout == "apart" else ("out", "dgate_up"), got, want):
        assert_same(a, b, atol=1e-5, rtol=1e-5, path=f"swiglu {name} ({rows} x {width}, {layout}, {kw})")


def check_linear_cross_entropy(g: torch.Generator, device, max_tokens: int) -> None:
    """``fastft.linear_cross_entropy`` on the dispatched backend against ``fastft.reference.linear_cross_entropy``
    on random rows, widths, vocabularies, blocks, logit scales, soft caps and ignored labels: the loss and the hidden
    states', head's and bias's gradients, fp32 within 1e-4."""
    from fastft.reference import linear_cross_entropy as reference

    rows, width, vocab = randint(g, 1, max_tokens), randint(g, 1, 48), randint(g, 1, 300)
    h = (torch.randn(rows, width, generator=g) * 2).to(device).requires_grad_()
    w = torch.randn(vocab, width, generator=g).to(device).requires_grad_()
    b = torch.randn(vocab, generator=g).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[torch.rand(rows, generator=g) < 0.2] = -100
    labels[0] = 0  # one labelled row at least: the mean is a number
    labels = labels.to(device)
    kw = dict(
        reduction=("mean", "sum")[randint(g, 0, 1)],
        logit_scale=(None, 0.5, 1 / 3)[randint(g, 0, 2)],
        softcap=(None, 3.0)[randint(g, 0, 1)],
    )
    block = (None, randint(g, 1, 64))[randint(g, 0, 1)]
    got = fastft.linear_cross_entropy(h, w, labels, b, block_size=block, **kw)
    want = reference.linear_cross_entropy(h, w, labels, b, **kw)
    outs = [(x, *torch.autograd.grad(x, (h, w, b))) for x in (got, want)]
    for name, a, e in zip(("loss", "dhidden", "dweight", "dbias"), *outs):
        path = f"linear_cross_entropy {name} ({rows} x {width} -> {vocab}, block {block}, {kw})"
        assert_same(a, e, atol=1e-4, rtol=1e-4, path=path)


def check_experts(g: torch.Generator, device, max_tokens: int) -> None:
    """``fastft.experts``: ``grouped_lowrank_add`` on the dispatched backend against its reference on random
    rows, widths, ranks and expert row ranges (empty experts, rows past the last end); and ``routed_experts``
    with LoRA on both projections against ``fastft.reference.experts`` on a random routing (a few tokens: the
    reference loops over pairs), the output and every gradient. fp32 within 1e-5 / 1e-4."""
    from fastft import experts
    from fastft.reference import experts as reference

    rows, cols, rank, num_experts = randint(g, 1, max_tokens), randint(g, 1, 64), randint(g, 1, 24), randint(g, 1, 12)
    y = torch.randn(rows, cols, generator=g).to(device)
    u = torch.randn(rows, rank, generator=g).to(device)
    v = torch.randn(num_experts, rank, cols, generator=g).to(device)
    ends = torch.randint(0, rows + 1, (num_experts,), generator=g).sort().values.to(device, torch.int32)
    got = experts.grouped_lowrank_add(y, u, v, ends, 0.5)
    want = reference.grouped_lowrank_add(y, u, v, ends, 0.5)
    assert_same(
        got, want, atol=1e-5, rtol=1e-4, path=f"grouped_lowrank_add ({rows} x {cols}, r={rank}, E={num_experts})"
    )

    tokens, top_k, hidden, inter = randint(g, 1, 16), randint(g, 1, 3), randint(g, 1, 12), randint(g, 1, 10)
    num_experts = randint(g, 1, 6)
    leaves = dict(  # unit-variance activations: each matrix scaled by its fan-in
        x=torch.randn(tokens, hidden, generator=g),
        weights=torch.rand(tokens, top_k, generator=g),
        up=torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5,
        down=torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5,
        up_a=torch.randn(num_experts, rank, hidden, generator=g) / hidden**0.5,
        up_b=torch.randn(num_experts, 2 * inter, rank, generator=g) / rank**0.5,
        down_a=torch.randn(num_experts, rank, inter, generator=g) / inter**0.5,
        down_b=torch.randn(num_experts, hidden, rank, generator=g) / rank**0.5,
    )
    leaves = {n: t.to(device).requires_grad_(n not in ("up", "down")) for n, t in leaves.items()}
    ids = torch.randint(-1, num_experts + 1, (tokens, top_k), generator=g).to(device)
    grad = torch.randn(tokens, hidden, generator=g).to(device)

    def gate(h):
        gate_, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate_) * up

    outs = []
    for impl in (experts, reference):
        out = impl.routed_experts(
            leaves["x"],
            ids,
            leaves["weights"],
            leaves["up"],
            leaves["down"],
            transposed=False,
            activation=gate,
            up_lora=experts.ExpertLoRA(leaves["up_a"], leaves["up_b"], 0.75),
            down_lora=experts.ExpertLoRA(leaves["down_a"], leaves["down_b"], 0.75),
        )
        trained = [t for t in leaves.values() if t.requires_grad]
        # no routed pair: the reference's output is a constant (every gradient zero)
        grads = (
            torch.autograd.grad(out, trained, grad, allow_unused=True) if out.requires_grad else [None] * len(trained)
        )
        outs.append([out] + [torch.zeros_like(t) if d is None else d for t, d in zip(trained, grads)])
    names = ["out"] + [f"d{n}" for n, t in leaves.items() if t.requires_grad]
    for name, a, b in zip(names, *outs):
        assert_same(a, b, atol=1e-5, rtol=1e-4, path=f"routed_experts with LoRA {name} (T={tokens}, E={num_experts})")


CHECKS = {
    "packing": check_packing,
    "routing": check_routing,
    "attention": check_attention,
    "copy": check_copy,
    "lora": check_lora,
    "conv": check_conv,
    "swiglu": check_swiglu,
    "rms_norm": check_rms_norm,
    "rotary": check_rotary,
    "linear_cross_entropy": check_linear_cross_entropy,
    "experts": check_experts,
}
