"""fastft.rotary: the reference against transformers' apply_rotary_pos_emb (full and partial; Cohere's, GLM's and
Helium's interleaved pairs), the reference's written-out gradient against autograd, both backends (outputs and
gradients) against the reference on random shapes, layouts, rotary widths and pairings (hypothesis), the kernel
at launch parameters the dispatcher does not pick, half precision within one rounding, argument checks, and on a
GPU bf16 at Qwen3-8B's widths without a host sync. fp32 tolerance: 1e-5."""

import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fastft
from fastft.reference import rotary as reference

rotary_module = importlib.import_module("fastft.rotary")  # the module (the package's name is the op)
FP32 = dict(atol=1e-5, rtol=1e-5)


def _angles(batch, tokens, r, rng, device="cpu", halves=True):
    """cos and sin ``[batch, tokens, r]``: transformers' (two equal halves) or any angles."""
    if halves:
        a = torch.randn(batch, tokens, r // 2, generator=rng) * 3
        a = torch.cat((a, a), dim=-1)
    else:
        a = torch.randn(batch, tokens, r, generator=rng) * 3
    return a.cos().to(device), a.sin().to(device)


def _qk(batch, heads_q, heads_k, tokens, width, rng, device="cpu", transposed=True, dtype=torch.float32):
    def one(h):
        if transposed:  # transformers: view(B, T, H, D).transpose(1, 2)
            t = torch.randn(batch, tokens, h, width, generator=rng).transpose(1, 2)
        else:
            t = torch.randn(batch, h, tokens, width, generator=rng)
        return t.to(device, dtype).requires_grad_()

    return one(heads_q), one(heads_k)


def _check(q, k, cos, sin, backend, rng, tol=FP32, interleaved=False):
    """fastft.rotary on ``backend`` against the reference in fp32: outputs, their layout, and both gradients."""
    out = fastft.rotary(q, k, cos, sin, interleaved=interleaved, backend=backend)
    leaves = [t.detach().float().requires_grad_() for t in (q, k)]
    want = reference.rotary(*leaves, cos.float(), sin.float(), interleaved)
    grads = [torch.randn(t.shape, generator=rng).to(t.device, t.dtype) for t in (q, k)]
    got = torch.autograd.grad(out, (q, k), grads)
    want_grads = torch.autograd.grad(want, leaves, [g.float() for g in grads])
    for a, b, x in zip([*out, *got], [*want, *want_grads], [q, k, q, k]):
        assert a.shape == x.shape and a.dtype == x.dtype
        torch.testing.assert_close(a.float(), b, **tol)
    for a, x in zip(out, (q, k)):
        if backend == "triton" and min(x.shape) > 1:  # torch.empty_like's layout (a size-1 dim's stride is free)
            assert a.stride() == x.stride()


@pytest.mark.parametrize("interleaved", [False, True])
def test_backward_formula_is_autograd(rng, interleaved):
    q, k = _qk(2, 3, 2, 9, 12, rng)
    cos, sin = _angles(2, 9, 8, rng, halves=False)  # any angles: the halves of cos and sin differ
    out = reference.rotary(q, k, cos, sin, interleaved)
    dy = [torch.randn(t.shape, generator=rng) for t in out]
    want = torch.autograd.grad(out, (q, k), dy)
    for a, b in zip(reference.rotary_backward(*dy, cos, sin, interleaved), want):
        torch.testing.assert_close(a, b, **FP32)


def test_reference_is_transformers(rng):
    """Llama's apply_rotary_pos_emb (full), GPT-NeoX's and Phi-3's (partial), in fp32."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    neox = importlib.import_module("transformers.models.gpt_neox.modeling_gpt_neox")
    phi3 = importlib.import_module("transformers.models.phi3.modeling_phi3")
    q, k = (t.detach() for t in _qk(2, 4, 2, 11, 16, rng))
    cos, sin = _angles(2, 11, 16, rng)
    for a, b in zip(reference.rotary(q, k, cos, sin), llama.apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(a, b, **FP32)
    cos, sin = _angles(1, 11, 6, rng)
    for module in (neox, phi3):
        for a, b in zip(reference.rotary(q, k, cos, sin), module.apply_rotary_pos_emb(q, k, cos, sin)):
            torch.testing.assert_close(a, b, **FP32)
    # the test can fail: other angles give other outputs
    assert not torch.allclose(reference.rotary(q, k, cos, sin)[0], reference.rotary(q, k, sin, cos)[0], **FP32)


def test_reference_interleaved_is_transformers(rng):
    """Cohere's apply_rotary_pos_emb (its cos and sin in pairs, computed in fp32) and GLM's, Helium's and Ernie
    4.5's (the first half of cos and sin repeated pairwise; GLM's partial), with ``interleaved=True``."""
    cohere = pytest.importorskip("transformers.models.cohere.modeling_cohere")
    q, k = (t.detach() for t in _qk(2, 4, 2, 11, 16, rng))
    a = torch.randn(2, 11, 8, generator=rng) * 3
    cos, sin = a.repeat_interleave(2, dim=-1).cos(), a.repeat_interleave(2, dim=-1).sin()  # CohereRotaryEmbedding
    for x, y in zip(reference.rotary(q, k, cos, sin, True), cohere.apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(x, y, **FP32)
    assert not torch.allclose(reference.rotary(q, k, cos, sin, True)[0], reference.rotary(q, k, cos, sin)[0])
    for name, r in (("glm", 8), ("glm4", 16), ("helium", 16), ("ernie4_5", 16)):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        cos, sin = _angles(1, 11, r, rng)  # transformers' layout: two equal halves
        pairs = [t[..., : r // 2].repeat_interleave(2, dim=-1) for t in (cos, sin)]
        for x, y in zip(reference.rotary(q, k, *pairs, True), module.apply_rotary_pos_emb(q, k, cos, sin)):
            torch.testing.assert_close(x, y, **FP32, msg=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@given(
    batch=st.integers(1, 2),
    heads=st.tuples(st.integers(1, 5), st.integers(1, 3)),
    tokens=st.integers(1, 40),
    half_width=st.integers(1, 20),
    rotated=st.floats(0.0, 1.0),
    cos_batch=st.booleans(),
    transposed=st.booleans(),
    interleaved=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(
    backend, device, batch, heads, tokens, half_width, rotated, cos_batch, transposed, interleaved, seed
):
    rng = torch.Generator().manual_seed(seed)
    width = 2 * half_width
    r = 2 * max(1, round(rotated * half_width))
    q, k = _qk(batch, *heads, tokens, width, rng, device, transposed)
    cos, sin = _angles(batch if cos_batch else 1, tokens, r, rng, device, halves=False)
    _check(q, k, cos, sin, backend, rng, interleaved=interleaved)


def test_kernel_tiles(device, rng):
    """Tiles of a few tokens and heads (the dispatcher's choice on the CPU is one program): each token and head
    rotated once."""
    kernels = pytest.importorskip("fastft.kernels.rotary")
    q, k = (t.detach() for t in _qk(2, 5, 3, 21, 20, rng, device))
    cos, sin = _angles(1, 21, 12, rng, device, halves=False)
    for block_t, heads, interleaved in ((4, 1, False), (8, 2, True), (32, 8, False), (32, 8, True)):
        for backward in (False, True):
            got = kernels.rotary(q, k, cos, sin, backward, interleaved, BLOCK_T=block_t, HEADS=heads, num_warps=1)
            expected = (reference.rotary_backward if backward else reference.rotary)(q, k, cos, sin, interleaved)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_one_rounding(device, rng, dtype):
    """Rounded once from fp32: within one ulp of the fp64 result; transformers' own bf16 chain is further."""
    q, k = _qk(1, 4, 2, 33, 32, rng, device, dtype=dtype)
    cos, sin = (t.to(dtype) for t in _angles(1, 33, 32, rng, device))
    out = fastft.rotary(q, k, cos, sin, backend="triton")
    exact = reference.rotary(q.detach().double(), k.detach().double(), cos.double(), sin.double())
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal
    for a, e in zip(out, exact):  # one ulp of e: eps |e|, and eps * tiny among the subnormals (fixed spacing)
        assert ((a.double() - e).abs() <= eps * e.abs().clamp_min(tiny)).all()
    _check(q, k, cos, sin, "triton", rng, tol=dict(atol=2e-2, rtol=1.6e-2))


def test_only_q_requires_grad(device, rng):
    """A frozen ``k`` (its output's gradient never asked): ``q``'s gradient alone, as the reference's."""
    q, _ = _qk(1, 2, 1, 7, 8, rng, device)
    k = torch.randn(1, 1, 7, 8, generator=rng).to(device)
    cos, sin = _angles(1, 7, 8, rng, device)
    out = fastft.rotary(q, k, cos, sin)
    torch.testing.assert_close(out[1], reference.rotary(q, k, cos, sin)[1], **FP32)
    dy = torch.randn(q.shape, generator=rng).to(device)
    (got,) = torch.autograd.grad(out[0], q, dy)
    torch.testing.assert_close(got, reference.rotary_backward(dy, k, cos, sin)[0], **FP32)


def test_the_graph_keeps_neither_input(device, rng):
    """The backward needs only cos and sin: q and k (here intermediates) are freed once their last user is gone."""
    import weakref

    leaf_q, leaf_k = _qk(1, 2, 1, 7, 8, rng, device)
    cos, sin = _angles(1, 7, 8, rng, device)
    q, k = leaf_q * 2, leaf_k * 2
    refs = [weakref.ref(q), weakref.ref(k)]
    out = fastft.rotary(q, k, cos, sin)
    del q, k
    assert all(r() is None for r in refs)
    sum(t.sum() for t in out).backward()
    assert leaf_q.grad is not None and leaf_k.grad is not None


def test_torch_compile_traces_the_op_and_its_backward(device, rng):
    q, k = _qk(1, 2, 1, 7, 8, rng, device)
    cos, sin = _angles(1, 7, 8, rng, device)
    compiled = torch.compile(lambda a, b: fastft.rotary(a, b, cos, sin), fullgraph=True, backend="aot_eager")
    out, want = compiled(q, k), fastft.rotary(q, k, cos, sin)
    dy = [torch.randn(t.shape, generator=rng).to(device) for t in out]
    for a, b in zip([*out, *torch.autograd.grad(out, (q, k), dy)], [*want, *torch.autograd.grad(want, (q, k), dy)]):
        torch.testing.assert_close(a, b, **FP32)


def test_checks_arguments(device, rng):
    q, k = (t.detach() for t in _qk(2, 4, 2, 5, 8, rng, device))
    cos, sin = _angles(2, 5, 8, rng, device)
    with pytest.raises(TypeError, match="k must be a tensor"):
        fastft.rotary(q, [1.0], cos, sin)
    with pytest.raises(TypeError, match="sin must be float32, bfloat16 or float16"):
        fastft.rotary(q, k, cos, sin.double())
    with pytest.raises(ValueError, match=r"q and k must be \[B, H, T, D\]"):
        fastft.rotary(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="k must be"):
        fastft.rotary(q, k[..., :6], cos, sin)
    with pytest.raises(ValueError, match="cos and sin must be"):
        fastft.rotary(q, k, cos, sin[..., :6])
    for bad in (cos[..., :7], cos[..., :0], cos[:, :4], torch.cat((cos, cos), -1), torch.cat((cos, cos), 0)[:3]):
        with pytest.raises(ValueError, match="cos and sin must be"):
            fastft.rotary(q, k, bad, bad)
    with pytest.raises(ValueError, match="cos and sin must not require grad"):
        fastft.rotary(q, k, cos.requires_grad_(), sin)
    with pytest.raises(ValueError, match="backend must be one of"):
        fastft.rotary(q, k, cos.detach(), sin, backend="cuda")
    with pytest.raises(TypeError, match="interleaved must be True or False"):
        fastft.rotary(q, k, cos.detach(), sin, interleaved=1)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty(backend, device, rng):
    q = torch.zeros(1, 2, 0, 8, device=device, requires_grad=True)
    k = torch.zeros(1, 1, 0, 8, device=device, requires_grad=True)
    cos = torch.zeros(1, 0, 8, device=device)
    out = fastft.rotary(q, k, cos, cos, backend=backend)
    assert [t.shape for t in out] == [q.shape, k.shape]
    sum(t.sum() for t in out).backward()
    assert q.grad.shape == q.shape


@pytest.mark.gpu
def test_gpu_bf16_at_qwen3_8b_widths_without_sync(rng):
    """32 query and 8 key heads of 128 over a 16k-token row, bf16, as transformers hands them (transposed views),
    against fp32."""
    q, k = _qk(1, 32, 8, 16384, 128, rng, "cuda", dtype=torch.bfloat16)
    cos, sin = (t.to(torch.bfloat16) for t in _angles(1, 16384, 128, rng, "cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fastft.rotary(q, k, cos, sin)
        grads = torch.autograd.grad(out, (q, k), [torch.ones_like(t) for t in out])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    leaves = [t.detach().float().requires_grad_() for t in (q, k)]
    want = reference.rotary(*leaves, cos.float(), sin.float())
    want_grads = torch.autograd.grad(want, leaves, [torch.ones_like(t) for t in want])
    for a, b in zip([*out, *grads], [*want, *want_grads]):
        torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=1.6e-2)


def test_the_check_command_case(device, rng):
    """``python -m fastft check``'s rotary case: the dispatched backend against the reference, and its gradient."""
    from fastft import selfcheck

    assert selfcheck.CHECKS["rotary"] is selfcheck.check_rotary
    for _ in range(8):
        selfcheck.check_rotary(rng, device, 24)
