"""fastft.rms_norm: the reference's written-out gradient against autograd, both backends (output and both
gradients) against the reference on random shapes, strides, offsets and eps (hypothesis), half precision
within the stock module's own error, the backward kernel at launch parameters the dispatcher does not pick,
rows wider than the Triton path's, no rows, frozen weights, argument checks, and on a GPU bf16 at real widths
without a host sync. Tolerance: against fp64, within twice the error the reference makes in the inputs' dtype
plus 1e-5 of the largest value (bf16/fp16: one ulp of it)."""

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fastft
from fastft.reference import rms_norm as reference

rn = importlib.import_module("fastft.rms_norm")  # the module (the package's name is the op)
BACKENDS = ["triton", "torch"]
FP32 = dict(atol=1e-5, rtol=1e-5)


def _outputs(fn, x, w, grad, **kw):
    out = fn(x, w, **kw)
    leaves = [t for t in (x, w) if t.requires_grad]
    return [out, *torch.autograd.grad(out, leaves, grad)]


def _check(x, w, backend, *, eps=1e-6, offset=0.0, seed=None):
    """The op against the reference in fp64: within twice the reference's own error in the inputs' dtype plus
    1e-5 (fp32) or one ulp (bf16/fp16) of the largest value."""
    g = torch.Generator().manual_seed(0 if seed is None else seed)
    grad = torch.randn(x.shape, generator=g).to(x.device, x.dtype)
    got = _outputs(fastft.rms_norm, x, w, grad, eps=eps, offset=offset, backend=backend)
    exact = [t.detach().double().requires_grad_(t.requires_grad) for t in (x, w)]
    want = _outputs(reference.rms_norm, *exact, grad.double(), eps=eps, offset=offset)
    stock = _outputs(reference.rms_norm, x, w, grad, eps=eps, offset=offset)
    for name, a, s, e in zip(["out", "dx", "dweight"], got, stock, want):
        assert a.dtype == s.dtype and a.shape == s.shape, name
        err = (a.double() - e).abs().max().item() if a.numel() else 0.0
        ulp = 1e-5 if x.dtype == torch.float32 else torch.finfo(x.dtype).eps
        top = e.abs().max().item() if e.numel() else 0.0
        bound = 2 * ((s.double() - e).abs().max().item() if s.numel() else 0.0) + ulp * (1 + top)
        assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g} (seed {seed})"


def test_backward_formula_is_autograd(rng):
    x = (torch.randn(7, 19, generator=rng) * 3).requires_grad_()
    w = torch.randn(19, generator=rng).requires_grad_()
    dy = torch.randn(7, 19, generator=rng)
    for offset in (0.0, 1.0):
        out = reference.rms_norm(x, w, 1e-5, offset)
        want = torch.autograd.grad(out, (x, w), dy)
        got = reference.rms_norm_backward(dy, x, w, reference.rms_norm_rstd(x, 1e-5), offset)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **FP32)


def test_reference_is_the_transformers_modules(rng):
    """Llama's norm (``offset=0``, within its extra rounding) and Gemma's (``offset=1``) in fp32."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(5, 3, 24, generator=rng)
    llama, gemma = LlamaRMSNorm(24, eps=1e-5), GemmaRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        llama.weight.normal_(generator=rng)
        gemma.weight.normal_(generator=rng)
    assert transformers is not None
    torch.testing.assert_close(reference.rms_norm(x, llama.weight, 1e-5), llama(x), **FP32)
    torch.testing.assert_close(reference.rms_norm(x, gemma.weight, 1e-5, 1.0), gemma(x), **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 70),
    lead=st.sampled_from([(), (2,), (3, 1)]),
    offset=st.sampled_from([0.0, 1.0, -0.5]),
    eps=st.sampled_from([0.0, 1e-6, 0.1]),
    frozen=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(backend, device, rows, width, lead, offset, eps, frozen, strided, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, width + strided, generator=g) * 3 + 0.5
    x = x[..., :width] if strided else x  # a row stride past the width
    x = x.to(device).requires_grad_()
    w = torch.randn(width, generator=g).to(device).requires_grad_(not frozen)
    _check(x, w, backend, eps=eps, offset=offset, seed=seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_stock_error(backend, device, rng, dtype):
    x = torch.randn(50, 96, generator=rng).to(device, dtype).requires_grad_()
    w = (1 + torch.randn(96, generator=rng) * 0.1).to(device, dtype).requires_grad_()
    _check(x, w, backend)
    _check(x, w.float().detach().requires_grad_(), backend, offset=1.0)  # an fp32 weight beside bf16 rows


@pytest.mark.parametrize("tile", [16, 32, 128])
def test_forward_kernel_tiles(device, rng, tile):
    """Tiles of one row (narrower than a row: its block still whole) or several, a last tile cut short."""
    kernels = pytest.importorskip("fastft.kernels.rms_norm")
    x = torch.randn(37, 20, generator=rng).to(device)
    w = torch.randn(20, generator=rng).to(device)
    out, rstd = kernels.rms_norm_forward(x, w, 1e-6, 1.0, TILE=tile, num_warps=1)
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-6, 1.0), **FP32)
    torch.testing.assert_close(rstd, reference.rms_norm_rstd(x, 1e-6), **FP32)


@pytest.mark.parametrize("programs, tile", [(1, 32), (2, 32), (5, 64), (100, 16)])
def test_backward_kernel_programs_and_tiles(device, rng, programs, tile):
    """Programs that each walk several tiles (or none past the last), tiles of one or several rows: the
    weight's partial sums add up to the reference's, with and without its gradient asked."""
    kernels = pytest.importorskip("fastft.kernels.rms_norm")
    x = torch.randn(37, 20, generator=rng).to(device)
    w = torch.randn(20, generator=rng).to(device)
    dy = torch.randn(37, 20, generator=rng).to(device)
    rstd = reference.rms_norm_rstd(x, 1e-6)
    want = reference.rms_norm_backward(dy, x, w, rstd, 1.0)
    kw = dict(programs=programs, TILE=tile, num_warps=1)
    for stages in (1, 3):
        dx, dw = kernels.rms_norm_backward(dy, x, w, rstd, 1.0, True, stages=stages, **kw)
        torch.testing.assert_close(dx, want[0], **FP32)
        torch.testing.assert_close(dw, want[1], **FP32)
    dx, dw = kernels.rms_norm_backward(dy, x, w, rstd, 1.0, False, stages=2, **kw)
    torch.testing.assert_close(dx, want[0], **FP32)
    assert dw.numel() == 0


def test_rows_wider_than_the_triton_path_take_torch(device, rng, monkeypatch):
    monkeypatch.setattr(rn, "MAX_WIDTH", 8)
    x = torch.randn(6, 9, generator=rng).to(device).requires_grad_()
    w = torch.randn(9, generator=rng).to(device).requires_grad_()
    _check(x, w, "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows_and_no_grad(backend, device, rng):
    x = torch.zeros(0, 3, 8, device=device, requires_grad=True)
    w = torch.ones(8, device=device, requires_grad=True)
    out = fastft.rms_norm(x, w, backend=backend)
    assert out.shape == (0, 3, 8)
    dx, dw = torch.autograd.grad(out.sum(), (x, w))
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros(8, device=device))
    x = torch.randn(4, 8, generator=rng).to(device)
    with torch.no_grad():
        out = fastft.rms_norm(x, w, backend=backend)
    assert not out.requires_grad
    torch.testing.assert_close(out, reference.rms_norm(x, w.detach(), 1e-6), **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_op_opcheck(backend, device, rng):
    x = torch.randn(9, 12, generator=rng).to(device)
    w = torch.randn(12, generator=rng).to(device)
    torch.library.opcheck(rn.rms_norm_op.op, (x, w, 1e-6, 1.0, backend))
    rstd = reference.rms_norm_rstd(x, 1e-6)
    for grad_weight in (True, False):
        args = (torch.randn(9, 12, generator=rng).to(device), x, w, rstd, 0.0, grad_weight, backend)
        torch.library.opcheck(rn.rms_norm_backward_op.op, args)


def test_argument_checks(rng):
    x, w = torch.randn(3, 4, generator=rng), torch.randn(4, generator=rng)
    call = fastft.rms_norm
    cases = [
        (TypeError, "x must be a tensor", lambda: call(x.tolist(), w)),
        (TypeError, "weight must be a tensor", lambda: call(x, None)),
        (TypeError, "x must be float32, bfloat16 or float16", lambda: call(x.double(), w)),
        (TypeError, "weight must be float32, bfloat16 or float16", lambda: call(x, w.int())),
        (ValueError, "x must be \\[..., H\\], got a 0-d", lambda: call(x[0, 0], w[:1])),
        (ValueError, "weight must be \\[H\\] = \\[4\\]", lambda: call(x, w[:3])),
        (ValueError, "weight must be \\[H\\] = \\[4\\]", lambda: call(x, w[None])),
        (TypeError, "eps must be a number", lambda: call(x, w, "1e-6")),
        (ValueError, "eps must be >= 0", lambda: call(x, w, -1e-6)),
        (ValueError, "eps must be finite", lambda: call(x, w, float("inf"))),
        (ValueError, "offset must be finite", lambda: call(x, w, offset=float("nan"))),
        (ValueError, "backend must be one of", lambda: call(x, w, backend="cuda")),
    ]
    for error, match, fn in cases:
        with pytest.raises(error, match=match):
            fn()


@pytest.mark.gpu
def test_bf16_at_real_widths_without_host_sync(rng):
    """Qwen3-8B's hidden rows and its per-head query norm (128 wide), 16,384 tokens: within the reference's
    error, and no sync."""
    for shape in ((16384, 4096), (16384, 32, 128)):
        x = torch.randn(shape, generator=rng).to("cuda", torch.bfloat16).requires_grad_()
        w = (1 + torch.randn(shape[-1], generator=rng) * 0.1).to("cuda", torch.bfloat16).requires_grad_()
        _check(x, w, "triton")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fastft.rms_norm(x, w, 1e-6)
        torch.autograd.grad(out, (x, w), torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)
