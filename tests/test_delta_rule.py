"""fastft.delta_rule: the chunk table against a host loop; the Triton scan over chunks against the torch loop
(forward and every gradient); the op on both backends against the token-by-token reference (forward and
every gradient, fp32) and against transformers' own gated delta rule on each document run alone; the public
entry's validation and backend choice."""

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fastft
from fastft import dispatch, testing
from fastft.delta_rule import (
    OP_SCAN,
    chunk_scan_backward_op,
    chunk_scan_op,
    chunk_table,
    gated_delta_rule,
    intra_backward_op,
    intra_forward_op,
    output_backward_op,
    output_forward_op,
    pack_backward_op,
    pack_forward_op,
    pairwise,
    scan_chunks,
    unpack_backward_op,
    unpack_forward_op,
)
from fastft.reference import delta_rule as reference

# fp32: max |fast - reference| <= RTOL * max |reference| + ATOL, for the output and each gradient.
RTOL, ATOL = 1e-5, 1e-6
BACKENDS = ["torch", "triton"]


def host_chunk_table(cu_seqlens: list[int], num_tokens: int, num_seqs: int, c: int):
    """(doc, start, length, first) per chunk, padded to the bound, and each token's slot: a plain loop."""
    rows = []
    for d in range(len(cu_seqlens) - 1):
        for s in range(cu_seqlens[d], cu_seqlens[d + 1], c):
            rows.append((d, s, min(c, cu_seqlens[d + 1] - s), s == cu_seqlens[d]))
    bound = min(num_tokens, (num_tokens + num_seqs * (c - 1)) // c)
    assert len(rows) <= bound
    num_chunks = len(rows)
    rows += [(num_seqs, num_tokens, 0, False)] * (bound - len(rows))
    token_index = [[s + j if j < n else num_tokens for j in range(c)] for _, s, n, _ in rows]
    slot = [0] * num_tokens
    for i, (_, s, n, _) in enumerate(rows[:num_chunks]):
        for j in range(n):
            slot[s + j] = i * c + j
    return bound, num_chunks, rows, token_index, slot


def check_table(info, c):
    table = chunk_table(info, c)
    cu = info.cu_seqlens.tolist()
    bound, num_chunks, rows, token_index, slot = host_chunk_table(cu, info.num_tokens, info.num_seqs, c)
    assert table.chunk_size == c and table.num_chunks_bound == bound and int(table.num_chunks) == num_chunks
    assert table.doc.dtype == table.start.dtype == table.length.dtype == torch.int32 and table.first.dtype == torch.bool
    assert table.doc.tolist() == [r[0] for r in rows]
    assert table.start.tolist() == [r[1] for r in rows]
    assert table.length.tolist() == [r[2] for r in rows]
    assert table.first.tolist() == [r[3] for r in rows]
    assert table.token_index.tolist() == (token_index or torch.zeros(0, c).tolist())
    assert table.slot.tolist() == slot
    assert chunk_table(info, c) is table


@given(testing.position_ids_strategy(max_rows=3, max_tokens=80), st.sampled_from([1, 2, 3, 4, 8, 16, 64]))
def test_chunk_table_from_position_ids_matches_host_loop(device, position_ids, c):
    check_table(fastft.packed_seq_info(position_ids=position_ids.to(device)), c)


@given(testing.seq_lengths_strategy(max_tokens=120), st.sampled_from([1, 4, 5, 16, 64, 256]))
def test_chunk_table_from_lengths_matches_host_loop(device, lengths_and_tokens, c):
    lengths, num_tokens = lengths_and_tokens
    check_table(fastft.packed_seq_info(seq_lengths=lengths, num_tokens=num_tokens, device=device), c)


def test_chunk_table_worked_example():
    table = chunk_table(fastft.packed_seq_info(seq_lengths=[1, 5, 4, 8]), 4)
    assert table.num_chunks_bound == 7 and int(table.num_chunks) == 6  # (18 + 4 * 3) // 4 = 7
    assert table.doc.tolist() == [0, 1, 1, 2, 3, 3, 4]
    assert table.start.tolist() == [0, 1, 5, 6, 10, 14, 18]
    assert table.length.tolist() == [1, 4, 1, 4, 4, 4, 0]
    assert table.first.tolist() == [True, True, False, True, True, False, False]
    assert table.token_index[2].tolist() == [5, 18, 18, 18] and table.slot[:7].tolist() == [0, 4, 5, 6, 7, 8, 12]


# ---- the op against the reference ------------------------------------------------------------------------


def random_inputs(g, b, t, h, dk, dv, device, dtype=torch.float32, per_channel=False):
    """q, k, v, g (log decay in (-2, 0], one per head or, ``per_channel``, per key channel), beta."""
    q, k = (torch.randn(b, t, h, dk, generator=g) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g)
    decay = -torch.rand((b, t, h, dk) if per_channel else (b, t, h), generator=g) * 2
    beta = torch.rand(b, t, h, generator=g)
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v, decay, beta)]


def assert_close_to(actual, expected, what):
    err = (actual.float() - expected.float()).abs().max().item() if expected.numel() else 0.0
    bound = RTOL * (expected.float().abs().max().item() if expected.numel() else 0.0) + ATOL
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def check_against_reference(info, inputs, c, backend, *, scale=None, use_qk_l2norm=True):
    out = gated_delta_rule(*inputs, info, chunk_size=c, scale=scale, use_qk_l2norm=use_qk_l2norm, backend=backend)
    s = inputs[0].shape[-1] ** -0.5 if scale is None else scale
    expected = reference.gated_delta_rule(*inputs, info.position_ids, s, use_qk_l2norm)
    assert out.shape == expected.shape and out.dtype == inputs[0].dtype
    assert_close_to(out, expected, "o")
    if out.numel() == 0:
        return
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(out.numel())).to(out)  # replayable with the case
    got = torch.autograd.grad((out * w).sum(), inputs)
    want = torch.autograd.grad((expected * w).sum(), inputs)
    for name, a, e in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert_close_to(a, e, name)


def check_from_position_ids(device, position_ids, c, dims, seed, backend, per_channel):
    if position_ids.numel() == 0:
        return  # test_no_tokens
    pos = position_ids.reshape(-1, position_ids.shape[-1]).to(device)
    info = fastft.packed_seq_info(position_ids=pos)
    g = torch.Generator().manual_seed(seed)
    check_against_reference(info, random_inputs(g, *pos.shape, *dims, device, per_channel=per_channel), c, backend)


CHUNK_SIZES = st.sampled_from([1, 2, 3, 4, 8, 16])
DIMS = st.sampled_from([(1, 4, 4), (2, 8, 4), (2, 4, 8)])
PER_CHANNEL = st.booleans()  # g per head (Gated DeltaNet) or per key channel (Kimi Delta Attention)


@given(
    testing.position_ids_strategy(max_rows=3, max_tokens=24), CHUNK_SIZES, DIMS, testing.seeds_strategy(), PER_CHANNEL
)
def test_torch_matches_reference_from_position_ids(device, position_ids, c, dims, seed, per_channel):
    check_from_position_ids(device, position_ids, c, dims, seed, "torch", per_channel)


# Fewer tokens: the interpreter's scan costs milliseconds per chunk.
@given(
    testing.position_ids_strategy(max_rows=2, max_tokens=16), CHUNK_SIZES, DIMS, testing.seeds_strategy(), PER_CHANNEL
)
def test_triton_matches_reference_from_position_ids(device, position_ids, c, dims, seed, per_channel):
    check_from_position_ids(device, position_ids, c, dims, seed, "triton", per_channel)


@pytest.mark.parametrize("lengths, c", [([3, 1, 2, 7, 1], 8), ([21, 1, 9, 30, 2], 8), ([70, 1, 64, 33], 64)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_per_channel_decay_matches_reference(device, rng, lengths, c, backend):
    """Kimi Delta Attention's decay per key channel, over documents shorter and longer than a chunk."""
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    check_against_reference(info, random_inputs(rng, 1, sum(lengths), 2, 8, 4, device, per_channel=True), c, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_channel_strong_decay_stays_finite(device, rng, backend):
    """Channels that forget within a token or two (log decays to -40 a token, a chunk's total far below
    fp32's exp range) next to channels that barely decay: finite, and equal to the reference."""
    lengths = [40, 24]
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    q, k, v, g, beta = random_inputs(rng, 1, 64, 2, 8, 4, device, per_channel=True)
    with torch.no_grad():
        g[..., :4] *= 20
        g[..., 4:] *= 0.01
    check_against_reference(info, [q, k, v, g, beta], 32, backend)


def test_per_channel_strong_decay_keeps_fp32_precision():
    """An input where fp32 sums of the decays lost their small differences: the chunked form was 1.6e-5 off the
    reference (relative to the output's largest value); it sums the decays in fp64 and is now as close as the
    reference's own fp32 recurrence (2.5e-7)."""
    info = fastft.packed_seq_info(seq_lengths=[40, 24])
    q, k, v, g, beta = random_inputs(torch.Generator().manual_seed(2549099682), 1, 64, 2, 8, 4, "cpu", per_channel=True)
    with torch.no_grad():
        g[..., :4] *= 20
        g[..., 4:] *= 0.01
        out = gated_delta_rule(q, k, v, g, beta, info, chunk_size=32, backend="torch")
        expected = reference.gated_delta_rule(q, k, v, g, beta, info.position_ids, 8**-0.5, True)
    assert (out - expected).abs().max() <= 2e-6 * expected.abs().max()


@pytest.mark.parametrize("c", [1, 2, 3, 5, 8, 16])
def test_pairwise_matches_direct_sum(rng, c):
    """``pairwise`` against the sum it stands for, in fp64, with decays strong enough that a factorization
    through one reference point per chunk would overflow."""
    a, b = (torch.randn(3, c, 6, generator=rng, dtype=torch.float64) for _ in range(2))
    cum = -(torch.rand(3, c, 6, generator=rng, dtype=torch.float64) * 200).cumsum(-2)
    direct = (a[:, :, None] * b[:, None] * (cum[:, :, None] - cum[:, None]).clamp(max=0).exp()).sum(-1).tril()
    got = pairwise(a, b, cum)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, direct, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize(
    "lengths, c",
    [
        ([1, 1, 1, 1, 1], 4),  # 1-token documents
        ([3, 1, 2, 7, 1], 8),  # all shorter than a chunk
        ([8, 8, 16, 8], 8),  # exactly chunk-length documents (and two chunks)
        ([21, 1, 9, 30, 2], 8),  # longer than a chunk, ends mid-chunk
        ([70, 1, 64, 33], 64),  # the model's chunk size
        ([70, 1, 150, 33], 128),  # past the Triton intra-chunk kernels' 64: that part in torch
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_matches_reference_edge_lengths(device, rng, lengths, c, backend):
    t = sum(lengths)
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    check_against_reference(info, random_inputs(rng, 1, t, 2, 8, 8, device), c, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_with_position_ids_and_options(device, rng, backend):
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2], [7, 8, 9, 0, 1, 2, 3, 4, 5]], device=device)  # row 2: a tail
    info = fastft.packed_seq_info(position_ids=pos)
    inputs = random_inputs(rng, 2, 9, 3, 4, 6, device)
    check_against_reference(info, inputs, 4, backend, scale=0.3, use_qk_l2norm=False)
    # Host lengths over B * T tokens in flat order: here one document per row, in 2 rows of 12.
    info = fastft.packed_seq_info(seq_lengths=[12, 12], device=device)
    check_against_reference(info, random_inputs(rng, 2, 12, 2, 4, 4, device), 8, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_documents_do_not_leak(device, rng, backend):
    """A document's output is the same whatever precedes it in the row."""
    q, k, v, g, beta = random_inputs(rng, 1, 30, 2, 8, 8, device)
    info = fastft.packed_seq_info(seq_lengths=[13, 17], device=device)
    packed = gated_delta_rule(q, k, v, g, beta, info, backend=backend)
    alone = gated_delta_rule(
        *(x[:, 13:] for x in (q, k, v, g, beta)), fastft.packed_seq_info(seq_lengths=[17], device=device)
    )
    assert_close_to(packed[:, 13:], alone, "second document")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs_and_autocast(device, rng, backend):
    info = fastft.packed_seq_info(seq_lengths=[5, 11], device=device)
    inputs = random_inputs(rng, 1, 16, 2, 8, 8, device)
    low = [x.detach().bfloat16() for x in inputs]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = gated_delta_rule(*low, info, chunk_size=4, backend=backend)
    assert out.dtype == torch.bfloat16
    expected = reference.gated_delta_rule(*(x.float() for x in low), info.position_ids, 8**-0.5, True)
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2**-7)


def test_backward_under_autocast_stays_fp32(device, rng):
    """The Triton path's written-out backward run inside an autocast region (a training loop that calls backward
    there) computes the same fp32 gradients as outside it. (The torch backend's backward is PyTorch's own ops',
    which autocast does reach there.)"""
    backend = "triton"
    info = fastft.packed_seq_info(seq_lengths=[5, 11], device=device)
    inputs = random_inputs(rng, 1, 16, 2, 8, 8, device)
    want = torch.autograd.grad(gated_delta_rule(*inputs, info, chunk_size=4, backend=backend).sum(), inputs)
    out = gated_delta_rule(*inputs, info, chunk_size=4, backend=backend)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        got = torch.autograd.grad(out.sum(), inputs)
    for name, a, e in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert a.dtype == torch.float32 and torch.equal(a, e), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_works_under_checkpoint(device, rng, backend):
    info = fastft.packed_seq_info(seq_lengths=[6, 10], device=device)
    inputs = random_inputs(rng, 1, 16, 2, 4, 4, device)
    gated_delta_rule(*inputs, info, chunk_size=4, backend=backend).square().sum().backward()
    plain = [x.grad.clone() for x in inputs]
    for reentrant in (False, True):
        for x in inputs:
            x.grad = None
        out = torch.utils.checkpoint.checkpoint(
            lambda *x: gated_delta_rule(*x, info, chunk_size=4, backend=backend), *inputs, use_reentrant=reentrant
        )
        out.square().sum().backward()
        for x, e in zip(inputs, plain):
            torch.testing.assert_close(x.grad, e, rtol=0, atol=0)


@pytest.mark.gpu  # no_host_sync checks nothing without CUDA
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync_from_host_lengths(device, rng, backend):
    info = fastft.packed_seq_info(seq_lengths=[9, 1, 20, 2], device=device)
    inputs = random_inputs(rng, 1, 32, 2, 8, 8, device)
    with testing.no_host_sync():
        out = gated_delta_rule(*inputs, info, chunk_size=8, backend=backend)
        torch.autograd.grad(out.sum(), inputs)


@pytest.mark.gpu  # no_host_sync checks nothing without CUDA
@pytest.mark.parametrize("backend", BACKENDS)
def test_device_position_ids_sync_once_for_num_seqs(device, rng, backend):
    pos = testing.random_position_ids(rng, 2, 16, 7).to(device)
    info = fastft.packed_seq_info(position_ids=pos)
    assert info.num_seqs > 0  # the one sync a PackedSeqInfo from device position ids makes; the op makes none
    inputs = random_inputs(rng, 2, 16, 2, 4, 4, device)
    with testing.no_host_sync():
        out = gated_delta_rule(*inputs, info, chunk_size=4, backend=backend)
        torch.autograd.grad(out.sum(), inputs)


def test_no_tokens(device):
    info = fastft.packed_seq_info(seq_lengths=[], device=device)
    out = gated_delta_rule(
        *(torch.zeros(1, 0, 2, 4, device=device) for _ in range(3)),
        *(torch.zeros(1, 0, 2, device=device) for _ in range(2)),
        info,
    )
    assert out.shape == (1, 0, 2, 4)
    assert chunk_table(info, 16).num_chunks_bound == 0


# ---- the Triton scan over chunks against the torch loop ---------------------------------------------------


def scan_inputs(g, h, nc, c, dk, dv, device, scale=0.3, per_channel=False):
    w, kd = (torch.randn(h, nc, c, dk, generator=g) * scale for _ in range(2))
    u = torch.randn(h, nc, c, dv, generator=g)
    decay = torch.rand((h, nc, dk) if per_channel else (h, nc), generator=g)
    first = torch.rand(nc, generator=g) < 0.4  # documents start mid-way; the first chunk too or not
    return [x.to(device) for x in (w, u, kd, decay)], first.to(device)


@pytest.mark.parametrize("h, nc, c, dk, dv", [(2, 5, 4, 8, 8), (2, 7, 16, 16, 24), (1, 3, 64, 32, 40), (1, 4, 3, 5, 7)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_triton_chunk_scan_matches_torch(device, rng, h, nc, c, dk, dv, per_channel):
    """Forward (states, v_new) and the gradients of w, u, k_decayed and chunk_decay (per head and chunk, or per
    row of the state) for random gradients of both outputs, against the torch loop and its autograd, fp32.
    Several programs per head (BV=16)."""
    from fastft.kernels import delta_rule as kernels

    inputs, first = scan_inputs(rng, h, nc, c, dk, dv, device, per_channel=per_channel)
    inputs = [x.requires_grad_() for x in inputs]
    want = scan_chunks(*inputs, first)
    dstates, dv_new = (torch.randn(x.shape, generator=rng).to(device) for x in want)
    want_grads = torch.autograd.grad(want, inputs, (dstates, dv_new))
    got = kernels.chunk_scan(*(x.detach() for x in inputs), first, BV=16)
    for name, a, e in zip(("states", "v_new"), got, want):
        assert a.shape == e.shape
        assert_close_to(a, e, name)
    got_grads = torch.autograd.grad(chunk_scan_op(*inputs, first), inputs, (dstates, dv_new))
    for name, a, e in zip(("dw", "du", "dk_decayed"), got_grads, want_grads):
        assert a.shape == e.shape and a.dtype == torch.float32
        assert_close_to(a, e, name)
    # dchunk_decay sums Dk * Dv products (entering state x gradient of the leaving state) that cancel: its
    # rounding error scales with the sum of their magnitudes, not with the result.
    w, _, kd, decay = (x.detach() for x in inputs)
    ds = kernels.chunk_scan_backward(w, kd, decay, first, dstates, dv_new, BV=16)[0]
    terms = (got[0].abs() * ds.abs()).sum((-1, -2) if decay.dim() == 2 else -1).max().item()
    err = (got_grads[3] - want_grads[3]).abs().max().item()
    assert got_grads[3].shape == decay.shape and err <= RTOL * terms + ATOL, f"dchunk_decay: {err:.3g} ({terms:.3g})"


def test_triton_chunk_scan_one_output_used(device, rng):
    """A gradient for only one output (autograd passes zeros for the other)."""
    inputs, first = scan_inputs(rng, 1, 4, 4, 8, 8, device)
    inputs = [x.requires_grad_() for x in inputs]
    for i in (0, 1):
        got = torch.autograd.grad(chunk_scan_op(*inputs, first)[i].sum(), inputs)
        want = torch.autograd.grad(scan_chunks(*inputs, first)[i].sum(), inputs)
        for name, a, e in zip(("dw", "du", "dk_decayed", "dchunk_decay"), got, want):
            assert_close_to(a, e, f"{name} (output {i})")


def test_triton_chunk_scan_passes_opcheck(device, rng):
    inputs, first = scan_inputs(rng, 1, 3, 4, 4, 4, device)
    torch.library.opcheck(chunk_scan_op.op, (*(x.requires_grad_() for x in inputs), first))
    w, u, kd, decay = (x.detach() for x in inputs)
    states, v_new = chunk_scan_op(w, u, kd, decay, first)
    grads = [torch.randn(x.shape, generator=rng).to(device) for x in (states, v_new)]
    torch.library.opcheck(chunk_scan_backward_op.op, (w, kd, decay, first, states, v_new, *grads))


# ---- the intra-chunk kernels (one decay per head) against torch ------------------------------------------


def intra_inputs(g, h, nc, c, dk, dv, device):
    k = torch.nn.functional.normalize(torch.randn(h, nc, c, dk, generator=g), dim=-1)
    v = torch.randn(h, nc, c, dv, generator=g)
    beta, decay = torch.rand(h, nc, c, generator=g), -torch.rand(h, nc, c, generator=g) * 2
    return [x.to(device) for x in (k, v, beta, decay)]


@pytest.mark.parametrize("h, nc, c, dk, dv", [(2, 3, 16, 8, 24), (1, 2, 5, 7, 3), (1, 2, 64, 32, 16)])
def test_intra_forward_matches_torch(device, rng, h, nc, c, dk, dv):
    """T = (I + L)^-1 (forward substitution in the kernel; a triangular solve here), w, u, k_decayed, the chunk's
    decay and the cumulative log decays, fp32."""
    k, v, beta, decay = intra_inputs(rng, h, nc, c, dk, dv, device)
    got = intra_forward_op(k, v, beta, decay)
    cum = decay.cumsum(-1)
    strict = torch.ones(c, c, dtype=torch.bool, device=device).tril(-1)
    lower = (k * beta[..., None]) @ k.transpose(-1, -2) * (cum[..., :, None] - cum[..., None, :]).exp() * strict
    eye = torch.eye(c, device=device).expand_as(lower)
    t = torch.linalg.solve_triangular(eye + lower, eye, upper=False, unitriangular=True)
    want = (
        t,
        t @ (k * (beta * cum.exp())[..., None]),
        t @ (v * beta[..., None]),
        k * (cum[..., -1:] - cum).exp()[..., None],
        cum[..., -1].exp(),
        cum,
    )
    for name, a, e in zip(("T", "w", "u", "k_decayed", "chunk_decay", "cum"), got, want):
        assert a.shape == e.shape and a.dtype == torch.float32
        assert_close_to(a, e, name)


def test_intra_backward_keeps_small_decay_gradients_beside_a_large_one(device, rng):
    """dg_j sums the gradients of cum over the tokens from j on: with the first token's a thousand times the
    others', the later tokens' dg stay as accurate as their own size says (a total less a cumulative sum loses
    them to the total's rounding). One chunk of 16, the kernel against autograd of the torch formulas in fp64."""
    k, v, beta, decay = intra_inputs(rng, 2, 1, 16, 8, 12, device)
    t, w, u, kd, cd, cum = intra_forward_op(k, v, beta, decay)
    grads = [torch.randn(x.shape, generator=rng).to(device) for x in (u, w, kd, cd, k, cum)]
    grads[-1][..., 0] *= 1e3
    dg = intra_backward_op(k, v, beta, cum, t, u, w, *grads)[3]
    k, v, beta, decay = (x.double().cpu() for x in (k, v, beta, decay))
    decay.requires_grad_()
    cum = decay.cumsum(-1)
    strict = torch.ones(16, 16, dtype=torch.bool).tril(-1)
    lower = (k * beta[..., None]) @ k.transpose(-1, -2) * (cum[..., :, None] - cum[..., None, :]).exp() * strict
    eye = torch.eye(16, dtype=torch.float64).expand_as(lower)
    t = torch.linalg.solve_triangular(eye + lower, eye, upper=False, unitriangular=True)
    u, w = t @ (v * beta[..., None]), t @ (k * (beta * cum.exp())[..., None])
    outs = (u, w, k * (cum[..., -1:] - cum).exp()[..., None], cum[..., -1].exp(), cum)
    # grads[4] (dk_in) adds to dk alone
    want = torch.autograd.grad(outs, decay, [g.double().cpu() for i, g in enumerate(grads) if i != 4])[0]
    assert_close_to(dg[..., 1:].cpu(), want[..., 1:], "dg after the first token")


@pytest.mark.parametrize("dk, dv, c", [(40, 72, 16), (64, 32, 64), (8, 136, 16)])
def test_widths_past_one_block_of_columns(device, rng, dk, dv, c):
    """The intra-chunk backward takes the head dimension 32 columns at a time: widths of several blocks, one cut
    short, against the token loop (forward and gradients); heads wider than 128 (OLMo-Hybrid's values: 192) run
    the intra-chunk part in torch."""
    lengths = [37, 1, 70, 20]
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    check_against_reference(info, random_inputs(rng, 1, sum(lengths), 2, dk, dv, device), c, "triton")


def output_inputs(g, h, nc, c, dk, dv, device):
    q, k = (torch.randn(h, nc, c, dk, generator=g) for _ in range(2))
    cum = (-torch.rand(h, nc, c, generator=g) * 2).cumsum(-1)
    states, v_new = torch.randn(h, nc, dk, dv, generator=g), torch.randn(h, nc, c, dv, generator=g)
    return [x.to(device) for x in (q, k, cum, states, v_new)]


@pytest.mark.parametrize("h, nc, c, dk, dv", [(2, 3, 16, 8, 24), (1, 2, 5, 7, 3), (1, 2, 64, 40, 72)])
def test_output_kernels_match_torch(device, rng, h, nc, c, dk, dv):
    """o = exp(cum) (q S) + ((q k^T) * G) v_new and every gradient of it (q, k, cum, S, v_new), fp32, against
    torch and its autograd; widths past one block of 32 columns, cut short."""
    inputs = [x.requires_grad_() for x in output_inputs(rng, h, nc, c, dk, dv, device)]
    q, k, cum, states, v_new = inputs
    lower = torch.ones(c, c, dtype=torch.bool, device=device).tril()
    g = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    want = cum.exp()[..., None] * (q @ states) + ((q @ k.transpose(-1, -2)) * g) @ v_new
    got = output_forward_op(*(x.detach() for x in inputs))
    assert got.shape == want.shape and got.dtype == torch.float32
    assert_close_to(got, want, "o")
    d_out = torch.randn(want.shape, generator=rng).to(device)
    want_grads = torch.autograd.grad(want, inputs, d_out)
    got_grads = output_backward_op(*(x.detach() for x in inputs), d_out)
    for name, a, e in zip(("dq", "dk", "dcum", "dstates", "dv_new"), got_grads, want_grads):
        assert a.shape == e.shape and a.dtype == torch.float32
        assert_close_to(a, e, name)


def test_intra_ops_pass_opcheck(device, rng):
    k, v, beta, decay = intra_inputs(rng, 1, 2, 4, 4, 8, device)
    torch.library.opcheck(intra_forward_op.op, (k, v, beta, decay))
    t, w, u, kd, cd, cum = intra_forward_op(k, v, beta, decay)
    grads = [torch.randn(x.shape, generator=rng).to(device) for x in (u, w, kd, cd, k, cum)]
    torch.library.opcheck(intra_backward_op.op, (k, v, beta, cum, t, u, w, *grads))
    q, k, cum, states, v_new = output_inputs(rng, 1, 2, 4, 5, 6, device)
    torch.library.opcheck(output_forward_op.op, (q, k, cum, states, v_new))
    d_out = torch.randn(v_new.shape, generator=rng).to(device)
    torch.library.opcheck(output_backward_op.op, (q, k, cum, states, v_new, d_out))


def _tokens(rng, n, h, dk, dv, device, dtype, strided):
    """q, k ``[N, H, Dk]``, v ``[N, H, Dv]`` (views with a token stride past the heads when ``strided``), g and
    beta ``[N, H]``, in ``dtype``."""
    pad = 3 if strided else 0
    q, k = (torch.randn(n, h, dk + pad, generator=rng).to(device, dtype)[..., :dk] for _ in range(2))
    v = torch.randn(n, h, dv + pad, generator=rng).to(device, dtype)[..., :dv]
    g = (-torch.rand(n, h, generator=rng)).to(device, dtype)
    beta = torch.rand(n, h, generator=rng).to(device, dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("lengths, c, dk, dv", [([5, 1, 9], 4, 8, 24), ([3, 14], 16, 5, 7), ([70, 2], 64, 40, 72)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype, strided", [(torch.float32, False), (torch.bfloat16, True)])
def test_pack_and_unpack_match_torch(device, rng, lengths, c, dk, dv, norm, dtype, strided):
    """The tokens into the slots (q, k l2-normalised with ``norm``, q scaled; zeros in the empty slots) and back,
    and their backward, against the torch steps they replace and their autograd: widths past one block, cut
    short, rows of a stride past the head, 16-bit inputs (gradients in each input's dtype)."""
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    table = chunk_table(info, c)
    n, h, scale = sum(lengths), 3, 0.3
    inputs = [x.requires_grad_() for x in _tokens(rng, n, h, dk, dv, device, dtype, strided)]
    q, k, v, g, beta = inputs

    def slots(x):  # [N, H, D] -> [H, NC, C, D], zeros in the empty slots
        empty = x.new_zeros(h, table.num_chunks_bound * c, x.shape[-1])
        return empty.index_copy(1, table.slot, x.transpose(0, 1)).view(h, table.num_chunks_bound, c, -1)

    qf, kf = q.float(), k.float()
    if norm:
        qf, kf = reference.l2norm(qf), reference.l2norm(kf)
    want = [slots(qf * scale), slots(kf), slots(v.float()), slots(g.float()[..., None])[..., 0]]
    want.append(slots(beta.float()[..., None])[..., 0])
    got = pack_forward_op(*(x.detach() for x in inputs), table.token_index, scale, norm)
    for name, a, e in zip(("query", "key", "value", "g", "beta"), got, want):
        assert a.shape == e.shape and a.dtype == torch.float32, name
        assert_close_to(a, e, name)
    grads = [torch.randn(x.shape, generator=rng).to(device) for x in want]
    want_grads = torch.autograd.grad(want, inputs, grads)
    got_grads = pack_backward_op(
        q.detach(), k.detach(), table.slot, *grads, scale, norm, v.dtype, g.dtype, beta.dtype
    )  # fmt: skip
    for name, a, e in zip(("dq", "dk", "dv", "dg", "dbeta"), got_grads, want_grads):
        assert a.shape == e.shape and a.dtype == e.dtype and a.is_contiguous(), name
        if dtype == torch.float32:
            assert_close_to(a, e, name)
        else:  # one rounding of the fp32 gradient to the input's dtype each
            torch.testing.assert_close(a.float(), e.float(), rtol=2**-7, atol=1e-6, msg=name)

    o = torch.randn(h, table.num_chunks_bound, c, dv, generator=rng).to(device).requires_grad_()
    want_out = o.view(h, -1, dv).transpose(0, 1).index_select(0, table.slot).to(dtype)
    out = unpack_forward_op(o.detach(), table.slot, dtype)
    assert out.dtype == dtype
    if device.type == "cuda" or dtype == torch.float32:
        assert torch.equal(out, want_out)
    else:  # Triton's interpreter rounds fp32 to bf16 toward zero
        torch.testing.assert_close(out, want_out, rtol=2**-7, atol=0)
    d_out = torch.randn(n, h, dv + 2, generator=rng).to(device, dtype)[..., :dv]
    (want_do,) = torch.autograd.grad(want_out, o, d_out)
    assert torch.equal(unpack_backward_op(d_out, table.token_index), want_do)


def test_pack_ops_pass_opcheck(device, rng):
    info = fastft.packed_seq_info(seq_lengths=[3, 5], device=device)
    table = chunk_table(info, 4)
    q, k, v, g, beta = _tokens(rng, 8, 2, 4, 6, device, torch.float32, False)
    torch.library.opcheck(pack_forward_op.op, (q, k, v, g, beta, table.token_index, 0.5, True))
    slots = pack_forward_op(q, k, v, g, beta, table.token_index, 0.5, True)
    grads = [torch.randn(x.shape, generator=rng).to(device) for x in slots]
    args = (q, k, table.slot, *grads, 0.5, True, torch.float32, torch.float32, torch.float32)
    torch.library.opcheck(pack_backward_op.op, args)
    o = torch.randn(2, table.num_chunks_bound, 4, 6, generator=rng).to(device)
    torch.library.opcheck(unpack_forward_op.op, (o, table.slot, torch.bfloat16))
    torch.library.opcheck(unpack_backward_op.op, (torch.randn(8, 2, 6, generator=rng).to(device), table.token_index))


# ---- transformers' implementation, one document at a time -------------------------------------------------


def test_matches_transformers_on_each_document(device, rng):
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    chunked = inspect.unwrap(qwen.torch_chunk_gated_delta_rule)  # the torch function, not an installed kernel
    recurrent = inspect.unwrap(qwen.torch_recurrent_gated_delta_rule)
    lengths = [70, 1, 64, 5, 20]
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    inputs = random_inputs(rng, 1, sum(lengths), 2, 8, 6, device)
    ref = reference.gated_delta_rule(*inputs, info.position_ids, 8**-0.5, True)
    for l2 in (True, False):
        outs = {backend: gated_delta_rule(*inputs, info, use_qk_l2norm=l2, backend=backend) for backend in BACKENDS}
        start = 0
        for n in lengths:
            doc = [x[:, start : start + n] for x in inputs]
            theirs, _ = chunked(*doc, chunk_size=64, use_qk_l2norm_in_kernel=l2)
            for backend, out in outs.items():
                assert_close_to(out[:, start : start + n], theirs, f"{backend}, chunked, document at {start}")
            if l2:  # the reference is transformers' recurrent form with a reset
                theirs, _ = recurrent(*doc, use_qk_l2norm_in_kernel=True)
                assert_close_to(ref[:, start : start + n], theirs, f"reference vs recurrent, document at {start}")
            start += n


def test_per_channel_matches_kimi_on_each_document(device, rng):
    """transformers' Kimi Delta Attention (``chunk_kimi_delta_attention``, and the recurrent form against the
    reference) on each document alone, against both backends on the packed row."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    chunked = inspect.unwrap(kimi.chunk_kimi_delta_attention)  # the torch function, not fla's kernel
    recurrent = inspect.unwrap(kimi.recurrent_kimi_delta_attention)
    lengths = [40, 1, 16, 5]
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    inputs = random_inputs(rng, 1, sum(lengths), 2, 8, 6, device, per_channel=True)
    ref = reference.gated_delta_rule(*inputs, info.position_ids, 8**-0.5, True)
    outs = {backend: gated_delta_rule(*inputs, info, chunk_size=16, backend=backend) for backend in BACKENDS}
    start = 0
    for n in lengths:
        doc = [x[:, start : start + n] for x in inputs]
        theirs, _ = chunked(*doc, chunk_size=16, use_qk_l2norm_in_kernel=True)
        for backend, out in outs.items():
            assert_close_to(out[:, start : start + n], theirs, f"{backend}, chunked, document at {start}")
        theirs, _ = recurrent(*doc, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
        assert_close_to(ref[:, start : start + n], theirs, f"reference vs recurrent, document at {start}")
        start += n


# ---- validation ------------------------------------------------------------------------------------------


def _args(**changes):
    b, t, h = 1, 6, 2
    args = dict(
        q=torch.zeros(b, t, h, 4),
        k=torch.zeros(b, t, h, 4),
        v=torch.zeros(b, t, h, 3),
        g=torch.zeros(b, t, h),
        beta=torch.zeros(b, t, h),
        info=fastft.packed_seq_info(seq_lengths=[2, 4]),
    )
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(q=[0.0]), TypeError, "q must be a tensor"),
        (dict(q=torch.zeros(1, 6, 8)), ValueError, r"q must be \[B, T, H, Dk\]"),
        (dict(k=torch.zeros(1, 6, 1, 4)), ValueError, "k must have q's shape"),
        (dict(v=torch.zeros(1, 5, 2, 3)), ValueError, r"v must be \[B, T, H, Dv\]"),
        (dict(g=torch.zeros(1, 6, 2, 1)), ValueError, r"g must be \[B, T, H\]"),
        (dict(beta=torch.zeros(6, 2)), ValueError, r"beta must be \[B, T, H\]"),
        (dict(beta=torch.zeros(1, 6, 2, dtype=torch.int64)), ValueError, "beta must have a floating dtype"),
        (dict(info=torch.arange(6)), TypeError, "info must be a fastft.PackedSeqInfo"),
        (dict(info=fastft.packed_seq_info(seq_lengths=[2, 5])), ValueError, "info has 7 tokens but q has B . T = 6"),
        (dict(chunk_size=0), ValueError, "chunk_size must be an int >= 1"),
        (dict(chunk_size=512), ValueError, "chunk_size must be an int from 1 to 256"),
        (dict(chunk_size=16.0), TypeError, "chunk_size must be an int"),
        (dict(scale="0.5"), TypeError, "scale must be a number"),
        (dict(q=torch.zeros(1, 6, 2, 0), k=torch.zeros(1, 6, 2, 0)), ValueError, "H, Dk and Dv must be >= 1"),
        (dict(v=torch.zeros(1, 6, 2, 0)), ValueError, "H, Dk and Dv must be >= 1"),
        (dict(use_qk_l2norm=1), TypeError, "use_qk_l2norm must be a bool"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
    ],
)
def test_bad_input(changes, error, match):
    with pytest.raises(error, match=match):
        gated_delta_rule(**_args(**changes))


def test_backend_choice(device, monkeypatch):
    """Triton wherever it runs (CUDA, the interpreter), as for every op; FASTFT_BACKEND and backend= choose."""
    monkeypatch.delenv("FASTFT_BACKEND", raising=False)
    assert dispatch.backend_for(OP_SCAN, device) == "triton"
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    assert dispatch.backend_for(OP_SCAN, device) == "torch"
    assert dispatch.backend_for(OP_SCAN, device, "triton") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter: Triton cannot run them
    with pytest.raises(ValueError, match="backend='triton' cannot run delta_rule.chunk_scan on device cpu"):
        gated_delta_rule(**_args(), backend="triton")


def test_bad_input_to_chunk_table():
    with pytest.raises(TypeError, match="info must be a fastft.PackedSeqInfo"):
        chunk_table([0, 3], 4)
    with pytest.raises(ValueError, match="chunk_size must be an int from 1 to 256"):
        chunk_table(fastft.packed_seq_info(seq_lengths=[3]), 1024)


# ---- GPU: real sizes in bf16 -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("nc, dk, dv", [(135, 128, 128), (40, 128, 64), (9, 64, 100)])
def test_triton_chunk_scan_real_sizes(rng, nc, dk, dv):
    """The Triton scan, forward and backward, at Qwen3.5's 32 heads of 128 x 128 and chunk 64 (and other head
    dims), fp32, against the torch loop in fp32 (cuBLAS without TF32): catches a miscompiled fp32 tl.dot."""
    assert not torch.backends.cuda.matmul.allow_tf32
    inputs, first = scan_inputs(rng, 32, nc, 64, dk, dv, torch.device("cuda"), scale=0.05)
    first[0] = True
    inputs = [x.requires_grad_() for x in inputs]
    want = scan_chunks(*inputs, first)
    grads = [torch.randn(x.shape, generator=rng).cuda() for x in want]
    want += torch.autograd.grad(want, inputs, grads)
    got = chunk_scan_op(*inputs, first)
    got += torch.autograd.grad(got, inputs, grads)
    for name, a, e in zip(("states", "v_new", "dw", "du", "dk_decayed", "dchunk_decay"), got, want):
        err, top = (a - e).abs().max().item(), e.abs().max().item()
        assert err <= 1e-4 * top + 1e-5, f"{name}: max abs error {err:.3g}, max {top:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_sizes_bf16_against_fp32(backend):
    """Qwen3.5 / Qwen3-Next widths (32 value heads of 128 after repeating the key heads, chunk 64), T=8192 in
    a few documents, bf16 inputs. The output against the fp32 reference, the gradients against transformers'
    torch path on each document alone in fp32 (the reference's autograd graph would not fit at this size), on
    the same bf16 values: fastft's error is within 2x that of transformers' torch path given the bf16 tensors
    (the stock model's own bf16 error), plus 1e-3 of the largest value."""
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    stock = inspect.unwrap(qwen.torch_chunk_gated_delta_rule)
    device = torch.device("cuda")
    lengths = [3000, 1, 64, 2000, 127, 3000]
    t = sum(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    inputs = random_inputs(torch.Generator().manual_seed(0), 1, t, 32, 128, 128, device, torch.bfloat16)
    w = torch.randn(1, t, 32, 128, generator=torch.Generator().manual_seed(1)).to(device)

    def per_doc(xs):
        return torch.cat(
            [stock(*(x[:, s : s + n] for x in xs), use_qk_l2norm_in_kernel=True)[0] for s, n in zip(starts, lengths)], 1
        )

    def results(out, xs):
        return [out.detach().float(), *torch.autograd.grad((out.float() * w).sum(), xs)]

    ours = results(gated_delta_rule(*inputs, info, backend=backend), inputs)
    theirs = results(per_doc(inputs), inputs)
    fp32 = [x.detach().float().requires_grad_() for x in inputs]
    exact = results(per_doc(fp32), fp32)
    with torch.no_grad():
        exact[0] = reference.gated_delta_rule(*fp32, info.position_ids, 128**-0.5, True)
    for name, a, s, e in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), ours, theirs, exact):
        err, stock_err = (a.float() - e).abs().max().item(), (s.float() - e).abs().max().item()
        assert err <= 2 * stock_err + 1e-3 * e.abs().max().item(), f"{name}: {err:.3g} vs stock {stock_err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_per_channel_real_sizes_bf16_against_kimi(backend):
    """Kimi-Linear's widths (32 heads of 128, a decay per key channel, chunk 64), T=4096 in a few documents,
    bf16 inputs: the output and every gradient against transformers' torch ``chunk_kimi_delta_attention`` on
    each document alone in fp32 on the same bf16 values; fastft's error within 2x that of transformers' own
    bf16 run, plus 1e-3 of the largest value."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    stock = inspect.unwrap(kimi.chunk_kimi_delta_attention)
    device = torch.device("cuda")
    lengths = [1500, 1, 64, 1000, 127, 1404]
    t = sum(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    inputs = random_inputs(torch.Generator().manual_seed(0), 1, t, 32, 128, 128, device, torch.bfloat16, True)
    w = torch.randn(1, t, 32, 128, generator=torch.Generator().manual_seed(1)).to(device)

    def per_doc(xs):
        return torch.cat(
            [stock(*(x[:, s : s + n] for x in xs), use_qk_l2norm_in_kernel=True)[0] for s, n in zip(starts, lengths)], 1
        )

    def results(out, xs):
        return [out.detach().float(), *torch.autograd.grad((out.float() * w).sum(), xs)]

    ours = results(gated_delta_rule(*inputs, info, backend=backend), inputs)
    theirs = results(per_doc(inputs), inputs)
    fp32 = [x.detach().float().requires_grad_() for x in inputs]
    exact = results(per_doc(fp32), fp32)
    for name, a, s, e in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), ours, theirs, exact):
        err, stock_err = (a.float() - e).abs().max().item(), (s.float() - e).abs().max().item()
        assert err <= 2 * stock_err + 1e-3 * e.abs().max().item(), f"{name}: {err:.3g} vs stock {stock_err:.3g}"
