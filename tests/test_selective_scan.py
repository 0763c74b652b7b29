"""fastft.selective_scan: the op on both backends against the token-by-token reference (forward and every
gradient, fp32 against fp64), and the reference and the op against transformers' own Mamba-1 scan (Jamba's) on
each document run alone; the Triton kernels' pieces; the public entry's validation and backend choice."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fastft
from fastft import dispatch, testing
from fastft.reference import selective_scan as reference
from fastft.selective_scan import OP, packed_selective_scan, selective_scan_backward_op, selective_scan_op

# fp32 against the fp64 reference: max |fast - reference| <= RTOL * max |reference| + ATOL, for the output and
# each gradient.
RTOL, ATOL = 1e-5, 1e-6
BACKENDS = ["torch", "triton"]
NAMES = ("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias")


def random_inputs(g, b, dm, t, n, device, dtype=torch.float32):
    """u, delta, A, B, C, D, z, delta_bias: delta around softplus' knee, A in [-2, -0.1]."""
    u, delta, z = (torch.randn(b, dm, t, generator=g) for _ in range(3))
    A = -(torch.rand(dm, n, generator=g) * 1.9 + 0.1)
    B, C = (torch.randn(b, n, t, generator=g) for _ in range(2))
    D, delta_bias = torch.randn(dm, generator=g), torch.randn(dm, generator=g) * 0.5
    return [v.to(device, dtype).requires_grad_() for v in (u, delta, A, B, C, D, z, delta_bias)]


def assert_close_to(actual, expected, what):
    err = (actual.float() - expected.float()).abs().max().item() if expected.numel() else 0.0
    bound = RTOL * (expected.float().abs().max().item() if expected.numel() else 0.0) + ATOL
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def check_against_reference(info, inputs, c, backend, *, softplus=True, options=True):
    exact = [v.detach().double().requires_grad_() for v in inputs]

    def run(fn, u, delta, A, B, C, D, z, delta_bias, *first):
        kw = dict(D=D, z=z, delta_bias=delta_bias) if options else {}
        return fn(u, delta, A, B, C, *first, delta_softplus=softplus, **kw)

    out = run(lambda *a, **kw: packed_selective_scan(*a, chunk_size=c, backend=backend, **kw), *inputs, info)
    expected = run(reference.selective_scan, *exact, info.position_ids)
    assert out.shape == expected.shape and out.dtype == inputs[0].dtype
    assert_close_to(out, expected, "y")
    if out.numel() == 0:
        return
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(out.numel())).to(out)  # replayable
    n = len(inputs) if options else 5
    got = torch.autograd.grad((out * w).sum(), inputs[:n])
    want = torch.autograd.grad((expected * w.double()).sum(), exact[:n])
    for name, a, e in zip(NAMES, got, want):
        assert_close_to(a, e, name)


def check_from_position_ids(device, position_ids, c, dims, seed, backend):
    if position_ids.numel() == 0:
        return  # test_no_tokens
    pos = position_ids.reshape(-1, position_ids.shape[-1]).to(device)
    info = fastft.packed_seq_info(position_ids=pos)
    b, t = pos.shape
    check_against_reference(
        info, random_inputs(torch.Generator().manual_seed(seed), b, dims[0], t, dims[1], device), c, backend
    )


CHUNK_SIZES = st.sampled_from([1, 2, 4, 8])
DIMS = st.sampled_from([(1, 1), (3, 2), (20, 4)])  # Dm, N: 20 channels span two programs in the interpreter


@given(testing.position_ids_strategy(max_rows=3, max_tokens=24), CHUNK_SIZES, DIMS, testing.seeds_strategy())
def test_torch_matches_reference_from_position_ids(device, position_ids, c, dims, seed):
    check_from_position_ids(device, position_ids, c, dims, seed, "torch")


# Fewer tokens and examples on CPU: the interpreter runs the kernels' loops over tokens one by one.
@settings(max_examples=200 if torch.cuda.is_available() else 10)
@given(testing.position_ids_strategy(max_rows=2, max_tokens=12), CHUNK_SIZES, DIMS, testing.seeds_strategy())
def test_triton_matches_reference_from_position_ids(device, position_ids, c, dims, seed):
    check_from_position_ids(device, position_ids, c, dims, seed, "triton")


@pytest.mark.parametrize("lengths, c", [([1, 1, 1], 4), ([3, 1, 9, 2], 4), ([8, 4], 4)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_matches_reference_edge_lengths(device, rng, lengths, c, backend):
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    check_against_reference(info, random_inputs(rng, 1, 5, sum(lengths), 3, device), c, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_and_no_options(device, rng, backend):
    """Two rows with a document across them (host lengths, flat order); no D, z or bias, no softplus."""
    info = fastft.packed_seq_info(seq_lengths=[3, 7, 2], device=device)
    inputs = random_inputs(rng, 2, 3, 6, 2, device)
    inputs[1] = torch.rand(2, 3, 6, generator=rng).to(device).requires_grad_()  # delta > 0 without softplus
    check_against_reference(info, inputs, 4, backend, softplus=False, options=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs(device, rng, backend):
    """Every input a strided view (A, B and C transposed in memory, u and delta every other element of a wider
    tensor): the same result as the contiguous inputs, forward and every gradient, against the reference."""
    info = fastft.packed_seq_info(seq_lengths=[4, 6], device=device)
    inputs = random_inputs(rng, 1, 3, 10, 2, device)

    def strided(v):
        if v.dim() < 2:
            return v.detach().repeat_interleave(2)[::2].requires_grad_()
        if v.shape[-1] == 10:  # [B, Dm or N, T]: every other of twice the tokens
            return v.detach().repeat_interleave(2, -1)[..., ::2].requires_grad_()
        return v.detach().t().contiguous().t().requires_grad_()  # A [Dm, N], column-major

    views = [strided(v) for v in inputs]
    assert not any(v.is_contiguous() for v in views[:5])
    check_against_reference(info, views, 4, backend)
    views[3], views[4] = (
        v.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_() for v in inputs[3:5]
    )
    check_against_reference(info, views, 4, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_documents_do_not_leak(device, rng, backend):
    """A document's output is the same whatever precedes it in the row."""
    u, delta, A, B, C, D, z, bias = random_inputs(rng, 1, 4, 14, 3, device)
    kw = dict(D=D, delta_bias=bias, delta_softplus=True, backend=backend)
    packed = packed_selective_scan(u, delta, A, B, C, fastft.packed_seq_info(seq_lengths=[5, 9], device=device), **kw)
    rest = [v[..., 5:] for v in (u, delta, B, C)]
    alone = packed_selective_scan(*rest[:2], A, *rest[2:], fastft.packed_seq_info(seq_lengths=[9], device=device), **kw)
    assert_close_to(packed[..., 5:], alone, "second document")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs_and_autocast(device, rng, backend):
    info = fastft.packed_seq_info(seq_lengths=[5, 7], device=device)
    low = [v.detach().bfloat16() for v in random_inputs(rng, 1, 4, 12, 3, device)]
    u, delta, A, B, C, D, z, bias = low
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = packed_selective_scan(
            u, delta, A, B, C, info, D=D, z=z, delta_bias=bias, delta_softplus=True, backend=backend
        )
    assert out.dtype == torch.bfloat16
    fp32 = [v.float() for v in low]
    expected = reference.selective_scan(
        *fp32[:5], info.position_ids, D=fp32[5], z=fp32[6], delta_bias=fp32[7], delta_softplus=True
    )
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_works_under_checkpoint(device, rng, backend):
    info = fastft.packed_seq_info(seq_lengths=[4, 6], device=device)
    inputs = random_inputs(rng, 1, 3, 10, 2, device)

    def run(u, delta, A, B, C, D, z, bias):
        return packed_selective_scan(u, delta, A, B, C, info, D=D, z=z, delta_bias=bias, chunk_size=4, backend=backend)

    run(*inputs).square().sum().backward()
    plain = [v.grad.clone() for v in inputs]
    for reentrant in (False, True):
        for v in inputs:
            v.grad = None
        torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=reentrant).square().sum().backward()
        for v, e in zip(inputs, plain):
            torch.testing.assert_close(v.grad, e, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync_from_host_lengths(device, rng, backend):
    info = fastft.packed_seq_info(seq_lengths=[5, 1, 8, 2], device=device)
    u, delta, A, B, C, D, z, bias = inputs = random_inputs(rng, 1, 4, 16, 2, device)
    with testing.no_host_sync():
        out = packed_selective_scan(
            u, delta, A, B, C, info, D=D, z=z, delta_bias=bias, delta_softplus=True, backend=backend
        )
        torch.autograd.grad(out.sum(), inputs)


def test_no_tokens(device):
    info = fastft.packed_seq_info(seq_lengths=[], device=device)
    u = torch.zeros(1, 3, 0, device=device)
    out = packed_selective_scan(
        u, u, torch.zeros(3, 2, device=device), *[torch.zeros(1, 2, 0, device=device)] * 2, info
    )
    assert out.shape == (1, 3, 0)


def test_triton_op_passes_opcheck(device, rng):
    info = fastft.packed_seq_info(seq_lengths=[3, 2], device=device)
    from fastft.delta_rule import chunk_table

    table = chunk_table(info, 2)
    u, delta = torch.randn(5, 3, generator=rng).to(device), torch.rand(5, 3, generator=rng).to(device)
    A = -torch.rand(3, 2, generator=rng).to(device)
    B, C = (torch.randn(5, 2, generator=rng).to(device) for _ in range(2))
    tables = (table.start, table.length, table.first)
    args = [v.requires_grad_() for v in (u, delta, A, B, C)]
    torch.library.opcheck(selective_scan_op.op, (*args, *tables, 2))
    dy = torch.randn(5, 3, generator=rng).to(device)
    torch.library.opcheck(selective_scan_backward_op.op, (*(v.detach() for v in args), *tables, dy, 2))


def glue_inputs(rng, b, dm, t, dtype, device):
    """u, delta, z ``[b, dm, t]`` as channels-last views (as transformers passes them), bias, D."""
    u, delta, z = (torch.randn(b, t, dm, generator=rng).to(device, dtype).transpose(1, 2) for _ in range(3))
    bias, D = (torch.randn(dm, generator=rng).to(device) for _ in range(2))
    return u, delta, z, bias, D


def _flat(v):  # [B, K, T] -> fp32 [B * T, K]
    return v.transpose(1, 2).reshape(-1, v.shape[1]).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [True, False])
def test_glue_kernels_match_torch(device, rng, dtype, options):
    """The glue kernels around the chunk kernels against the torch expressions they replace and their autograd:
    two rows, 70 tokens (two tiles of tokens), channels-last inputs; with or without D, z, the bias and
    softplus."""
    from fastft.kernels import selective_scan as kernels

    b, dm, t = 2, 5, 35
    u, delta, z, bias, D = glue_inputs(rng, b, dm, t, dtype, device)
    if not options:
        z = bias = D = None
    softplus = options
    leaves = [v.detach().float().requires_grad_() if v is not None else None for v in (u, delta, bias)]
    step_ref = _flat(leaves[1]) + (leaves[2] if bias is not None else 0)
    step_ref = F.softplus(step_ref) if softplus else step_ref
    x, step = kernels.tokens_forward(u, delta, bias, softplus)
    torch.testing.assert_close(x, _flat(u))
    torch.testing.assert_close(step, step_ref.detach(), rtol=1e-6, atol=1e-7)

    y = torch.randn(b * t, dm, generator=rng).to(device).requires_grad_()
    gate = z.detach().float().requires_grad_() if z is not None else None
    d = D.clone().requires_grad_() if D is not None else None
    want = (y + (d * x if d is not None else 0)) * (F.silu(_flat(gate)) if gate is not None else 1)
    out = kernels.output_forward(y.detach(), x, D, z, dtype=dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, want.detach().to(dtype))

    dout = torch.randn(b * t, dm, generator=rng).to(device, dtype)
    dys, dz, dD = kernels.output_backward(dout.t().contiguous().t(), y.detach() if z is not None else None, x, D, z, t)
    named = {name: v for name, v in (("y", y), ("z", gate), ("D", d)) if v is not None}
    grads = dict(zip(named, torch.autograd.grad(want, list(named.values()), dout.float())))
    torch.testing.assert_close(dys, grads["y"])
    if z is not None:
        assert dz.dtype == dtype and dz.shape == z.shape
        torch.testing.assert_close(dz, grads["z"].to(dtype))
    if D is not None:
        torch.testing.assert_close(dD, grads["D"], rtol=1e-5, atol=1e-5)

    du_s, ddelta_s = (torch.randn(b * t, dm, generator=rng).to(device) for _ in range(2))
    du, ddelta, dbias = kernels.tokens_backward(du_s, ddelta_s, dys, D, delta, bias, softplus, u_dtype=u.dtype)
    skip = du_s + (D * dys if D is not None else 0)
    ref = torch.autograd.grad((_flat(leaves[0]), step_ref), [v for v in leaves if v is not None], (skip, ddelta_s))
    assert du.dtype == u.dtype and ddelta.dtype == delta.dtype and du.shape == u.shape
    torch.testing.assert_close(du, ref[0].to(dtype))
    torch.testing.assert_close(ddelta, ref[1].to(dtype))
    if bias is not None:
        torch.testing.assert_close(dbias, ref[2], rtol=1e-5, atol=1e-5)
    else:
        assert dbias.numel() == 0


def test_glue_ops_pass_opcheck(device, rng):
    from fastft.selective_scan import output_backward_op, output_forward_op, tokens_backward_op, tokens_forward_op

    b, dm, t = 1, 3, 5
    u, delta, z, bias, D = glue_inputs(rng, b, dm, t, torch.bfloat16, device)
    for options in [(z, bias, D), (None, None, None)]:
        gate, bias_, D_ = options
        torch.library.opcheck(tokens_forward_op.op, (u, delta, bias_, gate is not None))
        x, step = tokens_forward_op(u, delta, bias_, gate is not None)
        y = torch.randn(b * t, dm, generator=rng).to(device)
        torch.library.opcheck(output_forward_op.op, (y, x, D_, gate, u))
        dout = torch.randn(b * t, dm, generator=rng).to(device, u.dtype)
        torch.library.opcheck(output_backward_op.op, (dout, y if gate is not None else None, x, D_, gate, t))
        dys = torch.randn(b * t, dm, generator=rng).to(device)
        args = (x.clone(), step.clone(), dys, D_, delta, bias_, gate is not None, u)
        torch.library.opcheck(tokens_backward_op.op, args)


def test_glue_kernels_refuse_mismatched_shapes(device, rng):
    from fastft.kernels import selective_scan as kernels

    u, delta, z, bias, D = glue_inputs(rng, 1, 3, 5, torch.float32, device)
    with pytest.raises(ValueError, match=r"delta must be u's shape"):
        kernels.tokens_forward(u, delta[..., :4])
    with pytest.raises(ValueError, match=r"bias must be \[Dm\]"):
        kernels.tokens_forward(u, delta, bias[:2])
    x, step = kernels.tokens_forward(u, delta)
    with pytest.raises(ValueError, match=r"y must be \[B \* T, Dm\]"):
        kernels.output_forward(x[:4], x, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"z must be \[B, Dm, T\]"):
        kernels.output_forward(x, x, z=z[..., :4], dtype=torch.float32)
    with pytest.raises(ValueError, match="y must be given with z"):
        kernels.output_backward(x, None, x, None, z, 5)
    with pytest.raises(ValueError, match=r"D must be \[Dm\]"):
        kernels.tokens_backward(x, step, x, D[:1], delta, u_dtype=torch.float32)


# ---- transformers' implementation, one document at a time -------------------------------------------------


def test_matches_transformers_on_each_document(device, rng):
    """transformers' torch ``mamba_selective_scan`` (Jamba's sequential path), run on each document alone,
    against the reference and both backends on the packed row."""
    jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")
    theirs = inspect.unwrap(jamba.mamba_selective_scan)  # the torch function, not mamba_ssm's kernel
    lengths = [9, 1, 6]
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    u, delta, A, B, C, D, z, bias = random_inputs(rng, 1, 4, sum(lengths), 3, device)
    kw = dict(D=D, z=z, delta_bias=bias, delta_softplus=True)
    ours = [reference.selective_scan(u, delta, A, B, C, info.position_ids, **kw)]
    ours += [
        packed_selective_scan(u, delta, A, B, C, info, chunk_size=4, backend=backend, **kw) for backend in BACKENDS
    ]
    start = 0
    for n in lengths:
        doc = [v[..., start : start + n] for v in (u, delta, B, C, z)]
        expected = theirs(*doc[:2], A, *doc[2:4], D=D, z=doc[4], delta_bias=bias, delta_softplus=True)
        for name, out in zip(["reference", *BACKENDS], ours):
            assert_close_to(out[..., start : start + n], expected, f"{name}, document at {start}")
        start += n


# ---- validation ------------------------------------------------------------------------------------------


def _args(**changes):
    b, dm, t, n = 1, 3, 6, 2
    args = dict(
        u=torch.zeros(b, dm, t),
        delta=torch.zeros(b, dm, t),
        A=torch.zeros(dm, n),
        B=torch.zeros(b, n, t),
        C=torch.zeros(b, n, t),
        info=fastft.packed_seq_info(seq_lengths=[2, 4]),
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(u=[0.0]), TypeError, "u must be a tensor"),
        (dict(u=torch.zeros(3, 6)), ValueError, r"u must be \[B, Dm, T\]"),
        (dict(delta=torch.zeros(1, 3, 5)), ValueError, "delta must be u's shape"),
        (dict(delta=torch.zeros(1, 3, 6, dtype=torch.int32)), ValueError, "delta must have a floating dtype"),
        (dict(A=torch.zeros(2, 2)), ValueError, r"A must be \[Dm, N\] with Dm = 3"),
        (dict(B=torch.zeros(1, 3, 6)), ValueError, r"B must be \[B, N, T\]"),
        (dict(C=torch.zeros(1, 2, 5)), ValueError, r"C must be \[B, N, T\]"),
        (dict(A=torch.zeros(3, 3)), ValueError, r"B must be \[B, N, T\] with N = A.shape\[1\] = \(1, 3, 6\)"),
        (dict(D=torch.zeros(2)), ValueError, r"D must be \[Dm\]"),
        (dict(delta_bias=torch.zeros(3, 1)), ValueError, r"delta_bias must be \[Dm\]"),
        (dict(z=torch.zeros(1, 3, 5)), ValueError, "z must be u's shape"),
        (dict(delta_softplus="yes"), TypeError, "delta_softplus must be True or False"),
        (dict(info=torch.arange(6)), TypeError, "info must be a fastft.PackedSeqInfo"),
        (dict(info=fastft.packed_seq_info(seq_lengths=[2, 5])), ValueError, "info has 7 tokens but u has B . T = 6"),
        (dict(chunk_size=0), ValueError, "chunk_size must be an int >= 1"),
        (dict(chunk_size=300), ValueError, "chunk_size must be an int from 1 to 256"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
    ],
)
def test_bad_input(changes, error, match):
    with pytest.raises(error, match=match):
        packed_selective_scan(**_args(**changes))


def test_backend_choice(device, monkeypatch):
    monkeypatch.delenv("FASTFT_BACKEND", raising=False)
    assert dispatch.backend_for(OP, device) == "triton"
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    assert dispatch.backend_for(OP, device) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' cannot run selective_scan.scan on device cpu"):
        packed_selective_scan(**_args(), backend="triton")


# ---- GPU: real sizes -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_sizes_bf16_against_transformers(backend):
    """Jamba's widths (Dm = 8192, N = 16), T=2048 in a few documents, bf16 inputs: the output and every
    gradient against transformers' torch path run on each document alone in fp32 on the same bf16 values;
    fastft's error within 2x that of transformers' own bf16 run, plus 1e-3 of the largest value."""
    jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")
    stock = inspect.unwrap(jamba.mamba_selective_scan)
    device = torch.device("cuda")
    lengths = [700, 1, 64, 500, 783]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    t = sum(lengths)
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    inputs = random_inputs(torch.Generator().manual_seed(0), 1, 8192, t, 16, device, torch.bfloat16)
    w = torch.randn(1, 8192, t, generator=torch.Generator().manual_seed(1)).to(device)

    def per_doc(v):
        parts = []
        for s, n in zip(starts, lengths):
            u, delta, B, C, z = (x[..., s : s + n] for x in (v[0], v[1], v[3], v[4], v[6]))
            parts.append(stock(u, delta, v[2], B, C, D=v[5], z=z, delta_bias=v[7], delta_softplus=True))
        return torch.cat(parts, -1)

    def results(out, v):
        return [out.detach().float(), *torch.autograd.grad((out.float() * w).sum(), v)]

    u, delta, A, B, C, D, z, bias = inputs
    ours = packed_selective_scan(
        u, delta, A, B, C, info, D=D, z=z, delta_bias=bias, delta_softplus=True, backend=backend
    )
    ours = results(ours, inputs)
    theirs = results(per_doc(inputs), inputs)
    fp32 = [v.detach().float().requires_grad_() for v in inputs]
    exact = results(per_doc(fp32), fp32)
    for name, a, s, e in zip(("y", *NAMES), ours, theirs, exact):
        err, stock_err = (a.float() - e).abs().max().item(), (s.float() - e).abs().max().item()
        assert err <= 2 * stock_err + 1e-3 * e.abs().max().item(), f"{name}: {err:.3g} vs stock {stock_err:.3g}"
