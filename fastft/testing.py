"""Differential testing: run the Triton and torch backends on the same inputs and report the first mismatch.

Public so users can fuzz their own kernels the way fastft's property tests and ``python -m fastft check`` do:

    from fastft.testing import assert_same, differential
    differential(lambda backend: my_op(x, backend=backend))      # triton vs torch, exact
    assert_same(mine, reference, atol=1e-2, rtol=1e-2)           # any nesting of tensors/ints/lists/dicts

Random inputs come from a ``torch.Generator`` (``random_*``) or, for hypothesis, from the ``*_strategy``
functions (hypothesis is imported only when one is called).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

import fastft

# ---- comparison ------------------------------------------------------------------------------------------


def _first_mismatch(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float):
    if a.is_floating_point() or b.is_floating_point():
        same = torch.isclose(a.double(), b.double(), atol=atol, rtol=rtol, equal_nan=False)
    else:
        same = a == b
    if bool(same.all()):
        return None
    index = tuple(int(i) for i in torch.nonzero(~same)[0])
    return index, a[index].item(), b[index].item(), int((~same).sum())


def assert_same(actual, expected, *, atol: float = 0.0, rtol: float = 0.0, path: str = "output") -> None:
    """Raise ``AssertionError`` naming the first differing element of two nested results.

    Tensors must agree in shape and dtype, integers and bools exactly, floats within ``atol + rtol*|expected|``
    (NaN never matches). Lists, tuples, dicts and dataclasses are compared field by field.
    """
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{path}: expected a tensor, got {type(actual).__name__}")
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            raise AssertionError(
                f"{path}: shape/dtype {tuple(actual.shape)}/{actual.dtype} != {tuple(expected.shape)}/{expected.dtype}"
            )
        bad = _first_mismatch(actual.detach().cpu(), expected.detach().cpu(), atol, rtol)
        if bad is not None:
            index, x, y, count = bad
            raise AssertionError(f"{path}[{', '.join(map(str, index))}]: {x} != {y} ({count} elements differ)")
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same(
                getattr(actual, f.name), getattr(expected, f.name), atol=atol, rtol=rtol, path=f"{path}.{f.name}"
            )
    elif isinstance(expected, dict):
        if set(actual) != set(expected):
            raise AssertionError(f"{path}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}")
        for k in expected:
            assert_same(actual[k], expected[k], atol=atol, rtol=rtol, path=f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise AssertionError(f"{path}: length {len(actual)} != {len(expected)}")
        for i, (x, y) in enumerate(zip(actual, expected)):
            assert_same(x, y, atol=atol, rtol=rtol, path=f"{path}[{i}]")
    elif isinstance(expected, float) and not (math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol)):
        raise AssertionError(f"{path}: {actual} != {expected}")
    elif actual != expected:
        raise AssertionError(f"{path}: {actual!r} != {expected!r}")


def differential(fn, *, backends=("triton", "torch"), atol: float = 0.0, rtol: float = 0.0):
    """Run ``fn(backend=...)`` for each backend; assert every result equals the last one (the reference)."""
    results = {b: fn(backend=b) for b in backends}
    expected = results[backends[-1]]
    for b in backends[:-1]:
        assert_same(results[b], expected, atol=atol, rtol=rtol, path=f"{b} vs {backends[-1]}")
    return expected


# ---- random inputs ---------------------------------------------------------------------------------------


def randint(g: torch.Generator, low: int, high: int) -> int:
    """Uniform int in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def random_seq_lengths(g: torch.Generator, num_tokens: int, max_len: int, zero_prob: float = 0.1) -> list[int]:
    """Lengths in [1, max_len] (some 0) that sum to at most ``num_tokens``."""
    lengths, total = [], 0
    while True:
        n = 0 if torch.rand((), generator=g) < zero_prob else randint(g, 1, max_len)
        if total + n > num_tokens:
            return lengths
        lengths.append(n)
        total += n


def random_position_ids(
    g: torch.Generator, rows: int | None, tokens: int, max_doc_len: int, dtype=torch.int64
) -> torch.Tensor:
    """``[tokens]`` (rows=None) or ``[rows, tokens]`` position ids: documents of random lengths, most
    starting at 0, some at another offset (a continued document) or as runs of equal ids (padding)."""
    out = []
    for _ in range(rows or 1):
        row: list[int] = []
        while len(row) < tokens:
            length = randint(g, 1, max_doc_len)
            kind = randint(g, 0, 9)
            if kind == 0:
                row += [0] * length  # padding: every token is its own document
            else:
                first = 0 if kind > 2 else randint(g, 1, 1000)
                row += range(first, first + length)
        out.append(row[:tokens])
    t = torch.tensor(out, dtype=dtype).reshape(rows or 1, tokens)
    return t if rows is not None else t[0]


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


def random_topk_ids(
    g: torch.Generator,
    tokens: int,
    top_k: int,
    num_experts: int,
    *,
    unrouted: float = 0.1,
    dtype=torch.int64,
    strided: bool = False,
) -> torch.Tensor:
    """``[tokens, top_k]`` router ids: a few hot experts, duplicates within a row, and a fraction
    ``unrouted`` of out-of-range ids (-1, -7, num_experts, num_experts + 5). ``strided``: not contiguous."""
    hot = torch.randint(0, num_experts, (max(1, num_experts // 8),), generator=g)
    uniform = torch.randint(0, num_experts, (tokens, top_k), generator=g)
    skewed = hot[torch.randint(0, hot.numel(), (tokens, top_k), generator=g)]
    ids = torch.where(torch.rand(tokens, top_k, generator=g) < 0.5, skewed, uniform)
    bad = torch.tensor([-1, -7, num_experts, num_experts + 5])[torch.randint(0, 4, (tokens, top_k), generator=g)]
    ids = torch.where(torch.rand(tokens, top_k, generator=g) < unrouted, bad, ids).to(dtype)
    if strided:
        return torch.stack([ids, -ids], dim=-1)[..., 0]  # strides (2 * top_k, 2)
    return ids


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


# ---- copy (pack / unpack) ------------------------------------------------------------------------------------

COPY_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as same-width integers: compares every dtype bit for bit (NaN payloads included)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def random_strided_tensor(g: torch.Generator, device, max_numel: int, dtype=None) -> torch.Tensor:
    """A random view: rank 0-5, any of ``COPY_DTYPES``, random bits (floats include NaN/inf patterns),
    then permuted, sliced with steps and offsets, or expanded along a size-1 dimension."""
    dtype = dtype or COPY_DTYPES[randint(g, 0, len(COPY_DTYPES) - 1)]
    rank = randint(g, 0, 5)
    budget = max(1, max_numel)
    shape = []
    for _ in range(rank):
        shape.append(randint(g, 0 if randint(g, 0, 9) == 0 else 1, max(1, min(6, budget))))
        budget = max(1, budget // max(1, shape[-1]))
    steps = [randint(g, 1, 2) for _ in shape]
    base_shape = [z * st + randint(g, 0, 1) for z, st in zip(shape, steps)]
    if dtype == torch.bool:
        base = torch.randint(0, 2, base_shape, generator=g).bool()
    else:
        nbytes = math.prod(base_shape) * torch.empty((), dtype=dtype).element_size()
        base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(base_shape)
    index = []
    for z, st, b in zip(shape, steps, base_shape):
        start = randint(g, 0, b - (z - 1) * st - 1) if z else 0
        index.append(slice(start, start + (z - 1) * st + 1 if z else start, st))
    t = base.to(device)[tuple(index)]
    if rank > 1 and randint(g, 0, 1):
        t = t.permute(*torch.randperm(rank, generator=g).tolist())
    ones = [i for i, z in enumerate(t.shape) if z == 1]
    if ones and randint(g, 0, 3) == 0:
        shape = list(t.shape)
        shape[ones[0]] = randint(g, 2, 4)
        t = t.expand(shape)
    return t


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


# op name -> fn(generator, device, max_tokens): one random differential case (``python -m fastft check``);
# lora (no Triton kernel) checks its op against its reference
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


# ---- shared inputs of tests and benchmarks --------------------------------------------------------------


def packed_position_ids(num_tokens: int, num_docs: int, device, rows: int | None = None) -> torch.Tensor:
    """Position ids of ``num_docs`` documents of random lengths (fixed seed) filling ``num_tokens``; ``[T]``,
    or the same row repeated ``[rows, T]``."""
    g = torch.Generator().manual_seed(num_tokens * 31 + num_docs)
    cuts = torch.randperm(num_tokens - 1, generator=g)[: num_docs - 1].add(1).sort().values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([num_tokens])])
    pos = torch.arange(num_tokens) - torch.repeat_interleave(cu[:-1], cu.diff())
    return pos.to(device) if rows is None else pos.expand(rows, -1).contiguous().to(device)


# MoE shapes: name -> (experts, top-k, hidden size)
MOE_SHAPES = {
    "gpt-oss-20b": (32, 4, 2880),
    "gpt-oss-120b": (128, 4, 2880),
    "Qwen3-30B-A3B": (128, 8, 2048),
    "DeepSeek-V3": (256, 8, 7168),
}


def router_ids(tokens: int, experts: int, top_k: int, device, seed: int = 0) -> torch.Tensor:
    """Top-k of random router logits: K distinct experts per token, as a real router gives."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(tokens, experts, generator=g, device=device).topk(top_k, dim=1).indices


def exit_spawned_worker() -> None:
    """End a ``torch.multiprocessing.spawn`` worker whose work is done and whose process group is destroyed:
    gloo's threads now and then abort the interpreter's teardown ("terminate called without an active
    exception"; torch 2.13 CPU, plain DDP on an ``nn.Linear`` too), which ``spawn`` reports as a failure."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def no_host_sync():
    """Inside it, any CUDA call that makes the host wait for the GPU raises (``set_sync_debug_mode("error")``);
    pending work is synchronized first. Without CUDA it only runs the body."""
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


# transformers models: name -> (config class, config fields, decoder layers kept on a GPU). The e2e benchmark
# and the real-size GPU tests build them with random weights.
MODEL_CONFIGS = {
    "Llama-3.2-1B": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
        ),
        16,
    ),
    "Qwen3-0.6B": (
        "Qwen3Config",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        28,
    ),
    "Qwen3-8B": (
        "Qwen3Config",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
        ),
        8,
    ),
    "Qwen3-30B-A3B": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            intermediate_size=6144,
            num_experts=128,
            num_experts_per_tok=8,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            decoder_sparse_step=1,
        ),
        4,
    ),
    "gpt-oss-20b": (
        "GptOssConfig",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=201088,
            sliding_window=128,
        ),
        4,
    ),
}


def sft_lengths(total: int, seed: int = 0, median: int = 380, max_len: int = 4096) -> list[int]:
    """Document lengths, log-normal around ``median`` (sigma 1, as chat SFT sets are), summing to ``total``."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        n = int(math.exp(math.log(median) + torch.randn((), generator=g).item()))
        lengths.append(max(16, min(max_len, n)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


_TINY_FAMILIES = {
    "llama": ("LlamaConfig", dict(intermediate_size=64)),
    "qwen3": (
        "Qwen3Config",
        dict(
            intermediate_size=64,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=6,
            use_sliding_window=True,
            max_window_layers=0,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            moe_intermediate_size=32,
            intermediate_size=64,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            intermediate_size=32,
            num_local_experts=5,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=6,
        ),
    ),
}


def tiny_hf_model(family: str, dtype=torch.float32, device="cpu", seed: int = 0, **fields):
    """A tiny transformers causal LM (``llama``, ``qwen3`` (a sliding-window layer), ``qwen3_moe``, ``gpt_oss``)
    with random weights (``seed``; biases drawn too, so that gpt-oss's zero-initialised expert biases matter),
    in train mode; ``fields`` override the config (2 layers, hidden 64, 4 heads, 2 kv heads, vocab 128)."""
    import transformers

    config_cls, family_fields = _TINY_FAMILIES[family]
    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    config = getattr(transformers, config_cls)(**{**common, **family_fields, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.05)
    return model.train()


CHECKS = {
    "packing": check_packing,
    "routing": check_routing,
    "attention": check_attention,
    "copy": check_copy,
    "lora": check_lora,
}


# ---- hypothesis strategies -------------------------------------------------------------------------------


def seeds_strategy():
    """Seeds for a ``torch.Generator``: hypothesis draws the seed, the ``random_*`` helpers the data."""
    from hypothesis import strategies as st

    return st.integers(0, 2**63 - 1)


def position_ids_strategy(max_rows: int = 3, max_tokens: int = 256, dtypes=(torch.int32, torch.int64)):
    """``[T]`` or ``[B, T]`` CPU position ids with random documents (see ``random_position_ids``)."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        rows = draw(st.one_of(st.none(), st.integers(1, max_rows)))
        tokens = draw(st.integers(0, max_tokens))
        max_doc = draw(st.integers(1, max(1, max_tokens)))
        g = torch.Generator().manual_seed(draw(seeds_strategy()))
        return random_position_ids(g, rows, tokens, max_doc, draw(st.sampled_from(dtypes)))

    return build()


def seq_lengths_strategy(max_tokens: int = 256):
    """(lengths, num_tokens): lengths with zeros, and a token count at or past their sum."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        lengths = draw(st.lists(st.integers(0, max(1, max_tokens // 4)), max_size=12))
        return lengths, sum(lengths) + draw(st.integers(0, 8))

    return build()


def window_strategy(max_window: int = 300):
    from hypothesis import strategies as st

    return st.one_of(st.none(), st.integers(-2, max_window))


def routing_case_strategy(max_tokens: int = 96, device="cpu"):
    """Cases for ``check_routing_case`` (see ``random_routing_case``), drawn from a hypothesis seed."""
    return seeds_strategy().map(
        lambda seed: random_routing_case(torch.Generator().manual_seed(seed), device, max_tokens)
    )
