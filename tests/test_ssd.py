"""fastft.ssd: the Triton scan over chunks against the torch loop (forward and every gradient, both decay
shapes); the intra-chunk, output and glue kernels (the tokens into the slots and back) against their torch
formulas; the op on both backends against the token-by-token reference (forward and every gradient, fp32); the
reference and the op against transformers' own Mamba-2 scan on each document run alone; the public entry's
validation and backend choice."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fastft
from fastft import dispatch, testing
from fastft.delta_rule import chunk_table
from fastft.reference import ssd as reference
from fastft.ssd import (
    OP_SCAN,
    bc_pack_backward_op,
    bc_pack_forward_op,
    intra_backward_op,
    intra_forward_op,
    output_backward_op,
    output_forward_op,
    pack_backward_op,
    pack_forward_op,
    packed_ssd_scan,
    scan_states,
    state_scan_backward_op,
    state_scan_op,
    unpack_backward_op,
    unpack_forward_op,
)

# fp32 against the fp64 reference: max |fast - reference| <= RTOL * max |reference| + ATOL, for the output and
# each gradient.
RTOL, ATOL = 1e-5, 1e-6
BACKENDS = ["torch", "triton"]
NAMES = ("dx", "ddt", "dA", "dB", "dC", "dD", "ddt_bias", "dz")


def random_inputs(g, b, t, h, p, groups, n, device, dtype=torch.float32):
    """x, dt, A, B, C, D, dt_bias, z: dt around softplus' knee, A in [-2, -0.1] (decays that matter within a
    few tokens, as a trained model's do)."""
    x = torch.randn(b, t, h, p, generator=g)
    dt = torch.randn(b, t, h, generator=g)
    A = -(torch.rand(h, generator=g) * 1.9 + 0.1)
    B, C = (torch.randn(b, t, groups, n, generator=g) for _ in range(2))
    D = torch.randn(h, generator=g)
    dt_bias = torch.randn(h, generator=g) * 0.5
    z = torch.randn(b, t, h, p, generator=g)
    return [v.to(device, dtype).requires_grad_() for v in (x, dt, A, B, C, D, dt_bias, z)]


# The Triton path may also lose up to this many times what the torch path loses in fp32 on the same values: a
# gradient summed over terms that cancel (dA, ddt_bias) can lose more than RTOL of its largest element in any fp32
# order, and the kernels' products run in 3xTF32 on the GPU.
FP32_SLACK = 4.0


def max_error(actual, expected) -> float:
    return (actual.float() - expected.float()).abs().max().item() if expected.numel() else 0.0


def assert_close_to(actual, expected, what, slack=0.0):
    err = max_error(actual, expected)
    bound = RTOL * (expected.float().abs().max().item() if expected.numel() else 0.0) + ATOL + slack
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def check_against_reference(info, inputs, c, backend, *, dt_softplus=True, dt_limit=(0.0, math.inf), gate=True):
    """The op (fp32) against the reference in fp64 on the same values, forward and every gradient."""
    exact = [v.detach().double().requires_grad_() for v in inputs]

    def run(fn, x, dt, A, B, C, D, dt_bias, z, *first):
        kw = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, z=z if gate else None)
        return fn(x, dt, A, B, C, *first, **kw)

    def op(backend):
        return run(lambda *a, **kw: packed_ssd_scan(*a, chunk_size=c, backend=backend, **kw), *inputs, info)

    out = op(backend)
    expected = run(reference.ssd_scan, *exact, info.position_ids)
    assert out.shape == expected.shape and out.dtype == inputs[0].dtype
    n = len(inputs) if gate else len(inputs) - 1
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(out.numel())).to(out)  # replayable
    want = [expected, *torch.autograd.grad((expected * w.double()).sum(), exact[:n])] if out.numel() else [expected]
    slack = [0.0] * len(want)
    if backend != "torch" and out.numel():  # what fp32 itself loses here, in the specification's order
        spec = op("torch")
        spec = [spec, *torch.autograd.grad((spec * w).sum(), inputs[:n])]
        slack = [FP32_SLACK * max_error(a, e) for a, e in zip(spec, want)]
    assert_close_to(out, expected, "y", slack[0])
    if out.numel() == 0:
        return
    got = torch.autograd.grad((out * w).sum(), inputs[:n])
    for name, a, e, extra in zip(NAMES, got, want[1:], slack[1:]):
        assert_close_to(a, e, name, extra)


CHUNK_SIZES = st.sampled_from([1, 2, 4, 8, 16])
DIMS = st.sampled_from([(1, 2, 1, 3), (2, 4, 2, 2), (4, 2, 2, 4), (2, 3, 1, 1)])  # H, P, G, N


def check_from_position_ids(device, position_ids, c, dims, seed, backend):
    if position_ids.numel() == 0:
        return  # test_no_tokens
    pos = position_ids.reshape(-1, position_ids.shape[-1]).to(device)
    info = fastft.packed_seq_info(position_ids=pos)
    g = torch.Generator().manual_seed(seed)
    check_against_reference(info, random_inputs(g, *pos.shape, *dims, device), c, backend)


@given(testing.position_ids_strategy(max_rows=3, max_tokens=24), CHUNK_SIZES, DIMS, testing.seeds_strategy())
def test_torch_matches_reference_from_position_ids(device, position_ids, c, dims, seed):
    check_from_position_ids(device, position_ids, c, dims, seed, "torch")


@given(testing.position_ids_strategy(max_rows=2, max_tokens=16), CHUNK_SIZES, DIMS, testing.seeds_strategy())
def test_triton_matches_reference_from_position_ids(device, position_ids, c, dims, seed):
    check_from_position_ids(device, position_ids, c, dims, seed, "triton")


@pytest.mark.parametrize(
    "lengths, c",
    [
        ([1, 1, 1, 1, 1], 4),  # 1-token documents
        ([3, 1, 2, 7, 1], 8),  # all shorter than a chunk
        ([8, 8, 16, 8], 8),  # exactly chunk-length documents (and two chunks)
        ([21, 1, 9, 30, 2], 8),  # longer than a chunk, ends mid-chunk
        ([70, 1, 64, 33], 64),  # the models' chunk size is 256; 64 keeps the test quick
        ([70, 1, 150, 33], 128),  # past the Triton intra-chunk kernels' 64: that part in torch
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_matches_reference_edge_lengths(device, rng, lengths, c, backend):
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    check_against_reference(info, random_inputs(rng, 1, sum(lengths), 2, 3, 1, 4, device), c, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_position_ids_and_options(device, rng, backend):
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2], [7, 8, 9, 0, 1, 2, 3, 4, 5]], device=device)  # row 2: a tail
    info = fastft.packed_seq_info(position_ids=pos)
    inputs = random_inputs(rng, 2, 9, 4, 3, 2, 4, device)
    check_against_reference(info, inputs, 4, backend, dt_softplus=False, dt_limit=(0.1, 0.7), gate=False)
    # D per channel ([H, P]), and host lengths over B * T tokens in flat order: a document across the rows.
    inputs = random_inputs(rng, 2, 12, 2, 3, 2, 4, device)
    inputs[5] = torch.randn(2, 3, generator=rng).to(device).requires_grad_()
    check_against_reference(fastft.packed_seq_info(seq_lengths=[5, 15, 4], device=device), inputs, 8, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_documents_do_not_leak(device, rng, backend):
    """A document's output is the same whatever precedes it in the row."""
    x, dt, A, B, C, D, dt_bias, z = random_inputs(rng, 1, 30, 2, 4, 1, 4, device)
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, z=z, backend=backend)
    packed = packed_ssd_scan(x, dt, A, B, C, fastft.packed_seq_info(seq_lengths=[13, 17], device=device), **kw)
    kw["z"] = z[:, 13:]
    alone = packed_ssd_scan(
        x[:, 13:], dt[:, 13:], A, B[:, 13:], C[:, 13:], fastft.packed_seq_info(seq_lengths=[17], device=device), **kw
    )
    assert_close_to(packed[:, 13:], alone, "second document")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs_and_autocast(device, rng, backend):
    info = fastft.packed_seq_info(seq_lengths=[5, 11], device=device)
    low = [v.detach().bfloat16() for v in random_inputs(rng, 1, 16, 2, 4, 1, 4, device)]
    x, dt, A, B, C, D, dt_bias, z = low
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, z=z)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = packed_ssd_scan(x, dt, A, B, C, info, chunk_size=4, backend=backend, **kw)
    assert out.dtype == torch.bfloat16
    fp32 = [v.float() for v in low]
    kw = dict(D=fp32[5], dt_bias=fp32[6], dt_softplus=True, z=fp32[7])
    expected = reference.ssd_scan(*fp32[:5], info.position_ids, **kw)
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wide", [(1,), (0, 1, 2, 3, 4, 5, 6, 7)])
def test_fp64_inputs(device, rng, backend, wide):
    """fp64 dt alone, or every input fp64: the math in fp32, y in x's dtype, every gradient through."""
    info = fastft.packed_seq_info(seq_lengths=[5, 11], device=device)
    inputs = [
        v.detach().double() if i in wide else v.detach()
        for i, v in enumerate(random_inputs(rng, 1, 16, 2, 4, 1, 4, device))
    ]
    for v in inputs:
        v.requires_grad_()
    check_against_reference(info, inputs, 4, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_works_under_checkpoint(device, rng, backend):
    info = fastft.packed_seq_info(seq_lengths=[6, 10], device=device)
    inputs = random_inputs(rng, 1, 16, 2, 2, 1, 2, device)

    def run(x, dt, A, B, C, D, dt_bias, z):
        return packed_ssd_scan(x, dt, A, B, C, info, D=D, dt_bias=dt_bias, z=z, chunk_size=4, backend=backend)

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
    info = fastft.packed_seq_info(seq_lengths=[9, 1, 20, 2], device=device)
    x, dt, A, B, C, D, dt_bias, z = inputs = random_inputs(rng, 1, 32, 2, 4, 1, 4, device)
    with testing.no_host_sync():
        out = packed_ssd_scan(x, dt, A, B, C, info, D=D, dt_bias=dt_bias, dt_softplus=True, z=z, backend=backend)
        torch.autograd.grad(out.sum(), inputs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_position_ids_sync_once_for_num_seqs(device, rng, backend):
    pos = testing.random_position_ids(rng, 2, 16, 7).to(device)
    info = fastft.packed_seq_info(position_ids=pos)
    assert info.num_seqs > 0  # the one sync a PackedSeqInfo from device position ids makes; the op makes none
    x, dt, A, B, C, *_ = inputs = random_inputs(rng, 2, 16, 2, 2, 1, 2, device)
    with testing.no_host_sync():
        out = packed_ssd_scan(x, dt, A, B, C, info, chunk_size=4, backend=backend)
        torch.autograd.grad(out.sum(), inputs[:5])


def test_no_tokens(device):
    info = fastft.packed_seq_info(seq_lengths=[], device=device)
    x = torch.zeros(1, 0, 2, 4, device=device)
    out = packed_ssd_scan(
        x,
        torch.zeros(1, 0, 2, device=device),
        torch.zeros(2, device=device),
        *[torch.zeros(1, 0, 1, 3, device=device)] * 2,
        info,
    )
    assert out.shape == (1, 0, 2, 4)


# ---- the Triton scan over chunks against the torch loop ---------------------------------------------------


@pytest.mark.parametrize("h, nc, e", [(2, 5, 12), (3, 9, 40), (1, 2, 3)])
@pytest.mark.parametrize("per_element", [False, True])
def test_triton_state_scan_matches_torch(device, rng, h, nc, e, per_element):
    """Forward (the entering states) and the gradients of local and decay for a random gradient of the states,
    against the torch loop and its autograd, fp32; several programs per head (BLOCK=8)."""
    from fastft.kernels import ssd as kernels

    local = torch.randn(h, nc, e, generator=rng).to(device).requires_grad_()
    decay = torch.rand((h, nc, e) if per_element else (h, nc), generator=rng).to(device).requires_grad_()
    first = (torch.rand(nc, generator=rng) < 0.4).to(device)  # documents start mid-way; the first chunk too or not
    want = scan_states(local, decay, first)
    dstates = torch.randn(want.shape, generator=rng).to(device)
    want_grads = torch.autograd.grad(want, (local, decay), dstates)
    got = kernels.state_scan(local.detach(), decay.detach(), first, BLOCK=8)
    assert got.shape == want.shape
    assert_close_to(got, want, "states")
    got_grads = torch.autograd.grad(state_scan_op(local, decay, first), (local, decay), dstates)
    for name, a, b in zip(("dlocal", "ddecay"), got_grads, want_grads):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert_close_to(a, b, name)


def test_triton_state_scan_passes_opcheck(device, rng):
    local, decay = torch.randn(2, 3, 5, generator=rng).to(device), torch.rand(2, 3, generator=rng).to(device)
    first = torch.tensor([True, False, True], device=device)
    torch.library.opcheck(state_scan_op.op, (local.requires_grad_(), decay.requires_grad_(), first))
    states = state_scan_op(local.detach(), decay.detach(), first)
    torch.library.opcheck(state_scan_backward_op.op, (decay.detach(), first, states, torch.randn_like(states)))


# ---- the intra-chunk kernels against torch ----------------------------------------------------------------


def intra_inputs(g, h, groups, nc, c, p, n, device):
    x = torch.randn(h, nc, c, p, generator=g)
    a = -torch.rand(h, nc, c, generator=g) * 2
    b, cm = (torch.randn(groups, nc, c, n, generator=g) for _ in range(2))
    return [v.to(device) for v in (x, a, b, cm)]


def intra_torch(x, a, b, cm):
    """The intra-chunk formulas in torch (heads share their group's B and C): y, local, decay."""
    h, nc, c, _ = x.shape
    hb, hc = (v.repeat_interleave(h // b.shape[0], 0) for v in (b, cm))  # [H, NC, C, N]
    seg = torch.stack([a[..., j + 1 : i + 1].sum(-1) for i in range(c) for j in range(c)], -1).view(h, nc, c, c)
    lower = torch.ones(c, c, device=x.device, dtype=torch.bool).tril()
    return (
        ((hc @ hb.transpose(-1, -2)) * seg.masked_fill(~lower, float("-inf")).exp()) @ x,
        (x * seg[..., -1, :, None].exp()).transpose(-1, -2) @ hb,
        a.sum(-1).exp(),
    )


# (heads, groups, chunks, chunk, head width, state width, head slices): 6 heads per group in 4 slices run as 3
INTRA_SHAPES = [
    (4, 2, 3, 16, 8, 24, None),
    (1, 1, 2, 5, 7, 3, None),
    (2, 1, 2, 64, 40, 70, None),
    (12, 2, 2, 8, 5, 6, 4),
    (6, 3, 3, 4, 3, 5, 2),
]


@pytest.mark.parametrize("h, groups, nc, c, p, n, slices", INTRA_SHAPES)
def test_intra_forward_matches_torch(device, rng, h, groups, nc, c, p, n, slices):
    """y within the chunk, the state each chunk leaves from zero and its decay, fp32, against the torch formulas,
    with a group's heads in one or several programs."""
    from fastft.kernels import ssd as kernels

    x, a, b, cm = intra_inputs(rng, h, groups, nc, c, p, n, device)
    got = kernels.intra_forward(x, a, b, cm, head_slices=slices)
    for name, u, e in zip(("y", "local", "decay"), got, intra_torch(x, a, b, cm)):
        assert u.shape == e.shape and u.dtype == torch.float32
        assert_close_to(u, e, name)


@pytest.mark.parametrize("h, groups, nc, c, p, n, slices", INTRA_SHAPES)
def test_intra_backward_matches_autograd(device, rng, h, groups, nc, c, p, n, slices):
    """Every gradient of the intra-chunk part (B and C summed over their group's heads, across programs when the
    heads are sliced), with the log decays' share through ``cum``, against autograd of the torch formulas."""
    from fastft.kernels import ssd as kernels

    inputs = [v.requires_grad_() for v in intra_inputs(rng, h, groups, nc, c, p, n, device)]
    outs = (*intra_torch(*inputs), inputs[1].cumsum(-1))
    grads = [torch.randn(v.shape, generator=rng).to(device) for v in outs]
    want = torch.autograd.grad(outs, inputs, grads)
    got = kernels.intra_backward(*(v.detach() for v in inputs), *grads, head_slices=slices)
    for name, u, e in zip(
        ("dx", "da", "db", "dc"), (got[0], got[3], got[1], got[2]), (want[0], want[1], want[2], want[3])
    ):
        assert u.shape == e.shape and u.dtype == torch.float32, name
        assert_close_to(u, e, name)


def test_intra_backward_keeps_a_small_log_decay_gradient_beside_a_large_token(device, rng):
    """da_k sums terms of the tokens before k (and of the pairs across k): a token whose own terms are a thousand
    times the others' leaves its da as accurate as any other (a sum before k formed as a cumulative sum less the
    k-th term loses the small sum to the large term's rounding). One chunk of 16, its last token large, against
    autograd in fp64."""
    from fastft.kernels import ssd as kernels

    x, a, b, cm = intra_inputs(rng, 2, 1, 1, 16, 4, 8, device)
    x[:, :, -1] *= 1e3
    inputs = [v.double().cpu().requires_grad_() for v in (x, a, b, cm)]
    outs = (*intra_torch(*inputs), inputs[1].cumsum(-1))
    grads = [torch.randn(v.shape, generator=rng, dtype=torch.float64) for v in outs]
    want = torch.autograd.grad(outs, inputs, grads)[1]
    da = kernels.intra_backward(x, a, b, cm, *(g.float().to(device) for g in grads))[3]
    assert_close_to(da.cpu(), want, "da")


@pytest.mark.parametrize("h, groups, nc, c, p, n, slices", [INTRA_SHAPES[0], INTRA_SHAPES[2], INTRA_SHAPES[3]])
def test_kernels_with_b_and_c_exact_in_tf32(device, rng, h, groups, nc, c, p, n, slices):
    """B and C rounded to bf16 (as the op's 16-bit inputs reach the kernels): with ``bc_exact`` their products
    skip 3xTF32's split. Every output of the intra-chunk and output kernels, forward and backward, against the torch
    formulas as tightly as without it, and within 1e-6 of the kernels without it."""
    from fastft.kernels import ssd as kernels

    x, a, b, cm = intra_inputs(rng, h, groups, nc, c, p, n, device)
    b, cm = (v.bfloat16().float() for v in (b, cm))
    states = torch.randn(h, nc, p, n, generator=rng).to(device)
    grads = [torch.randn(v.shape, generator=rng).to(device) for v in (x, states, a, a, x)]  # dy, dlocal, ...

    def run(exact):
        kw = dict(head_slices=slices, bc_exact=exact)
        y, local, decay = kernels.intra_forward(x, a, b, cm, **kw)
        out = kernels.output_forward(y, a, cm, states, bc_exact=exact)
        back = kernels.intra_backward(x, a, b, cm, grads[0], grads[1], grads[2][..., 0], grads[3], **kw)
        return (y, local, decay, out, *back, *kernels.output_backward(grads[4], a, cm, states, **kw))

    names = ("y", "local", "decay", "out", "dx", "db", "dc", "da", "dcum", "dstates", "dc_out")
    fast, full = run(True), run(False)
    inputs = [v.detach().requires_grad_() for v in (x, a, b, cm)]
    outs = (*intra_torch(*inputs), inputs[1].cumsum(-1))
    want_back = torch.autograd.grad(outs, inputs, [grads[0], grads[1], grads[2][..., 0], grads[3]])
    want_out = output_torch(fast[0], a, cm, states, grads[4])
    want = (*outs[:3], want_out[0], want_back[0], want_back[2], want_back[3], want_back[1], *want_out[1:])
    for name, u, e, f in zip(names, fast, want, full):
        assert u.shape == e.shape and u.dtype == torch.float32, name
        assert_close_to(u, e, name)
        err, top = (u - f).abs().max().item(), f.abs().max().item()
        assert err <= 1e-6 * top + 1e-7, f"{name}: {err:.3g} from the 3xTF32 kernels (largest {top:.3g})"


@pytest.mark.parametrize("p, n, c", [(40, 72, 16), (8, 130, 64)])
def test_intra_widths_and_groups(device, rng, p, n, c):
    """The op on its Triton intra-chunk path with head and state widths that are no power of two, and groups of
    heads, against the token loop (forward and every gradient)."""
    lengths = [37, 1, 70, 20]
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    check_against_reference(info, random_inputs(rng, 1, sum(lengths), 4, p, 2, n, device), c, "triton")


def test_backward_under_autocast_stays_fp32(device, rng):
    """The Triton path's written-out backward run inside an autocast region computes the same fp32 gradients as
    outside it."""
    info = fastft.packed_seq_info(seq_lengths=[5, 11], device=device)
    x, dt, A, B, C, *_ = random_inputs(rng, 1, 16, 2, 3, 1, 4, device)
    inputs = (x, dt, A, B, C)
    want = torch.autograd.grad(packed_ssd_scan(*inputs, info, chunk_size=4, backend="triton").sum(), inputs)
    out = packed_ssd_scan(*inputs, info, chunk_size=4, backend="triton")
    with torch.autocast(device.type, dtype=torch.bfloat16):
        got = torch.autograd.grad(out.sum(), inputs)
    for name, a, e in zip(NAMES, got, want):
        assert a.dtype == torch.float32 and torch.equal(a, e), name


def test_intra_ops_pass_opcheck(device, rng):
    x, a, b, cm = intra_inputs(rng, 2, 1, 2, 4, 3, 5, device)
    for exact in (False, True):
        torch.library.opcheck(intra_forward_op.op, (x, a, b, cm, exact))
    y, local, decay = intra_forward_op(x, a, b, cm, False)
    grads = [torch.randn(v.shape, generator=rng).to(device) for v in (y, local, decay, a)]
    for exact in (False, True):
        torch.library.opcheck(intra_backward_op.op, (x, a, b, cm, *grads, exact))


def output_torch(y, a, cm, states, dy):
    """The output's share from each chunk's entering state as the Triton path computed it in torch: the output
    and, for its gradient dy, (dcum, dstates, dc)."""
    h, nc, c, p = y.shape
    g, n = cm.shape[0], cm.shape[-1]
    cum = a.cumsum(-1)
    states_g = states.view(g, h // g, nc, p, n)
    off = cm.unsqueeze(1) @ states_g.transpose(-1, -2)  # [G, H/G, NC, C, P]
    out = (y.view(off.shape) + off * cum.exp().view(*off.shape[:-1], 1)).view(h, nc, c, p)
    dye = dy.view(g, h // g, nc, c, p) * cum.exp().view(g, h // g, nc, c, 1)
    dcum = (dye * off).sum(-1).view(h, nc, c)
    dstates = (dye.transpose(-1, -2) @ cm.unsqueeze(1)).view(h, nc, p, n)
    return out, dcum, dstates, torch.einsum("ghkcp,ghkpn->gkcn", dye, states_g)


# (heads, groups, chunks, chunk, head width, state width, head slices): P and N past a block of 32 and not
# multiples of it; chunks no power of two and partly empty
OUTPUT_SHAPES = [
    (4, 2, 3, 5, 7, 40, None),
    (6, 2, 2, 12, 70, 33, 2),
    (2, 1, 2, 64, 64, 128, None),
    (3, 1, 1, 3, 130, 6, 3),
]


@pytest.mark.parametrize("h, groups, nc, c, p, n, slices", OUTPUT_SHAPES)
def test_output_kernels_match_torch(device, rng, h, groups, nc, c, p, n, slices):
    """The output's share from the entering states and its backward (C's gradient summed over the group's heads,
    across programs when the heads are sliced), fp32, against the torch expressions."""
    from fastft.kernels import ssd as kernels

    filled = (torch.arange(c) < c - c // 3).to(device)  # the chunks' last slots empty (zeros)
    y, dy = (torch.randn(h, nc, c, p, generator=rng).to(device) * filled[:, None] for _ in range(2))
    cm = torch.randn(groups, nc, c, n, generator=rng).to(device) * filled[:, None]
    a = -torch.rand(h, nc, c, generator=rng).to(device) * 2 * filled
    states = torch.randn(h, nc, p, n, generator=rng).to(device)
    got = (kernels.output_forward(y, a, cm, states), *kernels.output_backward(dy, a, cm, states, head_slices=slices))
    for name, u, e in zip(("y", "dcum", "dstates", "dc"), got, output_torch(y, a, cm, states, dy)):
        assert u.shape == e.shape and u.dtype == torch.float32, name
        assert_close_to(u, e, name)


def test_output_ops_pass_opcheck(device, rng):
    h, nc, c, p, n = 4, 2, 3, 5, 6
    y, dy = (torch.randn(h, nc, c, p, generator=rng).to(device) for _ in range(2))
    a = -torch.rand(h, nc, c, generator=rng).to(device)
    cm, states = torch.randn(2, nc, c, n, generator=rng).to(device), torch.randn(h, nc, p, n, generator=rng).to(device)
    for exact in (False, True):
        torch.library.opcheck(output_forward_op.op, (y, a, cm, states, exact))
        torch.library.opcheck(output_backward_op.op, (dy, a, cm, states, exact))


# ---- the tokens into the slots and back (the Triton path's glue) against the torch path's ------------------------


def glue_inputs(g, lengths, c, h, p, dtype, device):
    """The chunk table of documents that leave slots empty, x ``[N, H, P]`` in ``dtype`` as a strided view (heads
    and tokens further apart than P), the discretized step ``[N, H]`` and A ``[H]``."""
    table = chunk_table(fastft.packed_seq_info(seq_lengths=lengths, device=device), c)
    n = sum(lengths)
    x = torch.randn(n, h, p + 3, generator=g).to(device, dtype)[..., :p]
    step = torch.rand(n, h, generator=g).to(device) * 2
    A = -(torch.rand(h, generator=g) * 1.9 + 0.1)
    return table, x, step, A.to(device)


def slots_torch(v, table):
    """``[N, K, D]`` -> ``[K, NC, C, D]``, zeros in the empty slots: the torch path's gather."""
    nc, c = table.token_index.shape
    slots = v.new_zeros(v.shape[1], nc * c, v.shape[-1])
    return slots.index_copy(1, table.slot, v.transpose(0, 1)).view(v.shape[1], nc, c, -1)


def assert_rounded_close(actual, expected, what):
    """``actual`` (in its dtype) against the fp32 ``expected`` rounded once to that dtype."""
    assert actual.dtype == expected.dtype or expected.dtype == torch.float32, what
    if actual.dtype == torch.float32:
        assert_close_to(actual, expected, what)
    else:
        torch.testing.assert_close(actual, expected.to(actual.dtype), msg=what)


GLUE_LENGTHS = ([37, 1, 20, 13], 8)  # 71 tokens in 11 chunks of 8: 17 empty slots, two blocks of rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("skip", [False, True])
def test_pack_kernels_match_torch(device, rng, dtype, skip):
    """x * step and step * A into the slots (0 in the empty ones) and their backward (dx with another fp32 share
    added before the one rounding to x's dtype), against the torch path's gather and its autograd."""
    from fastft.kernels import ssd as kernels

    lengths, c = GLUE_LENGTHS
    h, p = 3, 5
    table, x, step, A = glue_inputs(rng, lengths, c, h, p, dtype, device)
    xf, step, A = (v.float().requires_grad_() for v in (x, step, A))
    want = (slots_torch(xf * step[..., None], table), slots_torch((step * A)[..., None], table).squeeze(-1))
    got = kernels.pack_forward(x, step.detach(), A.detach(), table.token_index)
    for name, u, e in zip(("x_dt", "a"), got, want):
        assert u.shape == e.shape and u.dtype == torch.float32, name
        assert_close_to(u, e, name)
    dxdt, da = (torch.randn(v.shape, generator=rng).to(device) for v in want)  # nonzero in the empty slots too
    dskip = torch.randn(x.shape, generator=rng).to(device) if skip else None
    want = list(torch.autograd.grad(want, (xf, step, A), (dxdt, da)))
    if skip:
        want[0] = want[0] + dskip
    got = kernels.pack_backward(x, step.detach(), A.detach(), table.slot, dxdt, da, dskip)
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32 and got[3].numel() == 0
    for name, u, e in zip(("dx", "dstep", "dA"), got, want):
        assert u.shape == e.shape, name
        assert_rounded_close(u, e, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ns", [5, 40])
def test_bc_pack_kernels_match_torch(device, rng, dtype, ns):
    """B and C into the slots (fp32, 0 in the empty ones) and their gradients back, each in its input's dtype,
    against the torch path's gather (exact: a copy) and its autograd (one rounding); strided rows of two groups;
    states past one block of 16 rows' columns."""
    from fastft.kernels import ssd as kernels

    lengths, c = GLUE_LENGTHS
    table, *_ = glue_inputs(rng, lengths, c, 2, 3, dtype, device)
    n, g = sum(lengths), 2
    B = torch.randn(n, g, ns + 3, generator=rng).to(device, dtype)[..., :ns]
    C = torch.randn(n, g, ns, generator=rng).to(device, torch.float16)  # each in its own dtype
    inputs = [v.detach().float().requires_grad_() for v in (B, C)]
    want = [slots_torch(v, table) for v in inputs]
    got = kernels.bc_pack_forward(B, C, table.token_index)
    for name, u, e in zip(("b", "c"), got, want):
        assert u.shape == e.shape and u.dtype == torch.float32 and torch.equal(u, e), name
    grads = [torch.randn(v.shape, generator=rng).to(device) for v in want]  # nonzero in the empty slots too
    want = torch.autograd.grad(want, inputs, grads)
    got = kernels.bc_pack_backward(*grads, table.slot, B.dtype, C.dtype)
    for name, u, e, v in zip(("dB", "dC"), got, want, (B, C)):
        assert u.shape == v.shape and u.dtype == v.dtype and u.is_contiguous(), name
        if device.type == "cuda" or u.dtype == torch.float32:
            assert torch.equal(u, e.to(u.dtype)), name
        else:  # Triton's interpreter rounds fp32 to 16 bits toward zero
            torch.testing.assert_close(u, e.to(u.dtype), msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "bias, softplus, limit",
    [
        (True, True, (0.0, math.inf)),
        (False, True, (0.05, 0.6)),
        (True, False, (-0.3, 0.4)),
        (False, False, (0.0, math.inf)),
    ],
)
def test_pack_kernels_discretize_as_the_reference(device, rng, dtype, bias, softplus, limit):
    """The step discretized inside the tokens' pass (``dt + dt_bias``, softplus with its threshold at 20, the
    clamp) and its gradient inside the pass back, against ``reference.ssd.discretize`` and its autograd: dt in
    its own dtype (the gradient rounded once to it), values past softplus's threshold, far below 0 (its log1p)
    and clamped at either end."""
    from fastft.kernels import ssd as kernels

    lengths, c = GLUE_LENGTHS
    h, p = 3, 5
    table, x, _, A = glue_inputs(rng, lengths, c, h, p, torch.float32, device)
    n = x.shape[0]
    dt = (torch.randn(n, h, generator=rng) * 4).to(device, dtype)
    dt[:4] = torch.tensor([25.0, 20.5, -30.0, -12.0], device=device, dtype=dtype)[:, None]
    dt_bias = (torch.randn(h, generator=rng) * 0.5).to(device).requires_grad_() if bias else None
    leaves = [v for v in (dt.float().requires_grad_(), A.clone().requires_grad_(), dt_bias) if v is not None]
    step = reference.discretize(leaves[0], dt_bias, softplus, limit)
    want = (slots_torch(x * step[..., None], table), slots_torch((step * leaves[1])[..., None], table).squeeze(-1))
    args = (dt_bias if dt_bias is None else dt_bias.detach(), softplus, limit)
    got = kernels.pack_forward(x, dt, A, table.token_index, *args)
    for name, u, e in zip(("x_dt", "a"), got, want):
        assert_close_to(u, e, name)
    dxdt, da = (torch.randn(v.shape, generator=rng).to(device) for v in want)
    want = torch.autograd.grad(want, leaves, (dxdt, da))
    dx, ddt, dA, dbias = kernels.pack_backward(x, dt, A, table.slot, dxdt, da, None, *args)
    assert ddt.dtype == dtype and dbias.numel() == (h if bias else 0)
    assert_rounded_close(ddt, want[0], "ddt")
    assert_close_to(dA, want[1], "dA")
    if bias:
        assert_close_to(dbias, want[2], "ddt_bias")


def unpack_torch(y, x, slot, D, z):
    """The torch path's glue after the scan: ``(y[slot] + D x) * silu(z)`` in fp32, rounded to x's dtype."""
    h, p = x.shape[1:]
    out = y.reshape(h, -1, p).transpose(0, 1).index_select(0, slot)
    if D is not None:
        out = out + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        out = out * F.silu(z)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skip", [None, "head", "channel"])
@pytest.mark.parametrize("gate", [False, True])
def test_unpack_kernels_match_torch(device, rng, dtype, skip, gate):
    """The slots back to the tokens with D ([H], [H, P] or None) and the gate z (or None), and the backward: y's
    gradient in the slots (0 in the empty ones), D's share of x's gradient (fp32), dD and dz, against the torch
    path's glue and its autograd."""
    from fastft.kernels import ssd as kernels

    lengths, c = GLUE_LENGTHS
    h, p = 3, 5
    table, x, *_ = glue_inputs(rng, lengths, c, h, p, dtype, device)
    n, nc = x.shape[0], table.num_chunks_bound
    y = torch.randn(h, nc, c, p, generator=rng).to(device)
    D = {None: None, "head": torch.randn(h, generator=rng), "channel": torch.randn(h, p, generator=rng)}[skip]
    D = None if D is None else D.to(device)
    z = torch.randn(n, h, p + 1, generator=rng).to(device, dtype)[..., :p] if gate else None
    inputs = [v if v is None else v.float().requires_grad_() for v in (y, x, D, z)]
    want = unpack_torch(*inputs[:2], table.slot, *inputs[2:])
    got = kernels.unpack_forward(y, x, table.slot, D, z)
    assert got.shape == want.shape and got.dtype == dtype
    assert_rounded_close(got, want, "out")

    dout = torch.randn(n, h, p + 2, generator=rng).to(device, dtype)[..., :p]
    used = [v for v in inputs if v is not None]
    grads = iter(torch.autograd.grad(want, used, dout.float(), allow_unused=True))
    want = [None if v is None else next(grads) for v in inputs]  # x's: None without D (read for the skip only)
    got = kernels.unpack_backward(dout, y if gate else None, x, table.token_index, D, z)
    assert (got[0].view(h, -1, p)[:, table.token_index.view(-1) == n] == 0).all()  # the empty slots
    for name, u, e, kind in zip(("dy", "dx", "dD", "dz"), got, want, (torch.float32,) * 3 + (dtype,)):
        if e is None:
            assert u.numel() == 0, name
            continue
        assert u.shape == e.shape and u.dtype == kind, name
        assert_rounded_close(u, e, name)


def test_glue_ops_pass_opcheck(device, rng):
    table, x, step, A = glue_inputs(rng, [5, 2], 4, 2, 3, torch.bfloat16, device)
    n, h, p = x.shape
    x = x.contiguous()
    bias = torch.randn(h, generator=rng).to(device)
    for dt_bias, softplus in ((None, False), (bias, True)):
        torch.library.opcheck(pack_forward_op.op, (x, step, A, table.token_index, dt_bias, softplus, 0.0, math.inf))
    x_dt, a = pack_forward_op(x, step, A, table.token_index, bias, True, 0.0, 1.0)
    dskip = torch.randn(x.shape, generator=rng).to(device)
    for skip, dt_bias in ((None, None), (dskip, bias)):
        args = (x, step, A, table.slot, torch.randn_like(x_dt), a, skip, dt_bias, True, 0.0, 1.0)
        torch.library.opcheck(pack_backward_op.op, args)
    z = torch.randn(x.shape, generator=rng).to(device, x.dtype)
    for D, gate in ((torch.randn(h, generator=rng).to(device), z), (None, None)):
        torch.library.opcheck(unpack_forward_op.op, (x_dt, x, table.slot, D, gate))
        dout = torch.randn(x.shape, generator=rng).to(device, x.dtype)
        torch.library.opcheck(unpack_backward_op.op, (dout, x_dt, x, table.token_index, D, gate))
    B, C = (torch.randn(n, 2, 4, generator=rng).to(device, torch.bfloat16) for _ in range(2))
    torch.library.opcheck(bc_pack_forward_op.op, (B, C, table.token_index))
    db, dc = (torch.randn(v.shape, generator=rng).to(device) for v in bc_pack_forward_op(B, C, table.token_index))
    torch.library.opcheck(bc_pack_backward_op.op, (db, dc, table.slot, torch.bfloat16, torch.float32))


def test_glue_kernels_refuse_mismatched_shapes(device, rng):
    from fastft.kernels import ssd as kernels

    table, x, step, A = glue_inputs(rng, [5, 2], 4, 2, 3, torch.float32, device)
    with pytest.raises(ValueError, match=r"dt must be \[N, H\]"):
        kernels.pack_forward(x, step[:, :1], A, table.token_index)
    with pytest.raises(ValueError, match=r"A must be \[H\]"):
        kernels.pack_forward(x, step, A[:1], table.token_index)
    x_dt, a = kernels.pack_forward(x, step, A, table.token_index)
    with pytest.raises(ValueError, match=r"da must be \[H, NC, C\]"):
        kernels.pack_backward(x, step, A, table.slot, x_dt, a[:, :1])
    with pytest.raises(ValueError, match=r"y must be \[H, NC, C, P\]"):
        kernels.unpack_forward(x_dt[..., :2], x, table.slot)
    with pytest.raises(ValueError, match=r"D must be \[H\]"):
        kernels.unpack_forward(x_dt, x, table.slot, D=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="y must be given with z"):
        kernels.unpack_backward(x, None, x, table.token_index, None, x)
    with pytest.raises(ValueError, match=r"B and C must be \[N, G, NS\] alike"):
        kernels.bc_pack_forward(x, x[:, :1], table.token_index)
    b, c = kernels.bc_pack_forward(x, x, table.token_index)
    with pytest.raises(ValueError, match=r"db and dc must be \[G, NC, C, NS\] alike"):
        kernels.bc_pack_backward(b, c[..., :1], table.slot, x.dtype, x.dtype)


# ---- transformers' implementation, one document at a time -------------------------------------------------


@pytest.mark.parametrize("family", ["bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "zamba2"])
def test_matches_transformers_on_each_document(device, rng, family):
    """transformers' torch ``mamba2_chunk_scan`` of each Mamba-2 family, run on each document alone (chunk 16,
    so that documents span chunks), against the reference and both backends on the packed row."""
    module = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    theirs = inspect.unwrap(module.mamba2_chunk_scan)  # the torch function, not mamba_ssm's kernel
    lengths = [20, 1, 16, 5]
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    x, dt, A, B, C, D, dt_bias, _ = random_inputs(rng, 1, sum(lengths), 4, 3, 2, 4, device)
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, 1.5))
    ours = [reference.ssd_scan(x, dt, A, B, C, info.position_ids, **kw)]
    ours += [packed_ssd_scan(x, dt, A, B, C, info, backend=backend, **kw) for backend in BACKENDS]
    start = 0
    for n in lengths:
        doc = (v[:, start : start + n] for v in (x, dt))
        bc = (v[:, start : start + n] for v in (B, C))
        expected = theirs(*doc, A, *bc, chunk_size=16, **kw)
        for name, out in zip(["reference", *BACKENDS], ours):
            assert_close_to(out[:, start : start + n], expected, f"{name}, document at {start}")
        start += n


# ---- validation ------------------------------------------------------------------------------------------


def _args(**changes):
    b, t, h = 1, 6, 2
    args = dict(
        x=torch.zeros(b, t, h, 4),
        dt=torch.zeros(b, t, h),
        A=torch.zeros(h),
        B=torch.zeros(b, t, 1, 3),
        C=torch.zeros(b, t, 1, 3),
        info=fastft.packed_seq_info(seq_lengths=[2, 4]),
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(x=[0.0]), TypeError, "x must be a tensor"),
        (dict(x=torch.zeros(1, 6, 8)), ValueError, r"x must be \[B, T, H, P\]"),
        (dict(x=torch.zeros(1, 6, 2, 0)), ValueError, r"x must be \[B, T, H, P\] with H, P >= 1"),
        (dict(dt=torch.zeros(1, 6, 3)), ValueError, r"dt must be \[B, T, H\]"),
        (dict(dt=torch.zeros(1, 6, 2, dtype=torch.int64)), ValueError, "dt must have a floating dtype"),
        (dict(A=torch.zeros(2, 1)), ValueError, r"A must be \[H\]"),
        (dict(B=torch.zeros(1, 6, 3, 3), C=torch.zeros(1, 6, 3, 3)), ValueError, "G dividing H"),
        (dict(B=torch.zeros(1, 5, 1, 3)), ValueError, r"B must be \[B, T, G, N\]"),
        (dict(C=torch.zeros(1, 6, 1, 4)), ValueError, "C must be B's shape"),
        (dict(D=torch.zeros(3)), ValueError, r"D must be \[H\]"),
        (dict(dt_bias=torch.zeros(2, 4)), ValueError, r"dt_bias must be \[H\]"),
        (dict(z=torch.zeros(1, 6, 2, 3)), ValueError, "z must be x's shape"),
        (dict(dt_softplus=1), TypeError, "dt_softplus must be True or False"),
        (dict(dt_limit=0.5), TypeError, "dt_limit must be a"),
        (dict(dt_limit=("0", 1)), TypeError, "dt_limit must be a number"),
        (dict(dt_limit=(1.0, 0.5)), ValueError, "dt_limit must have low <= high"),
        (dict(info=torch.arange(6)), TypeError, "info must be a fastft.PackedSeqInfo"),
        (dict(info=fastft.packed_seq_info(seq_lengths=[2, 5])), ValueError, "info has 7 tokens but x has B . T = 6"),
        (dict(chunk_size=0), ValueError, "chunk_size must be an int >= 1"),
        (dict(chunk_size=512), ValueError, "chunk_size must be an int from 1 to 256"),
        (dict(chunk_size=16.0), TypeError, "chunk_size must be an int"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
    ],
)
def test_bad_input(changes, error, match):
    with pytest.raises(error, match=match):
        packed_ssd_scan(**_args(**changes))


def test_backend_choice(device, monkeypatch):
    """Triton wherever it runs (CUDA, the interpreter), as for every op; FASTFT_BACKEND and backend= choose."""
    monkeypatch.delenv("FASTFT_BACKEND", raising=False)
    assert dispatch.backend_for(OP_SCAN, device) == "triton"
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    assert dispatch.backend_for(OP_SCAN, device) == "torch"
    assert dispatch.backend_for(OP_SCAN, device, "triton") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter: Triton cannot run them
    with pytest.raises(ValueError, match="backend='triton' cannot run ssd.state_scan on device cpu"):
        packed_ssd_scan(**_args(), backend="triton")


# ---- GPU: real sizes -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("per_element", [False, True])
def test_triton_state_scan_real_sizes(rng, per_element):
    """The Triton scan, forward and backward, at Nemotron-H's 128 heads of 64 x 128 over 129 chunks, fp32,
    against the torch loop."""
    device = torch.device("cuda")
    h, nc, e = 128, 129, 64 * 128
    local = torch.randn(h, nc, e, generator=rng).to(device).requires_grad_()
    decay = torch.rand((h, nc, e) if per_element else (h, nc), generator=rng).to(device).requires_grad_()
    first = (torch.arange(nc) % 17 == 0).to(device)
    dstates = torch.randn(h, nc, e, generator=rng).to(device)
    want = scan_states(local, decay, first)
    want = [want, *torch.autograd.grad(want, (local, decay), dstates)]
    got = state_scan_op(local, decay, first)
    got = [got, *torch.autograd.grad(got, (local, decay), dstates)]
    for name, a, b in zip(("states", "dlocal", "ddecay"), got, want):
        err, top = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= 1e-5 * top + 1e-5, f"{name}: max abs error {err:.3g}, max {top:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_sizes_bf16_against_transformers(backend):
    """Nemotron-H widths (128 heads of 64, 8 groups, state 128; its chunk of 128), T=3084 in a few documents
    (transformers' torch path materialises [chunks, C, C, H, P] products: 4 GiB per 1000-token document), bf16
    inputs: the output and every gradient against transformers' torch path run on each document alone in fp32
    on the same bf16 values; fastft's error within 2x that of transformers' own bf16 run, plus 1e-3 of the
    largest value."""
    nemotron = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    stock = inspect.unwrap(nemotron.mamba2_chunk_scan)
    device = torch.device("cuda")
    lengths = [1000, 1, 256, 700, 127, 1000]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    t = sum(lengths)
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    g = torch.Generator().manual_seed(0)
    inputs = random_inputs(g, 1, t, 128, 64, 8, 128, device, torch.bfloat16)[:7]
    for v in inputs[3:5]:
        v.data.mul_(128**-0.5)  # B, C of unit norm per token, as the model's convolution gives
    w = torch.randn(1, t, 128, 64, generator=torch.Generator().manual_seed(1)).to(device)

    def kwargs(v):
        return dict(D=v[5], dt_bias=v[6], dt_softplus=True, dt_limit=(0.0, math.inf))

    def per_doc(v):
        parts = [stock(*(u[:, s : s + n] for u in v[:2]), v[2], *(u[:, s : s + n] for u in v[3:5]), chunk_size=128,
                       **kwargs(v)) for s, n in zip(starts, lengths)]  # fmt: skip
        return torch.cat(parts, 1)

    def results(out, v):
        return [out.detach().float(), *torch.autograd.grad((out.float() * w).sum(), v)]

    ours = results(packed_ssd_scan(*inputs[:5], info, backend=backend, **kwargs(inputs)), inputs)
    theirs = results(per_doc(inputs), inputs)
    fp32 = [v.detach().float().requires_grad_() for v in inputs]
    exact = results(per_doc(fp32), fp32)
    for name, a, s, e in zip(("y", *NAMES), ours, theirs, exact):
        err, stock_err = (a.float() - e).abs().max().item(), (s.float() - e).abs().max().item()
        assert err <= 2 * stock_err + 1e-3 * e.abs().max().item(), f"{name}: {err:.3g} vs stock {stock_err:.3g}"


def test_intra_kernels_refuse_mismatched_shapes(device, rng):
    from fastft.kernels import ssd as kernels

    x, a, b, cm = intra_inputs(rng, 4, 2, 3, 8, 5, 6, device)
    with pytest.raises(ValueError, match="G dividing H"):
        kernels.intra_forward(x, a, b[:, :2], cm[:, :2])
    with pytest.raises(ValueError, match="G dividing H"):
        kernels.intra_forward(x[:3], a[:3], b, cm)
