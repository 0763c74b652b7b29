"""fastft.linear_cross_entropy: the reference against transformers' ForCausalLMLoss, both backends (loss and
every gradient) against the reference on random shapes, labels, blocks, scales and caps (hypothesis), the kernel's rows
against their torch formulas, ignored and out-of-range labels, no rows, grad mode off, argument checks, and on
a GPU bf16 at a real vocabulary without a host sync. Tolerance: against fp64, within twice the stock path's own
error (the reference in the inputs' dtype) plus 1e-5 of the largest value (bf16/fp16: one ulp of it)."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fastft
from fastft.reference import linear_cross_entropy as reference

lce = importlib.import_module("fastft.linear_cross_entropy")  # the module (the package's name is the op)
BACKENDS = ["triton", "torch"]
FP32 = dict(atol=1e-5, rtol=1e-5)


def _inputs(rng, rows, width, vocab, dtype, device, *, bias=True, ignored=0.2, scale=1.0):
    h = (torch.randn(rows, width, generator=rng) * scale).to(device, dtype).requires_grad_()
    w = torch.randn(vocab, width, generator=rng).to(device, dtype).requires_grad_()
    b = torch.randn(vocab, generator=rng).to(device, dtype).requires_grad_() if bias else None
    y = torch.randint(0, vocab, (rows,), generator=rng)
    y[torch.rand(rows, generator=rng) < ignored] = -100
    return h, w, b, y.to(device)


def _loss_and_grads(fn, h, w, b, y, grad_out, **kw):
    leaves = [t for t in (h, w, b) if t is not None]
    loss = fn(h, w, y, b, **kw)
    return [loss, *torch.autograd.grad(loss * grad_out, leaves)]


def _check(h, w, b, y, backend, *, reduction="mean", block_size=None, grad_out=1.0, logit_scale=None, softcap=None):
    """The op against the reference in fp64 (the same values): within twice the error that the reference in the
    inputs' dtype (the stock path) makes against fp64, plus 1e-5 of the largest value (bf16/fp16: one ulp)."""
    kw = dict(reduction=reduction, logit_scale=logit_scale, softcap=softcap)
    op = fastft.linear_cross_entropy
    got = _loss_and_grads(op, h, w, b, y, grad_out, block_size=block_size, backend=backend, **kw)
    exact = [t.detach().double().requires_grad_() if t is not None else None for t in (h, w, b)]
    want = _loss_and_grads(reference.linear_cross_entropy, *exact, y, grad_out, **kw)
    stock = _loss_and_grads(reference.linear_cross_entropy, h, w, b, y, grad_out, **kw)
    assert got[0].dtype == torch.float32 and got[0].dim() == 0
    for name, a, s, e in zip(["loss", "hidden", "weight", "bias"], got, stock, want):
        assert a.dtype == s.dtype and a.shape == s.shape, name
        err = (a.double() - e.double()).abs().max().item()
        ulp = 1e-5 if h.dtype == torch.float32 else torch.finfo(h.dtype).eps  # fp32: 1e-5; else one ulp
        bound = 2 * (s.double() - e.double()).abs().max().item() + ulp * (1 + e.abs().max().item())
        assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


def test_reference_is_transformers_causal_lm_loss(rng):
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")
    h, w, _, labels = _inputs(rng, 12, 8, 19, torch.float32, "cpu", bias=False)
    labels = labels.reshape(2, 6)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    logits = F.linear(h, w).reshape(2, 6, 19)
    want = loss_utils.ForCausalLMLoss(logits, labels, vocab_size=19)
    torch.testing.assert_close(reference.linear_cross_entropy(h.reshape(2, 6, 8), w, shifted), want, **FP32)
    items = torch.tensor(5)
    want = loss_utils.ForCausalLMLoss(logits, labels, vocab_size=19, num_items_in_batch=items)
    got = reference.linear_cross_entropy(h.reshape(2, 6, 8), w, shifted, reduction="sum") / items
    torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_rows_formula_is_autograd(rng, softcap):
    """``cross_entropy_rows``' gradient is the derivative of its losses (labelled rows, scaled, capped)."""
    x = (torch.randn(9, 23, generator=rng) * 4).requires_grad_()
    y = torch.randint(0, 23, (9,), generator=rng)
    y[[1, 4]] = -100
    scale = torch.tensor(0.37)
    loss, grad = reference.cross_entropy_rows(x, y, scale, -100, softcap)
    capped = x if softcap is None else softcap * torch.tanh(x / softcap)
    torch.testing.assert_close(loss, F.cross_entropy(capped, y, reduction="none"), **FP32)
    (want,) = torch.autograd.grad(loss.sum() * scale, x)
    torch.testing.assert_close(grad, want, **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 24),
    vocab=st.integers(1, 70),
    block=st.sampled_from([None, 1, 3, 16, 64]),
    reduction=st.sampled_from(["mean", "sum"]),
    bias=st.booleans(),
    ignored=st.sampled_from([0.0, 0.3, 1.0]),
    grad_out=st.sampled_from([1.0, 0.25, -3.0]),
    logit_scale=st.sampled_from([None, 1 / 3, 2.5]),
    softcap=st.sampled_from([None, None, 4.0, 30.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(
    backend, device, rows, width, vocab, block, reduction, bias, ignored, grad_out, logit_scale, softcap, seed
):
    rng = torch.Generator().manual_seed(seed)
    h, w, b, y = _inputs(rng, rows, width, vocab, torch.float32, device, bias=bias, ignored=ignored, scale=3.0)
    if reduction == "mean" and not (y != -100).any():  # nothing labelled: NaN loss, zero gradients, as torch's
        loss, *grads = _loss_and_grads(fastft.linear_cross_entropy, h, w, b, y, grad_out, backend=backend)
        assert loss.isnan() and all((g == 0).all() for g in grads)
        return
    kw = dict(reduction=reduction, block_size=block, grad_out=grad_out, logit_scale=logit_scale, softcap=softcap)
    _check(h, w, b, y, backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_half_precision_within_stock_error(backend, device, rng, dtype, reduction):
    h, w, b, y = _inputs(rng, 50, 32, 97, dtype, device)
    _check(h, w, b, y, backend, reduction=reduction, block_size=16, grad_out=0.5, logit_scale=1 / 3)
    _check(h, w, b, y, backend, reduction=reduction, block_size=16, grad_out=0.5, softcap=5.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_frozen_weight_and_grad_mode_off(backend, device, rng):
    h, w, _, y = _inputs(rng, 24, 8, 31, torch.float32, device, bias=False)
    w.requires_grad_(False)  # LoRA's frozen head: only hidden's gradient
    loss = fastft.linear_cross_entropy(h.reshape(2, 3, 4, 8), w, y.reshape(2, 3, 4), backend=backend)
    (dh,) = torch.autograd.grad(loss, h)
    torch.testing.assert_close(loss, reference.linear_cross_entropy(h, w, y), **FP32)
    torch.testing.assert_close(dh, torch.autograd.grad(reference.linear_cross_entropy(h, w, y), h)[0], **FP32)
    with torch.no_grad():
        off = fastft.linear_cross_entropy(h, w, y, backend=backend)
    assert not off.requires_grad
    torch.testing.assert_close(off, loss.detach(), **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows(backend, device):
    h = torch.zeros(0, 4, device=device, requires_grad=True)
    w = torch.randn(5, 4, device=device)
    y = torch.zeros(0, dtype=torch.long, device=device)
    assert fastft.linear_cross_entropy(h, w, y, backend=backend).isnan()  # torch's mean of nothing
    loss = fastft.linear_cross_entropy(h, w, y, reduction="sum", backend=backend)
    assert loss.item() == 0
    assert torch.autograd.grad(loss, h)[0].shape == (0, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_labels_give_nan_not_a_fault(backend, device, rng):
    h, w, _, y = _inputs(rng, 10, 8, 13, torch.float32, device, bias=False, ignored=0.0)
    for bad in (13, -1, 2**40):
        labels = y.clone()
        labels[3] = bad
        loss = fastft.linear_cross_entropy(h, w, labels, backend=backend)
        dh, dw = torch.autograd.grad(loss, (h, w))
        assert loss.isnan() and dh[3].isnan().all() and dw.isnan().any()
        assert not dh[[0, 1, 2, 4]].isnan().any()  # the other rows' gradients stay numbers


def test_kernel_rows_match_their_formula(device, rng):
    kernels = pytest.importorskip("fastft.kernels.linear_cross_entropy")
    x = (torch.randn(11, 45, generator=rng) * 4).to(device)
    y = torch.randint(0, 45, (11,), generator=rng)
    y[[2, 7]] = -100
    y[5] = 45
    y = y.to(device)
    scale = torch.tensor(0.125, device=device)
    want_loss, want_grad = reference.cross_entropy_rows(x, y, scale, -100)
    logits = x.clone()
    loss = kernels.cross_entropy_rows_(logits, y, scale, -100, True, BLOCK_V=16, num_warps=1)
    torch.testing.assert_close(loss, want_loss, equal_nan=True, **FP32)
    torch.testing.assert_close(logits, want_grad, equal_nan=True, **FP32)
    assert loss[[2, 7]].eq(0).all() and loss[5].isnan() and logits[5].isnan().all()
    logits = x.clone()
    loss = kernels.cross_entropy_rows_(logits, y, scale, -100, False, BLOCK_V=64, num_warps=1)
    torch.testing.assert_close(loss, want_loss, equal_nan=True, **FP32)
    assert torch.equal(logits, x)  # no gradient asked: the logits untouched
    want_loss, want_grad = reference.cross_entropy_rows(x, y, scale, -100, 3.0)
    logits = x.clone()
    loss = kernels.cross_entropy_rows_(logits, y, scale, -100, True, 3.0, BLOCK_V=16, num_warps=1)
    torch.testing.assert_close(loss, want_loss, equal_nan=True, **FP32)
    torch.testing.assert_close(logits, want_grad, equal_nan=True, **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_op_opcheck(backend, device, rng):
    h, w, b, y = _inputs(rng, 9, 8, 21, torch.float32, device)
    for needs in ((True, True, True), (True, False, False), (False, False, False)):
        args = (h.detach(), w.detach(), b.detach(), y, -100, True, 0.5, 3.0, 4, *needs, backend)
        torch.library.opcheck(lce.linear_cross_entropy_op.op, args)


def test_block_rows():
    assert lce.block_rows(16384, 151936, 4096) == 512  # Qwen3-8B: ~37 blocks of the hidden's size
    assert lce.block_rows(100, 151936, 4096) == 100  # fewer rows than the least block
    assert lce.block_rows(16384, 10, 4096) == 16384  # a small vocabulary: one block
    assert lce.block_rows(16384, 151936, 4096, trained_head=True) == 2048  # 8 blocks: the head's gradient 8 sums


def test_argument_checks(rng):
    h, w, b, y = _inputs(rng, 6, 4, 7, torch.float32, "cpu")
    call = fastft.linear_cross_entropy
    cases = [
        (TypeError, "hidden must be a tensor", lambda: call(h.tolist(), w, y)),
        (TypeError, "bias must be None or a tensor", lambda: call(h, w, y, 1.0)),
        (TypeError, "hidden must be float32", lambda: call(h.double(), w.double(), y)),
        (TypeError, "weight must have hidden's dtype", lambda: call(h, w.bfloat16(), y)),
        (TypeError, "labels must be an integer tensor", lambda: call(h, w, y.float())),
        (TypeError, "ignore_index must be an int", lambda: call(h, w, y, ignore_index=-100.0)),
        (ValueError, "reduction must be one of", lambda: call(h, w, y, reduction="none")),
        (ValueError, "weight must be \\[V, H\\]", lambda: call(h, w[:, :3], y)),
        (ValueError, "weight must be \\[V, H\\]", lambda: call(h, w[:0], y)),
        (ValueError, "bias must be \\[V\\]", lambda: call(h, w, y, b[:3])),
        (ValueError, "labels must have hidden's leading shape", lambda: call(h, w, y[:5])),
        (ValueError, "block_size must be an int >= 1", lambda: call(h, w, y, block_size=0)),
        (TypeError, "logit_scale must be a number", lambda: call(h, w, y, logit_scale="2")),
        (ValueError, "logit_scale must be finite", lambda: call(h, w, y, logit_scale=float("inf"))),
        (TypeError, "softcap must be a number", lambda: call(h, w, y, softcap=torch.tensor(30.0))),
        (ValueError, "softcap must be finite and > 0", lambda: call(h, w, y, softcap=0)),
        (ValueError, "softcap must be finite", lambda: call(h, w, y, softcap=float("nan"))),
        (ValueError, "backend must be one of", lambda: call(h, w, y, backend="cuda")),
    ]
    for error, match, fn in cases:
        with pytest.raises(error, match=match):
            fn()


@pytest.mark.gpu
def test_bf16_at_a_real_vocabulary_without_host_sync(rng):
    """Qwen3's vocabulary, 1,000 rows in blocks of 256 (as is and capped): within the stock path's error, and
    no sync."""
    h, w, _, y = _inputs(rng, 1000, 256, 151936, torch.bfloat16, "cuda", bias=False)
    _check(h, w, None, y, "triton", block_size=256)
    _check(h, w, None, y, "triton", block_size=256, softcap=30.0)  # Gemma's cap
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = fastft.linear_cross_entropy(h, w, y, block_size=256)
        torch.autograd.grad(loss, (h, w))
    finally:
        torch.cuda.set_sync_debug_mode(0)
