"""fastft.swiglu: the reference against transformers' own experts gates, dense MLP and Gemma's GeGLU, both
backends (forward and gradient) against the reference on random shapes, activations and constants (hypothesis),
the gate and up fused or apart, clamp bounds, odd strides, bf16, argument checks, and on a GPU bf16 at the e2e
MoE and dense MLP widths without a host sync. fp32 tolerance: 1e-5."""

import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fastft
from fastft.reference import swiglu as reference

FP32 = dict(atol=1e-5, rtol=1e-5)
GPT_OSS = dict(interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)


def _grad(out, x, grad):
    (dx,) = torch.autograd.grad(out, x, grad)
    return dx


def _check(x, backend, rng, tol=FP32, **kw):
    """fastft.swiglu on ``backend`` against the reference in fp32: output and gradient."""
    out = fastft.swiglu(x, backend=backend, **kw)
    assert out.shape == (*x.shape[:-1], x.shape[-1] // 2) and out.dtype == x.dtype
    grad = torch.randn(out.shape, generator=rng).to(x.device, x.dtype)
    leaf = x.detach().float().requires_grad_()
    want = reference.swiglu(leaf, **kw)
    torch.testing.assert_close(out.float(), want, **tol)
    dx = _grad(out, x, grad)
    assert dx.dtype == x.dtype
    torch.testing.assert_close(dx.float(), _grad(want, leaf, grad.float()), **tol)


def test_reference_is_transformers_gates(rng):
    x = torch.randn(9, 2 * 13, generator=rng) * 4
    gate, up = x.chunk(2, dim=-1)  # transformers' default experts gate with SiLU
    torch.testing.assert_close(reference.swiglu(x), F.silu(gate) * up, **FP32)
    gate, up = x[..., ::2].clamp(max=7.0), x[..., 1::2].clamp(-7.0, 7.0)  # gpt-oss's _apply_gate, step by step
    torch.testing.assert_close(reference.swiglu(x, **GPT_OSS), (up + 1) * (gate * torch.sigmoid(gate * 1.702)), **FP32)
    # the layouts differ: the test above can fail
    assert not torch.allclose(reference.swiglu(x, interleaved=True), reference.swiglu(x), **FP32)


def test_reference_gelu_tanh_is_gemmas_mlp(rng):
    """``activation="gelu_tanh"`` is Gemma's ``act_fn(gate_proj(x)) * up_proj(x)`` with transformers' GELUTanh
    (both its forms), and the backward written out is autograd's through the reference."""
    activations = pytest.importorskip("transformers.activations")
    gate, up = (torch.randn(9, 13, generator=rng) * 4 for _ in range(2))
    for act in (activations.GELUTanh(), activations.GELUTanh(use_gelu_tanh_python=True)):
        torch.testing.assert_close(reference.swiglu(gate, up, activation="gelu_tanh"), act(gate) * up, **FP32)
    assert not torch.allclose(reference.swiglu(gate, up, activation="gelu_tanh"), reference.swiglu(gate, up))
    dy = torch.randn(9, 13, generator=rng)
    for kw in (dict(limit=None, up_shift=0.0), dict(limit=2.0, up_shift=1.0)):
        leaves = [t.clone().requires_grad_() for t in (gate, up)]
        want = torch.autograd.grad(reference.swiglu(*leaves, **kw, activation="gelu_tanh"), leaves, dy)
        got = reference.swiglu_pair_backward(dy, gate, up, 1.0, *kw.values(), "gelu_tanh")
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **FP32)


def _check_pair(gate, up, backend, rng, tol=FP32, **kw):
    """fastft.swiglu(gate, up) on ``backend`` against the reference in fp32: output and both gradients."""
    out = fastft.swiglu(gate, up, backend=backend, **kw)
    assert out.shape == gate.shape and out.dtype == gate.dtype
    grad = torch.randn(out.shape, generator=rng).to(gate.device, gate.dtype)
    leaves = [t.detach().float().requires_grad_() for t in (gate, up)]
    want = reference.swiglu(*leaves, **kw)
    torch.testing.assert_close(out.float(), want, **tol)
    got = torch.autograd.grad(out, (gate, up), grad)
    for a, b in zip(got, torch.autograd.grad(want, leaves, grad.float())):
        assert a.dtype == gate.dtype and a.shape == gate.shape
        torch.testing.assert_close(a.float(), b, **tol)


def test_reference_pair_is_transformers_dense_mlp(rng):
    """``swiglu(gate, up)`` is LlamaMLP's ``act_fn(gate_proj(x)) * up_proj(x)`` with SiLU, and the fused form's
    halves given apart."""
    gate, up = (torch.randn(9, 13, generator=rng) * 4 for _ in range(2))
    torch.testing.assert_close(reference.swiglu(gate, up), F.silu(gate) * up, **FP32)
    torch.testing.assert_close(
        reference.swiglu(gate, up, alpha=1.702, limit=0.5),
        reference.swiglu(torch.cat((gate, up), dim=-1), alpha=1.702, limit=0.5),
        **FP32,
    )
    dy = torch.randn(9, 13, generator=rng)
    leaves = [t.clone().requires_grad_() for t in (gate, up)]
    want = torch.autograd.grad(reference.swiglu(*leaves, limit=2.0, up_shift=1.0), leaves, dy)
    got = reference.swiglu_pair_backward(dy, gate, up, 1.0, 2.0, 1.0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@given(
    rows=st.integers(0, 40),
    width=st.integers(1, 37),
    alpha=st.sampled_from([1.0, 1.702]),
    limit=st.sampled_from([None, 0.75]),
    up_shift=st.sampled_from([0.0, 1.0]),
    activation=st.sampled_from(["silu", "gelu_tanh"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_pair_matches_reference(backend, device, rows, width, alpha, limit, up_shift, activation, seed):
    rng = torch.Generator().manual_seed(seed)
    gate, up = ((torch.randn(rows, width, generator=rng) * 3).to(device).requires_grad_() for _ in range(2))
    alpha = 1.0 if activation == "gelu_tanh" else alpha
    _check_pair(gate, up, backend, rng, alpha=alpha, limit=limit, up_shift=up_shift, activation=activation)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_pair_any_strides_and_leading_dims(backend, device, rng):
    base = torch.randn(2, 5, 40, generator=rng).to(device)
    gate = base[..., 3:27].requires_grad_()  # rows strided past the 24 columns used
    up = torch.randn(24, 10, generator=rng).to(device).t().reshape(2, 5, 24).requires_grad_()
    _check_pair(gate, up, backend, rng)
    _check_pair(gate, up, backend, rng, tol=FP32, alpha=1.702, limit=1.5)


def test_reference_is_gpt_oss_apply_gate(rng):
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    block = types.SimpleNamespace(alpha=1.702, limit=7.0)
    x = torch.randn(7, 2 * 11, generator=rng) * 5
    torch.testing.assert_close(reference.swiglu(x, **GPT_OSS), modeling.GptOssExperts._apply_gate(block, x), **FP32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@given(
    rows=st.integers(0, 40),
    width=st.integers(1, 37),
    interleaved=st.booleans(),
    alpha=st.sampled_from([1.0, 1.702, 0.5]),
    limit=st.sampled_from([None, 7.0, 0.75]),
    up_shift=st.sampled_from([0.0, 1.0, -0.5]),
    activation=st.sampled_from(["silu", "gelu_tanh"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(backend, device, rows, width, interleaved, alpha, limit, up_shift, activation, seed):
    rng = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * width, generator=rng) * 3).to(device).requires_grad_()
    alpha = 1.0 if activation == "gelu_tanh" else alpha
    _check(x, backend, rng, interleaved=interleaved, alpha=alpha, limit=limit, up_shift=up_shift, activation=activation)


def test_kernel_tiles(device, rng):
    """Tiles of a few rows and columns (the dispatcher's on the CPU cover a small input in one program): every
    layout's output and gradients as the reference's."""
    kernels = pytest.importorskip("fastft.kernels.swiglu")
    x = torch.randn(13, 2 * 21, generator=rng).to(device) * 3
    dy = torch.randn(13, 21, generator=rng).to(device)
    for block_r, block_c, gelu in ((2, 8, False), (4, 16, True), (1, 32, False), (1, 32, True)):
        tiles = dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=1)
        kw = dict(alpha=1.0 if gelu else 1.702, limit=2.0, up_shift=1.0)
        act = "gelu_tanh" if gelu else "silu"
        for interleaved in (False, True):
            gate, up = (x, x) if interleaved else (x[:, :21], x[:, 21:])
            out = kernels.swiglu_forward(gate, up, interleaved, *kw.values(), gelu, **tiles)
            torch.testing.assert_close(out, reference.swiglu(x, interleaved=interleaved, **kw, activation=act), **FP32)
            dx = torch.empty_like(x)
            dgate, dup = (dx, dx) if interleaved else (dx[:, :21], dx[:, 21:])
            kernels.swiglu_backward(dy, gate, up, dgate, dup, interleaved, *kw.values(), gelu, **tiles)
            want = reference.swiglu_backward(dy, x, interleaved, *kw.values(), act)
            torch.testing.assert_close(dx, want, **FP32)
        gate, up = x[:, :21].contiguous(), x[:, 21:].contiguous()  # apart
        out = kernels.swiglu_forward(gate, up, False, *kw.values(), gelu, **tiles)
        torch.testing.assert_close(out, reference.swiglu(gate, up, **kw, activation=act), **FP32)
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        kernels.swiglu_backward(dy, gate, up, dgate, dup, False, *kw.values(), gelu, **tiles)
        for a, b in zip((dgate, dup), reference.swiglu_pair_backward(dy, gate, up, *kw.values(), act)):
            torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_clamp_bounds_pass_gradient_as_torch_clamp(backend, device, rng):
    """Entries at the bounds keep their gradient, those beyond get none (torch.clamp's rule)."""
    limit = 2.0
    gate = torch.tensor([-3.0, 1.0, 2.0, 2.5, 9.0, 0.5])  # the last up's gradient is zero by its clamp alone
    up = torch.tensor([-2.5, -2.0, 0.5, 2.0, 3.0, -9.0])
    x = torch.stack([gate, up], dim=-1).reshape(1, -1).to(device).requires_grad_()  # interleaved
    _check(x, backend, rng, interleaved=True, alpha=1.702, limit=limit, up_shift=1.0)
    out = fastft.swiglu(x, interleaved=True, alpha=1.702, limit=limit, up_shift=1.0, backend=backend)
    dx = _grad(out, x, torch.ones_like(out)).reshape(-1, 2).cpu()
    assert (dx[:, 0] == 0).tolist() == [False, False, False, True, True, False]  # gate beyond 2: none
    assert (dx[:, 1] == 0).tolist() == [True, False, False, False, True, True]  # up outside [-2, 2]: none


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("limit", [None, 7.0])
def test_nan_inputs_as_autograd_through_the_reference(backend, device, limit, rng):
    """A NaN gate or up gives the gradient autograd gives through the reference: NaN where it flows, and none
    through a clamp (a NaN lies outside the bounds)."""
    x = torch.randn(3, 2 * 8, generator=rng).to(device)
    x[0, 0] = x[1, 8 + 3] = x[2, 5] = x[2, 8 + 5] = float("nan")
    kw = dict(alpha=1.702, limit=limit, up_shift=1.0)
    leaf = x.detach().clone().requires_grad_()
    out = fastft.swiglu(leaf, backend=backend, **kw)
    dx = _grad(out, leaf, torch.ones_like(out))
    ref = x.detach().clone().requires_grad_()
    want = reference.swiglu(ref, **kw)
    torch.testing.assert_close(out, want, equal_nan=True, **FP32)
    torch.testing.assert_close(dx, _grad(want, ref, torch.ones_like(want)), equal_nan=True, **FP32)
    assert dx[0, 0].isnan().item() == (limit is None)  # the clamp stops a NaN gate's gradient


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_any_strides_and_leading_dims(backend, device, rng):
    base = torch.randn(3, 5, 40, generator=rng).to(device)
    x = base[..., 4:36].requires_grad_()  # rows strided past the 32 columns used
    assert x.stride(-2) == 40
    _check(x, backend, rng, interleaved=False)
    xt = torch.randn(2 * 9, 6, generator=rng).to(device).t().requires_grad_()  # column stride != 1
    _check(xt, backend, rng, **GPT_OSS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_rounding(device, rng, dtype):
    x = (torch.randn(33, 2 * 24, generator=rng) * 3).to(device, dtype).requires_grad_()
    for kw in ({}, GPT_OSS):
        _check(x, "triton", rng, tol=dict(atol=2e-2, rtol=1.6e-2), **kw)  # output and gradient rounded once
    gate, up = x.detach()[:, :24].requires_grad_(), x.detach()[:, 24:].requires_grad_()
    for activation in ("silu", "gelu_tanh"):
        _check_pair(gate, up, "triton", rng, tol=dict(atol=2e-2, rtol=1.6e-2), activation=activation)


def test_torch_compile_traces_the_op_and_its_backward(device, rng):
    x = (torch.randn(9, 2 * 7, generator=rng) * 3).to(device).requires_grad_()
    grad = torch.randn(9, 7, generator=rng).to(device)
    compiled = torch.compile(lambda t: fastft.swiglu(t, **GPT_OSS), fullgraph=True, backend="aot_eager")
    out = compiled(x)
    want = fastft.swiglu(x, **GPT_OSS)
    torch.testing.assert_close(out, want, **FP32)
    torch.testing.assert_close(_grad(out, x, grad), _grad(want, x, grad), **FP32)


def test_checks_arguments(device):
    x = torch.randn(4, 6, device=device)
    with pytest.raises(TypeError, match="gate_up must be a tensor"):
        fastft.swiglu([[1.0, 2.0]])
    with pytest.raises(TypeError, match="gate_up must be float32"):
        fastft.swiglu(x.long())
    with pytest.raises(ValueError, match="even last dim"):
        fastft.swiglu(torch.randn(4, 5, device=device))
    with pytest.raises(ValueError, match="even last dim"):
        fastft.swiglu(torch.tensor(1.0, device=device))
    with pytest.raises(TypeError, match="interleaved must be True or False"):
        fastft.swiglu(x, interleaved=1)
    with pytest.raises(TypeError, match="alpha must be a number"):
        fastft.swiglu(x, alpha=True)
    with pytest.raises(ValueError, match="alpha must be finite"):
        fastft.swiglu(x, alpha=float("nan"))
    with pytest.raises(TypeError, match="up_shift must be a number"):
        fastft.swiglu(x, up_shift="1")
    for bad in (0.0, -1.0, 1e39):  # the clamp runs in fp32: a larger limit cannot be represented
        with pytest.raises(ValueError, match=r"limit must be None or in \(0, float32's max\]"):
            fastft.swiglu(x, limit=bad)
    with pytest.raises(ValueError, match="limit must be finite"):
        fastft.swiglu(x, limit=float("inf"))
    with pytest.raises(ValueError, match="backend must be one of"):
        fastft.swiglu(x, backend="cuda")
    with pytest.raises(TypeError, match="up must be None or a tensor"):
        fastft.swiglu(x, [1.0])
    for bad in (x[:, :3], x.double(), x.half()):
        with pytest.raises(ValueError, match="up must have the gate's shape, dtype and device"):
            fastft.swiglu(x, bad)
    with pytest.raises(ValueError, match="interleaved must be False when up is given"):
        fastft.swiglu(x, x, interleaved=True)
    with pytest.raises(TypeError, match="activation must be a string"):
        fastft.swiglu(x, activation=None)
    with pytest.raises(ValueError, match="activation must be one of"):
        fastft.swiglu(x, activation="gelu")  # the erf form is not this op's
    with pytest.raises(ValueError, match="alpha must be 1 with activation='gelu_tanh'"):
        fastft.swiglu(x, alpha=1.702, activation="gelu_tanh")
    fastft.swiglu(torch.randn(4, 5, device=device), torch.randn(4, 5, device=device))  # odd widths apart: fine


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", [(3, 0), (0,), (2, 3, 0), (0, 4)])
def test_empty(backend, device, shape):
    x = torch.zeros(shape, device=device, requires_grad=True)
    out = fastft.swiglu(x, backend=backend)
    assert out.shape == shape[:-1] + (shape[-1] // 2,) and out.dtype == x.dtype
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == shape
    gate, up = (torch.zeros(shape, device=device, requires_grad=True) for _ in range(2))
    out = fastft.swiglu(gate, up, backend=backend)
    assert out.shape == shape
    out.sum().backward()
    assert gate.grad.shape == shape and up.grad.shape == shape


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width,kw", [(131072, 768, {}), (65536, 2880, GPT_OSS), (16384, 512, {})])
def test_gpu_bf16_at_moe_widths_without_sync(rng, rows, width, kw):
    """Qwen3-30B-A3B, gpt-oss-20b and Qwen3.5-MoE experts rows of a 16k-token step, bf16, against fp32."""
    x = (torch.randn(rows, 2 * width, generator=rng) * 3).to("cuda", torch.bfloat16).requires_grad_()
    grad = torch.randn(rows, width, generator=rng).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fastft.swiglu(x, **kw)
        dx = _grad(out, x, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    leaf = x.detach().float().requires_grad_()
    want = reference.swiglu(leaf, **kw)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(dx.float(), _grad(want, leaf, grad.float()), atol=2e-2, rtol=1.6e-2)


@pytest.mark.gpu
def test_gpu_pair_bf16_at_dense_mlp_widths_without_sync(rng):
    """Qwen3-8B's MLP (12,288 wide) over a 16k-token step, gate and up apart, bf16, against fp32."""
    gate, up = (
        (torch.randn(16384, 12288, generator=rng) * 3).to("cuda", torch.bfloat16).requires_grad_() for _ in range(2)
    )
    grad = torch.randn(16384, 12288, generator=rng).to("cuda", torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fastft.swiglu(gate, up)
        got = torch.autograd.grad(out, (gate, up), grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    leaves = [t.detach().float().requires_grad_() for t in (gate, up)]
    want = reference.swiglu(*leaves)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=1.6e-2)
    for a, b in zip(got, torch.autograd.grad(want, leaves, grad.float())):
        torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=1.6e-2)


def test_the_check_command_case(device, rng):
    """``python -m fastft check``'s swiglu case: the dispatched backend against the reference, and its gradient."""
    from fastft import selfcheck

    assert selfcheck.CHECKS["swiglu"] is selfcheck.check_swiglu
    for _ in range(5):
        selfcheck.check_swiglu(rng, device, 24)
