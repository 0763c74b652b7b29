"""fastft.packed_conv1d: the reference against each document run alone through nn.Conv1d, both backends
(forward and every gradient) against the reference on random documents, checkpointing, validation, and on a
GPU bf16 at Qwen3.5's width without a host sync. fp32 tolerance: 1e-5 absolute and relative."""

import pytest
import torch
import torch.nn.functional as F

import fastft
from fastft import testing
from fastft.reference import conv as reference

FP32 = dict(atol=1e-5, rtol=1e-5)


def _lengths(rng: torch.Generator, num_tokens: int, longest: int) -> list[int]:
    """Random document lengths summing to ``num_tokens``, with many of 1 and 2 tokens (shorter than W)."""
    lengths = []
    while sum(lengths) < num_tokens:
        short = torch.rand((), generator=rng) < 0.5
        lengths.append(int(torch.randint(1, 3 if short else longest + 1, (), generator=rng)))
    lengths[-1] -= sum(lengths) - num_tokens
    return [n for n in lengths if n > 0]


def _inputs(rng, tokens, channels, width, has_bias, device, dtype=torch.float32):
    x = torch.randn(tokens, channels, generator=rng).to(device, dtype).requires_grad_()
    weight = torch.randn(channels, 1, width, generator=rng).to(device, dtype).requires_grad_()
    bias = torch.randn(channels, generator=rng).to(device, dtype).requires_grad_() if has_bias else None
    return x, weight, bias


def _grads(out, x, weight, bias, grad):
    leaves = [x, weight] + ([bias] if bias is not None else [])
    return torch.autograd.grad(out, leaves, grad)


def _expected(x, weight, bias, info, silu, grad):
    """The reference's output and gradients (autograd through F.conv1d per document)."""
    flat = x.reshape(-1, x.shape[-1])
    out = reference.packed_conv1d(flat, weight.reshape(weight.shape[0], -1), bias, info.cu_seqlens, silu)
    out = out.view(x.shape)
    return out, _grads(out, x, weight, bias, grad)


def _check(x, weight, bias, info, activation, backend, rng, **tol):
    grad = torch.randn(x.shape, generator=rng).to(x.device, x.dtype)
    out = fastft.packed_conv1d(x, weight, info, bias=bias, activation=activation, backend=backend)
    expected, expected_grads = _expected(x, weight, bias, info, activation is not None, grad)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, expected, **tol)
    for name, got, want in zip(("dx", "dweight", "dbias"), _grads(out, x, weight, bias, grad), expected_grads):
        torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_reference_is_each_document_alone_through_nn_conv1d(device, rng):
    lengths = _lengths(rng, 40, 12)
    channels, width = 6, 4
    conv = torch.nn.Conv1d(channels, channels, width, groups=channels, padding=width - 1)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=rng))
        conv.bias.copy_(torch.randn(channels, generator=rng))
    conv = conv.to(device)
    x = torch.randn(sum(lengths), channels, generator=rng).to(device)
    alone = torch.cat(
        [F.silu(conv(doc.t()[None])[0, :, : len(doc)]).t() for doc in x.split(lengths)]  # transformers' steps
    )
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    torch.testing.assert_close(reference.packed_conv1d(x, conv.weight[:, 0], conv.bias, info.cu_seqlens, True), alone)
    for backend in ("torch", "triton"):
        out = fastft.packed_conv1d(x, conv.weight, info, bias=conv.bias, activation="swish", backend=backend)
        torch.testing.assert_close(out, alone, **FP32)
    # One stream through the same conv leaks across documents: the test above can fail.
    leaked = F.silu(conv(x.t()[None])[0, :, : x.shape[0]]).t()
    assert not torch.allclose(leaked, alone, **FP32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "width,has_bias,activation",
    [(4, True, "silu"), (4, False, None), (1, True, None), (3, False, "swish"), (8, True, "silu")],
)
def test_matches_reference(device, rng, backend, width, has_bias, activation):
    tokens, channels = int(torch.randint(16, 33, (), generator=rng)), 20
    info = fastft.packed_seq_info(seq_lengths=_lengths(rng, tokens, 2 * width + 3), device=device)
    x, weight, bias = _inputs(rng, tokens, channels, width, has_bias, device)
    _check(x, weight, bias, info, activation, backend, rng, **FP32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rows_of_position_ids_and_host_lengths(device, rng, backend):
    # [B, T] position ids: every row starts a document; x [B, T, C]; the weight [C, W] form.
    rows, row_len, channels, width = 2, 17, 12, 4
    pos = torch.cat([torch.arange(n) for row in range(rows) for n in _lengths(rng, row_len, 7)]).view(rows, row_len)
    info = fastft.packed_seq_info(position_ids=pos.to(device))
    x, weight, bias = _inputs(rng, rows * row_len, channels, width, True, device)
    x = x.detach().view(rows, row_len, channels).requires_grad_()
    weight = weight.detach()[:, 0].requires_grad_()
    _check(x, weight, bias, info, "silu", backend, rng, **FP32)
    # Host lengths whose sum falls short of num_tokens (the rest is one more document); strided x.
    info = fastft.packed_seq_info(seq_lengths=[3, 1, 5], num_tokens=14, device=device)
    base = torch.randn(14, 2 * channels, generator=rng).to(device).requires_grad_()
    _check(base[:, channels:], weight, None, info, None, backend, rng, **FP32)  # token stride 2C, read in place
    _check(base[:, ::2], weight, None, info, "silu", backend, rng, **FP32)  # channel stride 2: copied once


def test_no_tokens(device):
    info = fastft.packed_seq_info(seq_lengths=[], num_tokens=0, device=device)
    x = torch.zeros(0, 5, device=device, requires_grad=True)
    weight = torch.ones(5, 1, 4, device=device, requires_grad=True)
    out = fastft.packed_conv1d(x, weight, info, activation="silu")
    assert out.shape == (0, 5)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_mixed_dtypes(device, rng):
    # bf16 activations with fp32 weights (mixed precision): the same fp32 sums, then one rounding.
    info = fastft.packed_seq_info(seq_lengths=_lengths(rng, 24, 9), device=device)
    x, weight, bias = _inputs(rng, 24, 10, 4, True, device)
    x = x.detach().bfloat16().requires_grad_()
    for backend in ("triton", "torch"):
        _check(x, weight, bias, info, "silu", backend, rng, atol=1e-2, rtol=1e-2)
        out = fastft.packed_conv1d(x, weight, info, bias=bias, backend=backend)
        assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("checkpoint", ["torch", "fastft"])
def test_under_checkpointing(device, rng, checkpoint):
    info = fastft.packed_seq_info(seq_lengths=_lengths(rng, 24, 9), device=device)
    x, weight, bias = _inputs(rng, 24, 10, 4, True, device)
    grad = torch.randn(24, 10, generator=rng).to(device)

    def layer(x):
        return fastft.packed_conv1d(x * 2, weight, info, bias=bias, activation="silu", backend="triton")

    expected = _grads(layer(x), x, weight, bias, grad)
    if checkpoint == "torch":
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    else:
        out = fastft.offloaded_checkpoint(layer, x)
    for got, want in zip(_grads(out, x, weight, bias, grad), expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize(
    "width,has_bias,silu,block_t,group",
    [
        (3, False, True, 8, 2),
        (4, True, True, 16, 4),
        (5, True, False, 8, 3),
        (7, False, True, 12, 4),
        (2, True, False, 32, 8),
    ],
)
def test_backward_kernel_against_autograd(device, rng, width, has_bias, silu, block_t, group):
    # The backward kernel alone, at launch parameters the dispatcher does not pick (blocks that are no
    # multiple of the group, a last channel block cut short), documents of 1 to 2W tokens, and the dweight and
    # dbias sums of several programs; against autograd through the per-document reference.
    from fastft.kernels import conv as kernels

    lengths = [1, 1] + _lengths(rng, 45, 2 * width) + [1]
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    channels = 19
    x, weight, bias = _inputs(rng, sum(lengths), channels, width, has_bias, device)
    weight = weight.detach()[:, 0].contiguous().requires_grad_()
    grad = torch.randn(x.shape, generator=rng).to(device)
    # without bias, dbias is still returned: the gradient of a zero bias
    b = bias if has_bias else torch.zeros(channels, device=device, requires_grad=True)
    out = reference.packed_conv1d(x, weight, b, info.cu_seqlens, silu)
    expected = _grads(out, x, weight, b, grad)
    got = kernels.conv1d_backward(
        grad,
        x.detach(),
        weight.detach(),
        None if bias is None else bias.detach(),
        info.position_ids.reshape(-1),
        silu,
        BLOCK_T=block_t,
        BLOCK_C=8,
        GROUP=group,
        num_warps=1,
    )
    for name, g, want in zip(("dx", "dweight", "dbias"), got, expected):
        assert g.dtype == want.dtype
        torch.testing.assert_close(g, want, **FP32, msg=lambda m, name=name: f"{name}: {m}")


# ---- validation -----------------------------------------------------------------------------------------


def _bad_cases():
    x = torch.randn(2, 5, 6)
    weight = torch.randn(6, 1, 4)
    info = fastft.packed_seq_info(seq_lengths=[4, 6])
    ok = dict(x=x, weight=weight, info=info)
    return [
        (dict(ok, x=x.tolist()), TypeError, "x must be a tensor"),
        (dict(ok, x=x.double()), TypeError, "x must be float32"),
        (dict(ok, x=x[0, 0]), ValueError, r"x must be \[B, T, C\]"),
        (dict(ok, weight=weight.half().numpy()), TypeError, "weight must be a tensor"),
        (dict(ok, weight=weight.int()), TypeError, "weight must be float32"),
        (dict(ok, weight=torch.randn(6, 2, 4)), ValueError, r"weight must be \[C, W\]"),
        (dict(ok, weight=torch.randn(5, 4)), ValueError, "C=6"),
        (dict(ok, weight=torch.randn(6, 9)), ValueError, "W must be 1 to 8, got 9"),
        (dict(ok, weight=torch.randn(6, 0)), ValueError, "W must be 1 to 8, got 0"),
        (dict(ok, weight=torch.randn(6, 4, device="meta")), ValueError, "weight is on meta"),
        (dict(ok, bias=[0.0] * 6), TypeError, "bias must be a tensor"),
        (dict(ok, bias=torch.zeros(6, dtype=torch.int64)), TypeError, "bias must be float32"),
        (dict(ok, bias=torch.zeros(5)), ValueError, r"bias must be \[C\]"),
        (dict(ok, info=info.cu_seqlens), TypeError, "info must be a PackedSeqInfo"),
        (dict(ok, info=fastft.packed_seq_info(seq_lengths=[4, 5])), ValueError, "info describes 9 tokens, x has 10"),
        (dict(ok, activation="gelu"), ValueError, "activation must be one of"),
        (dict(ok, activation=True), TypeError, "activation must be None or a str"),
        (dict(ok, backend="cuda"), ValueError, "backend must be one of"),
        (dict(ok, x=torch.zeros(10, 0), weight=torch.zeros(0, 4)), ValueError, r"at least one channel \(C >= 1\)"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_cases())))
def test_bad_inputs(index):
    kwargs, error, match = _bad_cases()[index]
    with pytest.raises(error, match=match):
        fastft.packed_conv1d(**kwargs)


# ---- GPU: real sizes ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("channels,width,activation", [(8192, 4, "silu"), (2560, 3, None)])  # Qwen3.5, LFM2
def test_gpu_bf16_real_sizes_without_host_sync(rng, channels, width, activation):
    device = torch.device("cuda")
    tokens = 16384
    lengths = [1, 2, 3] + _lengths(rng, tokens - 6, 2048)
    info = fastft.packed_seq_info(seq_lengths=lengths, num_tokens=tokens, device=device)  # from the host
    x, weight, bias = _inputs(rng, tokens, channels, width, False, device, torch.bfloat16)
    x = x.detach().view(1, tokens, channels).requires_grad_()
    grad = torch.randn(x.shape, generator=rng).to(device, torch.bfloat16)
    # the reference in fp32 throughout (bf16 leaves would sum its per-document weight gradients in bf16)
    x32, w32 = (t.detach().float().requires_grad_() for t in (x, weight))
    expected, (dx_ref, dw_ref) = _expected(x32, w32, None, info, activation is not None, grad.float())

    def step():
        out = fastft.packed_conv1d(x, weight, info, activation=activation, backend="triton")
        return out, *_grads(out, x, weight, None, grad)

    step()  # compiles the kernels
    with testing.no_host_sync():
        out, dx, dw = step()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dx.float(), dx_ref, atol=2e-2, rtol=1e-2)
    # dweight sums 16384 bf16 products per tap in fp32 and rounds once to bf16 (|dw| ~ 128: bf16's step is 1
    # there; the reference's cuDNN may also sum in TF32, well inside these tolerances).
    torch.testing.assert_close(dw.float(), dw_ref.float(), atol=0.5, rtol=1e-2)
    assert torch.equal(step()[2], dw), "the weight gradient is deterministic"
    with testing.no_host_sync():  # the torch backend does not sync either
        torch_out = fastft.packed_conv1d(x, weight, info, activation=activation, backend="torch")
        torch_dx, _ = _grads(torch_out, x, weight, None, grad)
    torch.testing.assert_close(torch_out, out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(torch_dx, dx, atol=2e-2, rtol=1e-2)


def test_the_check_command_case(device, rng):
    """``python -m fastft check``'s conv case: the dispatched backend against the reference, every gradient."""
    from fastft import selfcheck

    assert selfcheck.CHECKS["conv"] is selfcheck.check_conv
    for _ in range(3):
        selfcheck.check_conv(rng, device, 24)
