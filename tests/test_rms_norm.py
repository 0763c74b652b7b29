"""fastft.rms_norm: the reference's written-out gradient against autograd, both backends (output and every
gradient) against the reference on random shapes, strides, offsets, eps and gates (hypothesis), half precision
within the stock module's own error, the backward kernel at launch parameters the dispatcher does not pick,
rows wider than the Triton path's, no rows, frozen weights, rows normalised in groups, argument checks, and on
a GPU bf16 at real widths without a host sync. Tolerance: against fp64, within twice the error the reference
makes in the inputs' dtype plus 1e-5 of the largest value and of each element's terms (bf16/fp16: one ulp of
them)."""

import importlib
import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fastft
from fastft.reference import rms_norm as reference

rn = importlib.import_module("fastft.rms_norm")  # the module (the package's name is the op)
BACKENDS = ["triton", "torch"]
FP32 = dict(atol=1e-5, rtol=1e-5)


# no gate; silu(gate) after the norm (Qwen3.5), before it (gate_first: Mamba-2); sigmoid(gate) after it (Kimi)
# and before it
GATES = [None, (False, "silu"), (True, "silu"), (False, "sigmoid"), (True, "sigmoid")]


def _first(gate) -> bool:
    return gate is not None and gate[0]


def _act(gate) -> str:
    return "silu" if gate is None else gate[1]


def _outputs(fn, x, w, grad, gate=None, **kw):
    out = fn(x, w, gate=gate, **kw) if gate is not None else fn(x, w, **kw)
    leaves = [t for t in (x, w, gate) if t is not None and t.requires_grad]
    return [out, *torch.autograd.grad(out, leaves, grad)]


def _check(
    x, w, backend, *, eps=1e-6, offset=0.0, gate=None, gate_first=False, gate_activation="silu", group_size=None,
    seed=None,
):  # fmt: skip
    """The op against the reference in fp64: within twice the reference's own error in the inputs' dtype plus
    1e-5 (fp32) or one ulp (bf16/fp16) of the largest value."""
    g = torch.Generator().manual_seed(0 if seed is None else seed)
    grad = torch.randn(x.shape, generator=g).to(x.device, x.dtype)
    gated = dict(gate_first=gate_first, gate_activation=gate_activation) if gate is not None else {}
    kw = dict(eps=eps, offset=offset, **gated, **(dict(group_size=group_size) if group_size is not None else {}))
    got = _outputs(fastft.rms_norm, x, w, grad, gate, backend=backend, **kw)
    exact = [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in (x, w, gate)]
    want = _outputs(reference.rms_norm, *exact[:2], grad.double(), exact[2], **kw)
    stock = _outputs(reference.rms_norm, x, w, grad, gate, **kw)
    scales = _term_scales(*exact, grad.double(), **kw)
    names = ["out"] + [n for n, t in zip(("dx", "dweight", "dgate"), (x, w, gate)) if t is not None and t.requires_grad]
    for name, a, s, e in zip(names, got, stock, want, strict=True):
        assert a.dtype == s.dtype and a.shape == s.shape, name
        if not a.numel():
            continue
        ulp = 1e-5 if x.dtype == torch.float32 else torch.finfo(x.dtype).eps
        top = e.abs().max().item()
        bound = 2 * (s.double() - e).abs().max().item() + ulp * (1 + top + scales[name].reshape(e.shape))
        err = (a.double() - e).abs()
        worst = (err - bound).argmax()
        assert (err <= bound).all(), (
            f"{name}: abs error {err.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g} (seed {seed})"
        )


def _term_scales(x, w, gate, dy, *, eps, offset, gate_first=False, gate_activation="silu", group_size=None):
    """Per element of the output and each gradient (by name), the sum of the magnitudes of the terms the reference's
    written-out backward adds (fp64): where they cancel (a group whose few channels normalise to about +-1 has a
    gradient near 0 made of terms of size r |g|), an fp32 result is only as close as a few ulps of those terms,
    whatever the order of its rounding."""
    h = x.shape[-1]
    x, dy = x.detach().reshape(-1, h), dy.reshape(-1, h)
    w = (w.detach() + offset).abs()
    s = ds = None
    if gate is not None:
        z = gate.detach().reshape(-1, h)
        sig = torch.sigmoid(z)
        s, ds = (sig, sig * (1 - sig)) if gate_activation == "sigmoid" else (z * sig, sig * (1 + z * (1 - sig)))
    u = x * s if gate is not None and gate_first else x
    uu = u.unflatten(-1, (1, h) if group_size is None else (-1, group_size))
    r = torch.rsqrt(uu.pow(2).mean(-1, keepdim=True) + eps)
    n = (uu * r).abs()
    e = (dy * s).abs() if gate is not None and not gate_first else dy.abs()
    g = (e * w).unflatten(-1, n.shape[-2:])
    du = (r * (g + n * (g * n).mean(-1, keepdim=True))).flatten(-2)
    dweight = (e * n.flatten(-2)).sum(0)
    scales = dict(out=torch.zeros_like(x), dx=du, dweight=dweight)
    if gate is not None and gate_first:
        scales.update(dx=du * s.abs(), dgate=du * (x * ds).abs())
    elif gate is not None:
        scales.update(dgate=(dy * n.flatten(-2) * w * ds).abs())
    return scales


def test_backward_formula_is_autograd(rng):
    x = (torch.randn(7, 19, generator=rng) * 3).requires_grad_()
    w = torch.randn(19, generator=rng).requires_grad_()
    z = (torch.randn(7, 19, generator=rng) * 2).requires_grad_()
    dy = torch.randn(7, 19, generator=rng)
    for offset in (0.0, 1.0):
        for kind in GATES:
            gate, first, act = None if kind is None else z, _first(kind), _act(kind)
            out = reference.rms_norm(x, w, 1e-5, offset, gate, first, act)
            want = torch.autograd.grad(out, [t for t in (x, w, gate) if t is not None], dy)
            rstd = reference.rms_norm_rstd(x, 1e-5, gate, first, act)
            got = reference.rms_norm_backward(dy, x, w, rstd, offset, gate, first, act)
            assert (got[2] is None) == (gate is None)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("group_size", [1, 4, 6, 12, 24])
def test_grouped_backward_formula_is_autograd(rng, group_size):
    """Rows of 24 in groups of 1 to 24 channels, every gate: the written-out gradient is autograd's, and each
    group's output is the whole-row norm of that group alone."""
    x = (torch.randn(7, 24, generator=rng) * 3).requires_grad_()
    w = torch.randn(24, generator=rng).requires_grad_()
    z = (torch.randn(7, 24, generator=rng) * 2).requires_grad_()
    dy = torch.randn(7, 24, generator=rng)
    for kind in GATES:
        gate, first, act = None if kind is None else z, _first(kind), _act(kind)
        out = reference.rms_norm(x, w, 1e-5, 0.5, gate, first, act, group_size)
        want = torch.autograd.grad(out, [t for t in (x, w, gate) if t is not None], dy)
        rstd = reference.rms_norm_rstd(x, 1e-5, gate, first, act, group_size)
        assert rstd.shape == (7 * 24 // group_size,)
        got = reference.rms_norm_backward(dy, x, w, rstd, 0.5, gate, first, act, group_size)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **FP32)
        for i in range(0, 24, group_size):
            part = slice(i, i + group_size)
            alone = reference.rms_norm(x[:, part], w[part], 1e-5, 0.5, None if gate is None else z[:, part], first, act)
            torch.testing.assert_close(out[:, part], alone, **FP32)


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


def test_reference_is_the_transformers_gated_modules(rng):
    """Qwen3.5's gated norm (``silu(gate)`` after the norm), Mamba-2's (before it) and Kimi-Linear's
    (``sigmoid(gate)`` after it) in fp32."""
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    x, z = torch.randn(5, 3, 24, generator=rng), torch.randn(5, 3, 24, generator=rng) * 2
    grouped = "group_size" in inspect.signature(mamba2.MambaRMSNormGated).parameters  # transformers 5.24's
    before = mamba2.MambaRMSNormGated(24, **(dict(group_size=24) if grouped else {}), eps=1e-5)  # one group
    after = qwen.Qwen3_5RMSNormGated(24, eps=1e-5)
    with torch.no_grad():
        after.weight.normal_(generator=rng)
        before.weight.normal_(generator=rng)
    torch.testing.assert_close(reference.rms_norm(x, after.weight, 1e-5, gate=z), after(x, z), **FP32)
    torch.testing.assert_close(
        reference.rms_norm(x, before.weight, 1e-5, gate=z, gate_first=True), before(x, z), **FP32
    )
    sigmoid = kimi.KimiLinearRMSNormGated(24, eps=1e-5)
    with torch.no_grad():
        sigmoid.weight.normal_(generator=rng)
    assert sigmoid.activation == "sigmoid"
    want = sigmoid(x, z)
    torch.testing.assert_close(reference.rms_norm(x, sigmoid.weight, 1e-5, gate=z, gate_activation="sigmoid"), want)


def test_reference_is_the_transformers_grouped_modules(rng):
    """Zamba2's (Nemotron-H's) gated norm in groups (``silu(gate)`` before it) and Falcon-H1's (``n_groups``,
    the gate after the norm or before it) in fp32."""
    zamba2 = pytest.importorskip("transformers.models.zamba2.modeling_zamba2")
    falcon = pytest.importorskip("transformers.models.falcon_h1.modeling_falcon_h1")
    x, z = torch.randn(5, 3, 24, generator=rng), torch.randn(5, 3, 24, generator=rng) * 2
    grouped = zamba2.Zamba2RMSNormGated(24, group_size=6, eps=1e-5)
    with torch.no_grad():
        grouped.weight.normal_(generator=rng)
    got = reference.rms_norm(x, grouped.weight, 1e-5, gate=z, gate_first=True, group_size=6)
    torch.testing.assert_close(got, grouped(x, z), **FP32)
    for before in (True, False):
        norm = falcon.FalconH1RMSNormGated(24, eps=1e-5, n_groups=4, norm_before_gate=before)
        with torch.no_grad():
            norm.weight.normal_(generator=rng)
        got = reference.rms_norm(x, norm.weight, 1e-5, gate=z, gate_first=not before, group_size=6)
        torch.testing.assert_close(got, norm(x, z), **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 70),
    lead=st.sampled_from([(), (2,), (3, 1)]),
    offset=st.sampled_from([0.0, 1.0, -0.5]),
    eps=st.sampled_from([0.0, 1e-6, 0.1]),
    frozen=st.booleans(),
    strided=st.booleans(),
    gate=st.sampled_from(GATES),
    groups=st.sampled_from([None, 1, 2, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(backend, device, rows, width, lead, offset, eps, frozen, strided, gate, groups, seed):
    group_size = None if groups is None else width
    width *= groups or 1
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, width + strided, generator=g) * 3 + 0.5
    x = x[..., :width] if strided else x  # a row stride past the width
    x = x.to(device).requires_grad_()
    w = torch.randn(width, generator=g).to(device).requires_grad_(not frozen)
    z = None if gate is None else (torch.randn(x.shape, generator=g) * 2).to(device).requires_grad_()
    _check(
        x, w, backend, eps=eps, offset=offset, gate=z, gate_first=_first(gate), gate_activation=_act(gate),
        group_size=group_size, seed=seed,
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_stock_error(backend, device, rng, dtype):
    x = torch.randn(50, 96, generator=rng).to(device, dtype).requires_grad_()
    w = (1 + torch.randn(96, generator=rng) * 0.1).to(device, dtype).requires_grad_()
    _check(x, w, backend)
    _check(x, w.float().detach().requires_grad_(), backend, offset=1.0)  # an fp32 weight beside bf16 rows
    z = torch.randn(50, 96, generator=rng).to(device, dtype).requires_grad_()
    _check(x, w, backend, gate=z)
    _check(x, w, backend, gate=z.float().detach().requires_grad_(), gate_first=True)  # an fp32 gate
    _check(x, w.float().detach().requires_grad_(), backend, gate=z, gate_activation="sigmoid")  # Kimi's


@pytest.mark.parametrize("tile", [16, 32, 128])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("group_size", [None, 5, 10])
def test_forward_kernel_tiles(device, rng, tile, gate, group_size):
    """Tiles of one row (narrower than a row: its block still whole) or several, a last tile cut short; rows of
    one group or of several."""
    kernels = pytest.importorskip("fastft.kernels.rms_norm")
    x = torch.randn(37, 20, generator=rng).to(device)
    w = torch.randn(20, generator=rng).to(device)
    z = None if gate is None else torch.randn(37, 40, generator=rng).to(device)[:, ::2].contiguous()
    first, act = _first(gate), _act(gate)
    out, rstd = kernels.rms_norm_forward(x, w, 1e-6, 1.0, z, first, act, group_size, TILE=tile, num_warps=1)
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-6, 1.0, z, first, act, group_size), **FP32)
    torch.testing.assert_close(rstd, reference.rms_norm_rstd(x, 1e-6, z, first, act, group_size), **FP32)


@pytest.mark.parametrize("programs, tile", [(1, 32), (2, 32), (5, 64), (100, 16)])
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("group_size", [None, 4])
def test_backward_kernel_programs_and_tiles(device, rng, programs, tile, gate, group_size):
    """Programs that each walk several tiles (or none past the last), tiles of one or several rows, rows of
    one group or of several: the weight's partial sums add up to the reference's, with and without its gradient
    asked."""
    kernels = pytest.importorskip("fastft.kernels.rms_norm")
    x = torch.randn(37, 20, generator=rng).to(device)
    w = torch.randn(20, generator=rng).to(device)
    dy = torch.randn(37, 20, generator=rng).to(device)
    z = None if gate is None else torch.randn(37, 20, generator=rng).to(device)
    first, act = _first(gate), _act(gate)
    rstd = reference.rms_norm_rstd(x, 1e-6, z, first, act, group_size)
    want = reference.rms_norm_backward(dy, x, w, rstd, 1.0, z, first, act, group_size)
    kw = dict(programs=programs, TILE=tile, num_warps=1)
    for stages in (1, 3):
        dx, dw, dz = kernels.rms_norm_backward(
            dy, x, w, rstd, 1.0, True, z, first, act, group_size, stages=stages, **kw
        )
        torch.testing.assert_close(dx, want[0], **FP32)
        torch.testing.assert_close(dw, want[1], **FP32)
        if gate is None:
            assert dz is None
        else:
            torch.testing.assert_close(dz, want[2], **FP32)
    dx, dw, _ = kernels.rms_norm_backward(dy, x, w, rstd, 1.0, False, z, first, act, group_size, stages=2, **kw)
    torch.testing.assert_close(dx, want[0], **FP32)
    assert dw.numel() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_of_one_channel_without_eps(backend, device):
    """Each group normalises to +-1 and the gradients are 0 in exact arithmetic: what fp32 returns is a
    cancellation of terms of size r |g|, within a few of their ulps of 0, however each path rounds it (a case the
    hypothesis test found on a GPU, where the reference's own cancellation happened to be smaller)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 39, 3, generator=g) * 3 + 0.5)[..., :2].to(device).requires_grad_()
    w = torch.randn(2, generator=g).to(device).requires_grad_()
    z = (torch.randn(x.shape, generator=g) * 2).to(device).requires_grad_()
    _check(x, w, backend, eps=0.0, offset=-0.5, gate=z, gate_first=True, group_size=1, seed=1)


def test_rows_wider_than_the_triton_path_take_torch(device, rng, monkeypatch):
    monkeypatch.setattr(rn, "MAX_WIDTH", 8)
    x = torch.randn(6, 18, generator=rng).to(device).requires_grad_()
    w = torch.randn(18, generator=rng).to(device).requires_grad_()
    _check(x, w, "triton")
    _check(x, w, "triton", group_size=9)  # groups wider than the Triton path's
    _check(x, w, "triton", group_size=6)
    monkeypatch.setattr(rn, "MAX_GROUPS", 2)
    _check(x, w, "triton", group_size=6)  # more groups than the Triton path's grid takes


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
    z = torch.randn(9, 12, generator=rng).to(device)
    for kind in GATES:
        gate, first, act = None if kind is None else z, _first(kind), _act(kind)
        for group_size in (12, 4):
            torch.library.opcheck(rn.rms_norm_op.op, (x, w, gate, 1e-6, 1.0, first, act, group_size, backend))
            rstd = reference.rms_norm_rstd(x, 1e-6, gate, first, act, group_size)
            for grad_weight in (True, False):
                dy = torch.randn(9, 12, generator=rng).to(device)
                args = (dy, x, w, gate, rstd, 0.0, first, act, group_size, grad_weight, backend)
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
        (TypeError, "gate must be a tensor", lambda: call(x, w, gate=x.tolist())),
        (TypeError, "gate must be float32, bfloat16 or float16", lambda: call(x, w, gate=x.int())),
        (ValueError, "gate must have x's shape \\(3, 4\\)", lambda: call(x, w, gate=x[:2])),
        (TypeError, "gate_first must be True or False", lambda: call(x, w, gate=x, gate_first="yes")),
        (ValueError, "gate_first=True gates the input before the norm: give gate", lambda: call(x, w, gate_first=True)),
        (
            TypeError,
            "gate_activation must be 'silu' or 'sigmoid', got NoneType",
            lambda: call(x, w, gate=x, gate_activation=None),
        ),
        (
            ValueError,
            "gate_activation must be 'silu' or 'sigmoid', got 'gelu'",
            lambda: call(x, w, gate=x, gate_activation="gelu"),
        ),
        (
            ValueError,
            "gate_activation='sigmoid' is the gate's activation: give gate",
            lambda: call(x, w, gate_activation="sigmoid"),
        ),
        (TypeError, "group_size must be an int, got float 2.0", lambda: call(x, w, group_size=2.0)),
        (TypeError, "group_size must be an int, got bool", lambda: call(x, w, group_size=True)),
        (ValueError, "group_size must be an int >= 1, got 0", lambda: call(x, w, group_size=0)),
        (ValueError, "group_size must divide x's last dim 4, got 3", lambda: call(x, w, group_size=3)),
    ]
    for error, match, fn in cases:
        with pytest.raises(error, match=match):
            fn()


@pytest.mark.gpu
def test_bf16_at_real_widths_without_host_sync(rng):
    """Qwen3-8B's hidden rows and its per-head query norm (128 wide), 16,384 tokens, and the gated norms of
    Qwen3.5 and Granite-4.0-H: within the reference's error, and no sync."""
    for shape in ((16384, 4096), (16384, 32, 128)):
        x = torch.randn(shape, generator=rng).to("cuda", torch.bfloat16).requires_grad_()
        w = (1 + torch.randn(shape[-1], generator=rng) * 0.1).to("cuda", torch.bfloat16).requires_grad_()
        _check(x, w, "triton")
    # Qwen3.5's gated norm (32 value heads of 128), Granite-4.0-H's (3,072 channels), Kimi-Linear's (32 heads
    # of 128, a sigmoid gate), Nemotron-H 8B's (8,192 channels in 8 groups)
    for shape, first, act, group_size in (
        ((16384, 32, 128), False, "silu", None),
        ((16384, 3072), True, "silu", None),
        ((16384, 32, 128), False, "sigmoid", None),
        ((16384, 8192), True, "silu", 1024),
    ):
        x, z = (torch.randn(shape, generator=rng).to("cuda", torch.bfloat16).requires_grad_() for _ in range(2))
        w = (1 + torch.randn(shape[-1], generator=rng) * 0.1).to("cuda", torch.bfloat16).requires_grad_()
        _check(x, w, "triton", gate=z, gate_first=first, gate_activation=act, group_size=group_size)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fastft.rms_norm(x, w, 1e-6)
        torch.autograd.grad(out, (x, w), torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_the_check_command_case(device, rng):
    """``python -m fastft check``'s rms_norm case (gates and groups drawn): the dispatched backend against the
    reference, and its gradients."""
    from fastft import selfcheck

    assert selfcheck.CHECKS["rms_norm"] is selfcheck.check_rms_norm
    for _ in range(8):
        selfcheck.check_rms_norm(rng, device, 24)
