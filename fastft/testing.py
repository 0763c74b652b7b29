"""Differential testing: run the Triton and torch backends on the same inputs and report the first mismatch.

Public so users can fuzz their own kernels the way fastft's property tests and ``python -m fastft check`` do:

    from fastft.testing import assert_same, differential
    differential(lambda backend: my_op(x, backend=backend))      # triton vs torch, exact
    assert_same(mine, reference, atol=1e-2, rtol=1e-2)           # any nesting of tensors/ints/lists/dicts

Random inputs come from a ``torch.Generator`` (``random_*``) or, for hypothesis, from the ``*_strategy``
functions (hypothesis is imported only when one is called).
"""

from __future__ import annotations

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
            assert_same(getattr(actual, f.name), getattr(expected, f.name), atol=atol, rtol=rtol, path=f"{path}.{f.name}")
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


def _randint(g: torch.Generator, low: int, high: int) -> int:
    """Uniform int in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def random_seq_lengths(g: torch.Generator, num_tokens: int, max_len: int, zero_prob: float = 0.1) -> list[int]:
    """Lengths in [1, max_len] (some 0) that sum to at most ``num_tokens``."""
    lengths, total = [], 0
    while True:
        n = 0 if torch.rand((), generator=g) < zero_prob else _randint(g, 1, max_len)
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
            length = _randint(g, 1, max_doc_len)
            kind = _randint(g, 0, 9)
            if kind == 0:
                row += [0] * length  # padding: every token is its own document
            else:
                first = 0 if kind > 2 else _randint(g, 1, 1000)
                row += range(first, first + length)
        out.append(row[:tokens])
    t = torch.tensor(out, dtype=dtype).reshape(rows or 1, tokens)
    return t if rows is not None else t[0]


# ---- packing: one differential case ----------------------------------------------------------------------


BLOCK_MASK_FIELDS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
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
    tokens = _randint(g, 0, max_tokens)
    kind = _randint(g, 0, 2)
    if kind == 0:
        rows = None if _randint(g, 0, 1) else _randint(g, 1, 3)
        dtype = torch.int32 if _randint(g, 0, 1) else torch.int64
        pos = random_position_ids(g, rows, tokens, max(1, _randint(g, 1, max_tokens // 2)), dtype).to(device)
        source = {"position_ids": pos}
    else:
        lengths = random_seq_lengths(g, tokens, max(1, _randint(g, 1, max_tokens // 2)))
        extra = _randint(g, 0, 5)
        name = "seq_lengths" if kind == 1 else "cu_seqlens"
        values = lengths if kind == 1 else [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        source = {name: values, "num_tokens": sum(lengths) + extra, "device": device}
    windows = (None, _randint(g, -1, 2), _randint(g, 1, max_tokens))
    block_sizes = (_randint(g, 1, 4) * 16, 2 ** _randint(g, 0, 3) if tokens <= 64 else 128)
    return dict(source=source, windows=windows, block_sizes=block_sizes, mask_dtypes=(torch.bool, torch.bfloat16))


def check_packing(g: torch.Generator, device, max_tokens: int) -> None:
    case = random_packing_case(g, device, max_tokens)
    try:
        differential(lambda backend: packing_outputs(**case, backend=backend))
    except AssertionError as e:
        raise AssertionError(f"{e}\ncase: {case}") from None


# ---- routing: one differential case ----------------------------------------------------------------------


def random_topk_ids(
    g: torch.Generator, tokens: int, top_k: int, num_experts: int, *, unrouted: float = 0.1,
    dtype=torch.int64, strided: bool = False,
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
    tokens = _randint(g, 0, max_tokens)
    top_k = _randint(g, 1, 8)
    num_experts = [1, 2, 3, 7, 8, 32, 100, 1030][_randint(g, 0, 7)]
    ids = random_topk_ids(
        g, tokens, top_k, num_experts, unrouted=[0.0, 0.1, 0.9][_randint(g, 0, 2)],
        dtype=torch.int32 if _randint(g, 0, 1) else torch.int64, strided=bool(_randint(g, 0, 1)),
    ).to(device)
    options = {"num_experts": num_experts, "block_size": [1, 1, 2, 16, 128][_randint(g, 0, 4)]}
    if _randint(g, 0, 2) == 0:
        local = _randint(g, 1, num_experts)
        mapping = torch.full((num_experts,), -1, dtype=torch.int32)
        mapping[torch.randperm(num_experts, generator=g)[:local]] = torch.randperm(local, generator=g).int()
        options.update(expert_map=mapping.to(device), num_local_experts=local)
    local = options.get("num_local_experts", num_experts)
    dtype = torch.float32 if _randint(g, 0, 1) else torch.bfloat16
    hidden = _randint(g, 1, 48)
    data = torch.Generator().manual_seed(_randint(g, 0, 2**62))
    rand = lambda *shape: torch.randn(*shape, generator=data).to(device, dtype)  # noqa: E731
    return dict(
        topk_ids=ids, options=options, x=rand(tokens, hidden), weights=rand(tokens, top_k),
        table=rand(local, _randint(g, 1, 40)), seed=_randint(g, 0, 2**62),
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
        **routing_fields(r), "permute": xs, "unpermute": y, "unpermute_unweighted": y_plain, "expert_rows": rows,
        "dx": dx, "dys": dys, "dys_unweighted": dys_plain,
    }
    return exact, {"dweights": dweights, "dtable": dtable}


def check_routing_case(case: dict) -> None:
    """Triton vs torch on one ``random_routing_case``: integers and fixed-order sums exactly, the rest
    within fp32 (1e-4) or bf16 (2e-2) tolerance plus 4 fp32 ulps per summed term. Triton's CPU interpreter truncates fp32 -> bf16 where a
    GPU rounds to nearest even, so there bf16 results of fp32 sums may differ by one bf16 ulp."""
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
    torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as same-width integers: compares every dtype bit for bit (NaN payloads included)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def random_strided_tensor(g: torch.Generator, device, max_numel: int, dtype=None) -> torch.Tensor:
    """A random view: rank 0-5, any of ``COPY_DTYPES``, random bits (floats include NaN/inf patterns),
    then permuted, sliced with steps and offsets, or expanded along a size-1 dimension."""
    dtype = dtype or COPY_DTYPES[_randint(g, 0, len(COPY_DTYPES) - 1)]
    rank = _randint(g, 0, 5)
    budget = max(1, max_numel)
    shape = []
    for _ in range(rank):
        shape.append(_randint(g, 0 if _randint(g, 0, 9) == 0 else 1, max(1, min(6, budget))))
        budget = max(1, budget // max(1, shape[-1]))
    steps = [_randint(g, 1, 2) for _ in shape]
    base_shape = [z * st + _randint(g, 0, 1) for z, st in zip(shape, steps)]
    if dtype == torch.bool:
        base = torch.randint(0, 2, base_shape, generator=g).bool()
    else:
        nbytes = math.prod(base_shape) * torch.empty((), dtype=dtype).element_size()
        base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(base_shape)
    index = []
    for z, st, b in zip(shape, steps, base_shape):
        start = _randint(g, 0, b - (z - 1) * st - 1) if z else 0
        index.append(slice(start, start + (z - 1) * st + 1 if z else start, st))
    t = base.to(device)[tuple(index)]
    if rank > 1 and _randint(g, 0, 1):
        t = t.permute(*torch.randperm(rank, generator=g).tolist())
    ones = [i for i, z in enumerate(t.shape) if z == 1]
    if ones and _randint(g, 0, 3) == 0:
        shape = list(t.shape)
        shape[ones[0]] = _randint(g, 2, 4)
        t = t.expand(shape)
    return t


def random_copy_case(g: torch.Generator, device, max_numel: int) -> list[torch.Tensor]:
    """0-4 tensors from ``random_strided_tensor``, for ``check_copy_case``."""
    return [random_strided_tensor(g, device, max_numel) for _ in range(_randint(g, 0, 4))]


def check_copy_case(tensors, *, backend=None) -> None:
    """``fastft.copy.pack``/``unpack`` on ``backend`` (default: the dispatched one) against the torch
    reference: packed bytes equal per entry, unpack returns the inputs bit for bit with their strides where
    they do not overlap, and unpacking into outputs of other strides works too."""
    from fastft import copy

    buf, layout = copy.pack(tensors, backend=backend)
    ref, ref_layout = copy.pack(tensors, backend="torch")
    assert layout == ref_layout
    for i, e in enumerate(layout.entries):
        assert_same(buf[e.offset:e.offset + e.nbytes], ref[e.offset:e.offset + e.nbytes], path=f"pack entry {i}")
    outs = copy.unpack(buf, layout, backend=backend)
    for i, (t, o) in enumerate(zip(tensors, outs)):
        assert_same(bits(o), bits(t), path=f"unpack[{i}]")
        if copy.non_overlapping(t.shape, t.stride()):
            assert o.stride() == t.stride() or o.numel() <= 1, f"unpack[{i}] strides {o.stride()} != {t.stride()}"
    into = [torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).permute(list(range(t.dim()))[::-1]) for t in tensors]
    outs = copy.unpack(buf, layout, out=into, backend=backend)
    for i, (t, o) in enumerate(zip(tensors, outs)):
        assert o is into[i]
        assert_same(bits(o), bits(t), path=f"unpack(out=)[{i}]")


def check_copy(g: torch.Generator, device, max_tokens: int) -> None:
    check_copy_case(random_copy_case(g, device, max_tokens * 16))


def random_lora_case(g: torch.Generator, device, dtype, bias: bool = True) -> tuple:
    """Arguments of ``fastft.lora.lora_linear`` of random sizes: ``x`` ``[2, n, in]`` of ``dtype`` (requires
    grad), frozen ``weight``/``bias`` of ``dtype``, fp32 ``lora_a``/``lora_b`` (require grad), a scaling."""
    n, fan_in, fan_out, rank = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((1, 40), (1, 70), (1, 70), (1, 17)))
    x = torch.randn(2, n, fan_in, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5).to(device, dtype)
    b = torch.randn(fan_out, generator=g).to(device, dtype) if bias else None
    lora_a = (torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5).to(device).requires_grad_()
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
    assert results[0][0].dtype == x.dtype and results[0][2].dtype == lora_a.dtype and results[0][3].dtype == lora_b.dtype
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
CHECKS = {"packing": check_packing, "routing": check_routing, "copy": check_copy, "lora": check_lora}


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
    return seeds_strategy().map(lambda seed: random_routing_case(torch.Generator().manual_seed(seed), device, max_tokens))

