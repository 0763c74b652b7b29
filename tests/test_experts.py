"""fastft.experts (routed_experts, grouped_linear, ExpertLoRA) against its reference (fastft.reference.experts):
forward and gradients in fp32 on random routings drawn fresh each run (``rng``)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fastft import experts
from fastft.reference import experts as reference

TOL = dict(atol=1e-5, rtol=1e-4)


def silu_gate(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def routing_ids(kind, tokens, top_k, num_experts, g):
    """``[T, K]`` int ids: ``random`` (with unrouted ids -1 and E), ``empty`` (experts 1 and 3 get no pair),
    ``one`` (expert 2 takes every routed pair; the other slots unrouted)."""
    if kind == "random":
        return torch.randint(-1, num_experts + 1, (tokens, top_k), generator=g)
    if kind == "empty":
        choices = torch.tensor([e for e in range(num_experts) if e not in (1, 3)])
        return choices[torch.randint(len(choices), (tokens, top_k), generator=g)]
    ids = torch.full((tokens, top_k), num_experts)
    ids[:, 0] = 2
    return ids


def case(g, tokens, transposed, gated, bias, kind, num_experts=5, top_k=3, hidden=8, inter=6, out=7):
    up_width = 2 * inter if gated else inter
    # each matrix scaled by its fan-in: activations of unit scale, so fp32 rounding stays within TOL
    up = torch.randn((num_experts, hidden, up_width) if transposed else (num_experts, up_width, hidden), generator=g)
    down = torch.randn((num_experts, inter, out) if transposed else (num_experts, out, inter), generator=g)
    up, down = up / hidden**0.5, down / inter**0.5
    tensors = dict(
        hidden_states=torch.randn(tokens, hidden, generator=g),
        top_k_weights=torch.rand(tokens, top_k, generator=g),
        up=up,
        down=down,
    )
    if bias:
        tensors["up_bias"] = torch.randn(num_experts, up_width, generator=g)
        tensors["down_bias"] = torch.randn(num_experts, out, generator=g)
    ids = routing_ids(kind, tokens, top_k, num_experts, g)
    return tensors, ids, dict(transposed=transposed, activation=silu_gate if gated else torch.tanh)


def add_lora(tensors, g, transposed, rank=3, scaling=0.75):
    """Per-expert adapters on both projections (``up_a`` ``[E, r, in]``, ``up_b`` ``[E, out, r]``, same for down)."""
    experts_, *dims = tensors["up"].shape
    up_in, up_out = dims if transposed else dims[::-1]
    experts_, *dims = tensors["down"].shape
    down_in, down_out = dims if transposed else dims[::-1]
    for name, width_in, width_out in (("up", up_in, up_out), ("down", down_in, down_out)):
        tensors[f"{name}_a"] = torch.randn(experts_, rank, width_in, generator=g) / width_in**0.5
        tensors[f"{name}_b"] = torch.randn(experts_, width_out, rank, generator=g) / rank**0.5
    return scaling


def run(fn, tensors, ids, options, grad, scaling=None, frozen=()):
    leaves = {n: t.clone().requires_grad_(n not in frozen) for n, t in tensors.items()}
    args = [leaves["hidden_states"], ids, leaves["top_k_weights"], leaves["up"], leaves["down"]]
    loras = {
        f"{name}_lora": experts.ExpertLoRA(leaves[f"{name}_a"], leaves[f"{name}_b"], scaling)
        for name in ("up", "down")
        if f"{name}_a" in leaves
    }
    y = fn(*args, **options, up_bias=leaves.get("up_bias"), down_bias=leaves.get("down_bias"), **loras)
    if y.requires_grad:  # the reference's output is a constant when no pair is routed
        (y * grad).sum().backward()
    return y.detach(), {n: t.grad for n, t in leaves.items()}


def assert_grads_close(grads, want_grads, tol):
    for name, g in want_grads.items():
        got = grads[name]
        if g is None:  # nothing reached it in the reference (frozen, or no pair routed): the op's is zero
            assert got is None or not got.any(), name
        else:
            torch.testing.assert_close(got, g, **tol, msg=name)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("kind, gated, bias", [("random", True, False), ("empty", False, True), ("one", True, True)])
def test_matches_reference(transposed, kind, gated, bias, rng):
    tokens = int(torch.randint(1, 24, (), generator=rng))  # any count: nothing needs a multiple
    tensors, ids, options = case(rng, tokens, transposed, gated, bias, kind)
    grad = torch.randn(tokens, 7, generator=rng)
    y, grads = run(experts.routed_experts, tensors, ids, options, grad)
    want, want_grads = run(reference.routed_experts, tensors, ids, options, grad)
    torch.testing.assert_close(y, want, **TOL)
    assert_grads_close(grads, want_grads, TOL)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("kind, gated, bias", [("random", True, True), ("empty", True, False), ("one", False, True)])
@pytest.mark.parametrize("train_weights", [False, True])
def test_lora_matches_reference(transposed, kind, gated, bias, train_weights, rng):
    """Adapters on both projections: the op's low-rank grouped products against ``W + scaling B A`` formed per
    pair; gradients of x, router weights, biases, every A and B, and the weights when they train."""
    tokens = int(torch.randint(1, 20, (), generator=rng))
    tensors, ids, options = case(rng, tokens, transposed, gated, bias, kind)
    scaling = add_lora(tensors, rng, transposed)
    frozen = () if train_weights else ("up", "down")
    grad = torch.randn(tokens, 7, generator=rng)
    y, grads = run(experts.routed_experts, tensors, ids, options, grad, scaling, frozen)
    want, want_grads = run(reference.routed_experts, tensors, ids, options, grad, scaling, frozen)
    torch.testing.assert_close(y, want, **TOL)
    assert_grads_close(grads, want_grads, TOL)
    assert (grads["up"] is None) == (not train_weights)


def test_lora_on_one_projection_and_zero_b_changes_nothing(rng):
    tensors, ids, options = case(rng, 10, False, True, False, "random")
    scaling = add_lora(tensors, rng, False)
    args = [tensors["hidden_states"], ids, tensors["top_k_weights"], tensors["up"], tensors["down"]]
    zero = experts.ExpertLoRA(tensors["up_a"], torch.zeros_like(tensors["up_b"]), scaling)
    torch.testing.assert_close(
        experts.routed_experts(*args, **options, up_lora=zero), experts.routed_experts(*args, **options), **TOL
    )
    down = experts.ExpertLoRA(tensors["down_a"], tensors["down_b"], scaling)
    torch.testing.assert_close(
        experts.routed_experts(*args, **options, down_lora=down),
        reference.routed_experts(*args, **options, down_lora=down),
        **TOL,
    )


def test_no_weights_means_all_ones_and_no_tokens(rng):
    tensors, ids, options = case(rng, 9, False, True, False, "random")
    tensors.pop("top_k_weights")
    args = [tensors["hidden_states"], ids, None, tensors["up"], tensors["down"]]
    torch.testing.assert_close(experts.routed_experts(*args, **options), reference.routed_experts(*args, **options))
    empty = experts.routed_experts(tensors["hidden_states"][:0], ids[:0], None, *args[3:], **options)
    assert empty.shape == (0, 7)


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_linear_matches_reference(transposed, rng):
    x = torch.randn(11, 6, generator=rng)
    weight = torch.randn((4, 6, 5) if transposed else (4, 5, 6), generator=rng)
    counts = torch.randint(0, 3, (4,), generator=rng)  # some experts empty; rows past the last end are padding
    ends = counts.cumsum(0).to(torch.int32)
    got = experts.grouped_linear(x, weight, ends, transposed)
    torch.testing.assert_close(got, reference.grouped_linear(x, weight, ends, transposed), **TOL)
    assert not got[int(ends[-1]) :].any()


def lowrank_case(g, rows, cols, rank, num_experts, dtype=torch.float32, device="cpu"):
    """``y``, ``u``, ``v`` (a transposed view, as the op gets ``B_e^T``) and ``ends`` with empty experts and
    rows past the last end."""
    y = torch.randn(rows, cols, generator=g).to(device, dtype)
    u = torch.randn(rows, rank, generator=g).to(device, dtype)
    v = torch.randn(num_experts, cols, rank, generator=g).to(device, dtype).transpose(1, 2)
    counts = torch.randint(0, 2 * rows // num_experts + 2, (num_experts,), generator=g)
    counts[torch.randint(num_experts, (1,), generator=g)] = 0
    ends = counts.cumsum(0).clamp_max(rows - int(torch.randint(0, 3, (), generator=g))).to(torch.int32)
    return y, u, v, ends.to(device)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("rows, cols, rank, num_experts", [(37, 24, 3, 5), (50, 40, 16, 9), (19, 17, 20, 1)])
def test_grouped_lowrank_add_matches_reference(backend, rows, cols, rank, num_experts, rng, device):
    y, u, v, ends = lowrank_case(rng, rows, cols, rank, num_experts, device=device)
    got = experts.grouped_lowrank_add(y, u, v, ends, 0.5, backend=backend)
    want = reference.grouped_lowrank_add(y, u, v, ends, 0.5)
    torch.testing.assert_close(got, want, **TOL)
    last = int(ends[-1])
    assert torch.equal(got[last:], y[last:])  # rows past the last end are y's
    for e, (a, b) in enumerate(zip([0] + ends.tolist(), ends.tolist())):  # against each expert's product
        torch.testing.assert_close(got[a:b], y[a:b] + 0.5 * u[a:b] @ v[e], **TOL)


@given(
    rows=st.integers(1, 70),
    cols=st.integers(1, 40),
    rank=st.integers(1, 33),
    num_experts=st.integers(1, 20),
    transposed_v=st.booleans(),
    scaling=st.sampled_from([1.0, 0.5, -2.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_grouped_lowrank_add_property(device, rows, cols, rank, num_experts, transposed_v, scaling, seed):
    """The Triton backend against the reference on random shapes and expert row ranges (empty experts, rows
    past the last end, ends past the rows), ``v`` contiguous or a transposed view."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, cols, generator=g).to(device)
    u = torch.randn(rows, rank, generator=g).to(device)
    v = torch.randn(num_experts, rank, cols, generator=g)
    v = (v.transpose(1, 2).contiguous().transpose(1, 2) if transposed_v else v).to(device)
    ends = torch.randint(0, rows + 3, (num_experts,), generator=g).sort().values.to(device, torch.int32)
    got = experts.grouped_lowrank_add(y, u, v, ends, scaling, backend="triton")
    torch.testing.assert_close(got, reference.grouped_lowrank_add(y, u, v, ends, scaling), **TOL)


def test_grouped_lowrank_add_errors():
    y, u, v, ends = torch.randn(6, 4), torch.randn(6, 2), torch.randn(3, 2, 4), torch.tensor([2, 4, 6]).int()
    with pytest.raises(TypeError, match="u must be a tensor, got list"):
        experts.grouped_lowrank_add(y, u.tolist(), v, ends)
    with pytest.raises(ValueError, match="v must have 3 dimensions"):
        experts.grouped_lowrank_add(y, u, v[0], ends)
    with pytest.raises(ValueError, match=r"u must be \[N=6, r\]"):
        experts.grouped_lowrank_add(y, u[:5], v, ends)
    with pytest.raises(ValueError, match=r"v must be \[E, r, out\]=\(E, 2, 4\), got \(3, 4, 2\)"):
        experts.grouped_lowrank_add(y, u, v.transpose(1, 2), ends)
    with pytest.raises(TypeError, match="v must have u's dtype"):
        experts.grouped_lowrank_add(y, u, v.double(), ends)
    with pytest.raises(ValueError, match=r"ends must be \[E=3\] int32"):
        experts.grouped_lowrank_add(y, u, v, ends.long())
    with pytest.raises(TypeError, match="y must be floating point"):
        experts.grouped_lowrank_add(y.int(), u, v, ends)
    with pytest.raises(TypeError, match="scaling must be a number"):
        experts.grouped_lowrank_add(y, u, v, ends, "2")
    with pytest.raises(ValueError, match="ends is on meta"):
        experts.grouped_lowrank_add(y, u, v, ends.to("meta"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_grouped_lowrank_add_is_not_differentiable(backend, device):
    y, u, v = (
        torch.randn(6, 4, device=device, requires_grad=True),
        torch.randn(6, 2, device=device),
        torch.randn(3, 2, 4, device=device),
    )
    assert not experts.grouped_lowrank_add(
        y, u, v, torch.tensor([2, 4, 6], device=device).int(), backend=backend
    ).requires_grad


def test_errors():
    x, ids, w = torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2)
    up, down = torch.randn(3, 6, 8), torch.randn(3, 8, 6)
    ok = dict(transposed=False, activation=torch.tanh)
    with pytest.raises(TypeError, match="hidden_states must be a tensor, got list"):
        experts.routed_experts(x.tolist(), ids, w, up, down, **ok)
    with pytest.raises(TypeError, match="top_k_index must be a tensor, got list"):
        experts.routed_experts(x, ids.tolist(), w, up, down, **ok)
    with pytest.raises(ValueError, match=r"top_k_index must be \[T=4, K\]"):
        experts.routed_experts(x, ids[:3], w, up, down, **ok)
    with pytest.raises(ValueError, match="top_k_weights must be"):
        experts.routed_experts(x, ids, w[:, :1], up, down, **ok)
    with pytest.raises(ValueError, match="up's in features"):
        experts.routed_experts(x[:, :7], ids, w, up, down, **ok)
    with pytest.raises(ValueError, match="same number of experts"):
        experts.routed_experts(x, ids, w, up, down[:2], **ok)
    with pytest.raises(ValueError, match="down_bias must be"):
        experts.routed_experts(x, ids, w, up, down, **ok, down_bias=torch.zeros(3, 7))
    with pytest.raises(TypeError, match="transposed must be True or False"):
        experts.routed_experts(x, ids, w, up, down, transposed="no", activation=torch.tanh)
    with pytest.raises(TypeError, match="activation must be callable"):
        experts.routed_experts(x, ids, w, up, down, transposed=False, activation="silu")
    with pytest.raises(ValueError, match="activation must return"):
        experts.routed_experts(x, ids, w, up, down, transposed=False, activation=silu_gate)
    with pytest.raises(ValueError, match="ends must be"):
        experts.grouped_linear(x, up, torch.tensor([1, 2, 4]), False)
    with pytest.raises(ValueError, match=r"ends must be ascending row ends in \[0, 4\]"):
        experts.grouped_linear(x, up, torch.tensor([1, 5, 5]).int(), False)
    with pytest.raises(ValueError, match=r"ends must be ascending row ends in \[0, 4\]"):
        experts.grouped_linear(x, up, torch.tensor([3, 2, 4]).int(), False)
    ends = torch.tensor([1, 2, 4]).int()
    for bad in (x.double(), x.long()):
        with pytest.raises(TypeError, match="x must have weight's dtype torch.float32"):
            experts.grouped_linear(bad, up, ends, False)
    # dtypes and empty expert sets, named as routed_experts' own arguments
    with pytest.raises(TypeError, match="top_k_index must be int32 or int64, got torch.float32"):
        experts.routed_experts(x, ids.float(), w, up, down, **ok)
    with pytest.raises(TypeError, match="top_k_weights must be floating point"):
        experts.routed_experts(x, ids, w.long(), up, down, **ok)
    with pytest.raises(ValueError, match="at least one expert"):
        experts.routed_experts(x, ids, w, up[:0], down[:0], **ok)
    with pytest.raises(TypeError, match="up must have hidden_states' dtype torch.bfloat16"):
        experts.routed_experts(x.bfloat16(), ids, w, up, down, **ok)
    with pytest.raises(TypeError, match="down must have hidden_states' dtype torch.float32, got torch.float64"):
        experts.routed_experts(x, ids, w, up, down.double(), **ok)
    with pytest.raises(TypeError, match="up_bias must have hidden_states' dtype"):
        experts.routed_experts(x, ids, w, up, down, **ok, up_bias=torch.zeros(3, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match="activation must return down's dtype torch.float32, got torch.float64"):
        experts.routed_experts(x, ids, w, up, down, transposed=False, activation=lambda h: h.double())


def test_lora_errors():
    x, ids, w = torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2)
    up, down = torch.randn(3, 6, 8), torch.randn(3, 8, 6)  # up [E, I_up=6, H=8], down [E, H_out=8, I=6]
    ok = dict(transposed=False, activation=torch.tanh)
    good = experts.ExpertLoRA(torch.randn(3, 2, 8), torch.randn(3, 6, 2), 2.0)
    experts.routed_experts(x, ids, w, up, down, **ok, up_lora=good)
    with pytest.raises(TypeError, match="up_lora must be a fastft.experts.ExpertLoRA or None, got tuple"):
        experts.routed_experts(x, ids, w, up, down, **ok, up_lora=(good.a, good.b, 2.0))
    with pytest.raises(ValueError, match=r"up_lora.a must be \[E, r, in\]=\(3, r >= 1, 8\), got \(3, 2, 6\)"):
        experts.routed_experts(x, ids, w, up, down, **ok, up_lora=experts.ExpertLoRA(good.a[..., :6], good.b, 2.0))
    with pytest.raises(ValueError, match=r"down_lora.b must be \[E, out, r\]=\(3, 8, 2\), got \(3, 6, 2\)"):
        lora = experts.ExpertLoRA(torch.randn(3, 2, 6), good.b, 2.0)
        experts.routed_experts(x, ids, w, up, down, **ok, down_lora=lora)
    with pytest.raises(ValueError, match=r"up_lora.a must be \[E, r, in\]"):
        experts.routed_experts(x, ids, w, up, down, **ok, up_lora=experts.ExpertLoRA(good.a[:2], good.b, 2.0))
    with pytest.raises(ValueError, match="up_lora.b must have 3 dimensions"):
        experts.routed_experts(x, ids, w, up, down, **ok, up_lora=experts.ExpertLoRA(good.a, good.b[0], 2.0))
    with pytest.raises(TypeError, match="up_lora.a must be floating point"):
        experts.routed_experts(x, ids, w, up, down, **ok, up_lora=experts.ExpertLoRA(good.a.int(), good.b, 2.0))
    with pytest.raises(TypeError, match="up_lora.scaling must be a number, got str"):
        experts.routed_experts(x, ids, w, up, down, **ok, up_lora=experts.ExpertLoRA(good.a, good.b, "2"))
    with pytest.raises(ValueError, match="up_lora.b is on meta"):
        lora = experts.ExpertLoRA(good.a, good.b.to("meta"), 2.0)
        experts.routed_experts(x, ids, w, up, down, **ok, up_lora=lora)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_path_matches_reference_in_bf16(transposed, rng):
    """CUDA bf16 with aligned sizes: ``torch._grouped_mm`` (no per-expert loop), against the reference in fp32
    on the same bf16 inputs."""
    tensors, ids, options = case(rng, 256, transposed, True, True, "random", 8, 2, hidden=64, inter=32, out=64)
    grad = torch.randn(256, 64, generator=rng)
    bf16 = {n: t.cuda().bfloat16() for n, t in tensors.items()}
    y, grads = run(experts.routed_experts, bf16, ids.cuda(), options, grad.cuda().bfloat16())
    fp32 = {n: t.float() for n, t in bf16.items()}
    want, want_grads = run(reference.routed_experts, fp32, ids.cuda(), options, grad.cuda().bfloat16().float())
    assert y.dtype == torch.bfloat16
    for name, got, ref in [("y", y, want)] + [(n, grads[n], want_grads[n]) for n in want_grads]:
        err = float((got.float() - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 2e-2, (name, err)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows, cols, rank, num_experts", [(131072, 1536, 16, 128), (65536, 5760, 16, 32), (4099, 2048, 8, 256)]
)
def test_grouped_lowrank_add_in_bf16_at_real_sizes(rows, cols, rank, num_experts, rng):
    """The Triton kernel on the e2e experts' widths (Qwen3-30B-A3B's and gpt-oss's gate-up rows; Qwen3.5-MoE's
    256 experts, most holding a few rows), against the fp32 reference on the same bf16 inputs."""
    y, u, v, ends = lowrank_case(rng, rows, cols, rank, num_experts, torch.bfloat16, "cuda")
    got = experts.grouped_lowrank_add(y, u, v, ends, 2.0, backend="triton")
    want = reference.grouped_lowrank_add(y.float(), u.float(), v.float(), ends, 2.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=1e-2)  # bf16 rounding of values up to ~50


def materialised(hidden_states, top_k_index, top_k_weights, up, down, *, up_lora, down_lora, transposed, **kw):
    """PEFT's way: ``W + scaling B A`` formed for every expert, then the op without adapters (the op alone is
    tested against the reference above; the reference's per-pair loop is too slow at these sizes)."""

    def fold(weight, lora):
        delta = lora.scaling * (lora.b.to(weight.dtype) @ lora.a.to(weight.dtype))  # [E, out, in]
        return weight + (delta.transpose(-2, -1) if transposed else delta)

    return experts.routed_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        fold(up, up_lora),
        fold(down, down_lora),
        transposed=transposed,
        **kw,
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [  # (tokens, E, K, H, I, transposed, biases), at the models' widths
        (4096, 128, 8, 2048, 768, False, False),  # Qwen3-30B-A3B
        (2048, 32, 4, 2880, 2880, True, True),  # gpt-oss-20b
    ],
)
@pytest.mark.parametrize("rank", [16, 4])  # 4: padded to 8 for torch._grouped_mm
def test_lora_grouped_mm_path_at_real_sizes_in_bf16(shape, rank, rng):
    """CUDA bf16 with LoRA r on both projections, weights frozen: the grouped low-rank path against the
    materialised ``W + scaling B A`` in fp32 on the same bf16 inputs (forward, x, router weights, A, B)."""
    tokens, num_experts, top_k, hidden, inter, transposed, bias = shape
    tensors, ids, options = case(
        rng, tokens, transposed, True, bias, "random", num_experts, top_k, hidden, inter, hidden
    )
    scaling = add_lora(tensors, rng, transposed, rank=rank, scaling=2.0)
    grad = torch.randn(tokens, hidden, generator=rng)
    frozen = ("up", "down")
    bf16 = {n: t.cuda().bfloat16() for n, t in tensors.items()}
    y, grads = run(experts.routed_experts, bf16, ids.cuda(), options, grad.cuda().bfloat16(), scaling, frozen)
    fp32 = {n: t.float() for n, t in bf16.items()}
    want, want_grads = run(materialised, fp32, ids.cuda(), options, grad.cuda().float(), scaling, frozen)
    assert y.dtype == torch.bfloat16 and grads["up"] is None
    for name, got, ref in [("y", y, want)] + [(n, grads[n], want_grads[n]) for n in want_grads if n not in frozen]:
        err = float((got.float() - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 2e-2, (name, err)


def test_the_check_command_case(device, rng):
    """``python -m fastft check``'s experts case: the low-rank add and routed_experts with LoRA, every gradient."""
    from fastft import selfcheck

    assert selfcheck.CHECKS["experts"] is selfcheck.check_experts
    for _ in range(5):
        selfcheck.check_experts(rng, device, 48)
