"""fastft.routing: the reference against a brute-force reading of the rules, the Triton backend against the
reference (hypothesis), gradients against autograd through the reference, validation, torch.compile."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fastft
from fastft import selfcheck, testing
from fastft.reference import routing as reference

# ---- the specification, spelled out in Python loops ----------------------------------------------------


def brute_force(ids: list[list[int]], num_experts: int, block_size: int, expert_map, num_local: int):
    k = len(ids[0]) if ids else 0
    local = {}
    for t, row in enumerate(ids):
        for j, e in enumerate(row):
            if 0 <= e < num_experts:
                e = e if expert_map is None else expert_map[e]
                if 0 <= e < num_local:
                    local[t * k + j] = e
    counts = [sum(1 for e in local.values() if e == x) for x in range(num_local)]
    padded = [0]
    for c in counts:
        padded.append(padded[-1] + -(-c // block_size) * block_size)
    slots, inverse, expert_of_slot = {}, [[-1] * k for _ in ids], {}
    for x in range(num_local):
        for rank, p in enumerate(sorted(p for p, e in local.items() if e == x)):
            slots[padded[x] + rank] = p
            inverse[p // k][p % k] = padded[x] + rank
        for s in range(padded[x], padded[x + 1]):
            expert_of_slot[s] = x
    return counts, padded, slots, inverse, expert_of_slot


@given(
    testing.seeds_strategy(),
    st.integers(0, 40),
    st.integers(1, 5),
    st.integers(1, 12),
    st.integers(1, 9),
    st.booleans(),
)
def test_reference_matches_the_rules(seed, tokens, top_k, num_experts, block_size, use_map):
    g = torch.Generator().manual_seed(seed)
    ids = testing.random_topk_ids(g, tokens, top_k, num_experts, unrouted=0.2)
    expert_map, num_local = None, num_experts
    if use_map:
        num_local = testing.randint(g, 1, num_experts + 1)  # ids >= num_local are not routed either
        expert_map = torch.randint(-1, num_local + 1, (num_experts,), generator=g, dtype=torch.int32)
    counts, padded, slots, inverse, expert_of_slot = brute_force(
        ids.tolist(), num_experts, block_size, None if expert_map is None else expert_map.tolist(), num_local
    )
    r = reference.route(ids, num_experts, block_size, expert_map, num_local)
    cap = reference.capacity(tokens * top_k, num_local, block_size)
    assert r[0].tolist() == counts
    assert r[1].tolist() == [sum(counts[:i]) for i in range(num_local + 1)]
    assert r[2].tolist() == padded and padded[-1] <= cap
    assert r[3].tolist() == [slots.get(s, -1) for s in range(cap)]
    assert r[4].tolist() == (inverse if tokens else torch.empty(0, top_k).tolist())
    assert r[5].tolist() == [expert_of_slot.get(b * block_size, -1) for b in range(cap // block_size)]
    assert all(t.dtype == torch.int32 for t in r)


@given(st.integers(1, 300), st.integers(1, 40), st.integers(1, 64))
def test_capacity_is_the_tight_bound(num_pairs, num_local, block_size):
    cap = reference.capacity(num_pairs, num_local, block_size)
    assert cap % block_size == 0
    # The worst case: one pair in each of E - 1 experts and the rest in the last one.
    worst = [1] * (num_local - 1) + [num_pairs - num_local + 1] if num_pairs > num_local else [1] * num_pairs
    assert sum(-(-c // block_size) * block_size for c in worst) == cap
    # Any other split of the pairs needs no more.
    g = torch.Generator().manual_seed(num_pairs * 1000 + num_local)
    split = torch.bincount(torch.randint(0, num_local, (num_pairs,), generator=g), minlength=num_local)
    assert int(((split + block_size - 1) // block_size * block_size).sum()) <= cap


def test_worked_example():
    ids = torch.tensor([[2, 0], [2, 2], [5, 1]])  # expert 5 does not exist: pair 4 is not routed
    r = fastft.moe_route(ids, 3, block_size=2, backend="torch")
    assert r.counts.tolist() == [1, 1, 3] and r.offsets.tolist() == [0, 1, 2, 5]
    assert r.padded_offsets.tolist() == [0, 2, 4, 8] and r.capacity == 8
    assert r.sorted_pair.tolist() == [1, -1, 5, -1, 0, 2, 3, -1]
    assert r.inverse.tolist() == [[4, 0], [5, 6], [-1, 2]]
    assert r.expert_of_block.tolist() == [0, 1, 2, 2]
    x = torch.arange(3.0)[:, None]
    assert fastft.moe_permute(x, r).flatten().tolist() == [0, 0, 2, 0, 0, 1, 1, 0]
    assert fastft.moe_unpermute(fastft.moe_permute(x, r), r).flatten().tolist() == [0, 2, 2]


# ---- triton vs torch --------------------------------------------------------------------------------------


@given(testing.seeds_strategy())
def test_triton_matches_reference(device, seed):
    selfcheck.check_routing(torch.Generator().manual_seed(seed), device, 80)


@pytest.mark.parametrize(
    "tokens,top_k,num_experts,block_size",
    [(0, 4, 8, 16), (1, 1, 1, 1), (37, 3, 1500, 8), (130, 2, 5, 128), (64, 8, 3, 1)],
)
def test_edge_shapes(device, tokens, top_k, num_experts, block_size, rng):
    g = rng
    case = selfcheck.random_routing_case(g, device, 8)
    ids = testing.random_topk_ids(g, tokens, top_k, num_experts).to(device)
    x = torch.randn(tokens, 24, generator=g).to(device)
    case.update(
        topk_ids=ids,
        options={"num_experts": num_experts, "block_size": block_size},
        x=x,
        weights=torch.rand(tokens, top_k, generator=g).to(device),
        table=torch.randn(num_experts, 3, generator=g).to(device),
    )
    selfcheck.check_routing_case(case)


def test_all_pairs_unrouted(device):
    ids = torch.full((9, 2), -1, device=device)
    r = fastft.moe_route(ids, 4, block_size=4)
    assert r.counts.tolist() == [0] * 4 and r.padded_offsets.tolist() == [0] * 5
    assert (r.sorted_pair == -1).all() and (r.inverse == -1).all() and (r.expert_of_block == -1).all()
    assert (fastft.moe_unpermute(torch.ones(r.capacity, 3, device=device), r) == 0).all()


# ---- gradients: the ops' backward against autograd through plain torch indexing ------------------------


def test_gradients_match_autograd_of_plain_torch(device, rng):
    g = rng
    ids = testing.random_topk_ids(g, 23, 3, 6).to(device)
    r = fastft.moe_route(ids, 6, block_size=4)
    x = torch.randn(23, 7, generator=g).to(device).requires_grad_()
    w = torch.rand(23, 3, generator=g).to(device).requires_grad_()
    bias = torch.randn(6, 7, generator=g).to(device).requires_grad_()

    def plain(x, w, bias):
        used = (r.sorted_pair >= 0)[:, None]
        pair = r.sorted_pair.clamp(min=0).long()
        expert = r.expert_of_block.repeat_interleave(4).clamp(min=0).long()
        ys = torch.where(used, x[pair // 3] * 2 + bias[expert], 0)
        picked = ys[r.inverse.clamp(min=0).long()] * (r.inverse >= 0)[..., None]
        return (picked * w[..., None]).sum(1)

    def ours(x, w, bias, backend):
        ys = fastft.moe_permute(x, r, backend=backend) * 2 + fastft.moe_expert_rows(bias, r, backend=backend)
        return fastft.moe_unpermute(ys, r, w, backend=backend)

    dy = torch.randn(23, 7, generator=g).to(device)
    expected = torch.autograd.grad(plain(x, w, bias), (x, w, bias), dy)
    for backend in ("torch", "triton"):
        got = torch.autograd.grad(ours(x, w, bias, backend), (x, w, bias), dy)
        testing.assert_same(list(got), list(expected), atol=1e-5, rtol=1e-5, path=backend)


# ---- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        (([[0, 1]], 4), {}, TypeError, "topk_ids must be a tensor"),
        ((torch.zeros(2, 2), 4), {}, TypeError, "topk_ids must be int32 or int64"),
        ((torch.zeros(4, dtype=torch.long), 4), {}, ValueError, r"topk_ids must be \[T, K\]"),
        ((torch.zeros(2, 2, dtype=torch.long), 0), {}, ValueError, "num_experts must be an int >= 1"),
        ((torch.zeros(2, 2, dtype=torch.long), 4.0), {}, TypeError, "num_experts must be an int"),
        ((torch.zeros(2, 2, dtype=torch.long), 4), {"block_size": 0}, ValueError, "block_size must be an int >= 1"),
        ((torch.zeros(2, 2, dtype=torch.long), 4), {"num_local_experts": 2}, ValueError, "only taken with expert_map"),
        (
            (torch.zeros(2, 2, dtype=torch.long), 4),
            {"expert_map": torch.zeros(4, dtype=torch.int32)},
            ValueError,
            "num_local_experts is required",
        ),
        (
            (torch.zeros(2, 2, dtype=torch.long), 4),
            {"expert_map": torch.zeros(3, dtype=torch.int32), "num_local_experts": 1},
            ValueError,
            r"expert_map must have shape \(4,\)",
        ),
        (
            (torch.zeros(2, 2, dtype=torch.long), 4),
            {"expert_map": torch.zeros(4), "num_local_experts": 1},
            TypeError,
            "expert_map must be int32 or int64",
        ),
        ((torch.zeros(2, 2, dtype=torch.long), 4), {"backend": "cuda"}, ValueError, "backend must be one of"),
        ((torch.zeros(1, 1, dtype=torch.int32).expand(2**16, 2**15 + 1), 4), {}, ValueError, "int32 slot indices"),
        ((torch.zeros(2, 2, dtype=torch.long), 10**9), {}, ValueError, "num_experts=1000000000 .* implies"),
        ((torch.zeros(2, 2, dtype=torch.long), 2**31), {}, ValueError, "num_experts=2147483648 .* implies"),
        (
            (torch.zeros(2, 2, dtype=torch.long), 4),
            {"expert_map": torch.zeros(4, dtype=torch.int32), "num_local_experts": 2**30},
            ValueError,
            "num_local_experts=1073741824",
        ),
    ],
)
def test_route_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fastft.moe_route(*args, **kwargs)


def test_row_ops_bad_input():
    r = fastft.moe_route(torch.tensor([[0, 1], [1, 1]]), 2, block_size=2)
    with pytest.raises(TypeError, match="routing must be a MoERouting"):
        fastft.moe_permute(torch.zeros(2, 3), {"inverse": r.inverse})
    with pytest.raises(ValueError, match=r"x must be \[T=2, H\]"):
        fastft.moe_permute(torch.zeros(3, 3), r)
    with pytest.raises(ValueError, match=r"ys must be \[capacity=6, H\]"):
        fastft.moe_unpermute(torch.zeros(2, 3), r)
    with pytest.raises(ValueError, match=r"weights must be \[T, K\]"):
        fastft.moe_unpermute(torch.zeros(6, 3), r, torch.ones(2, 3))
    with pytest.raises(TypeError, match="weights must be floating point"):
        fastft.moe_unpermute(torch.zeros(6, 3), r, torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"table must be \[num_local_experts=2, H\]"):
        fastft.moe_expert_rows(torch.zeros(3, 5), r)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.capacity = 3
    with pytest.raises(TypeError, match="ys must have a real floating dtype"):
        fastft.moe_unpermute(torch.zeros(6, 3, dtype=torch.complex64), r)
    with pytest.raises(TypeError, match="ys must have a real floating dtype"):
        fastft.moe_unpermute(torch.zeros(6, 3, dtype=torch.int32), r)
    with pytest.raises(TypeError, match="x requires grad but is torch.complex64"):
        fastft.moe_permute(torch.zeros(2, 3, dtype=torch.complex64, requires_grad=True), r)


def test_routing_is_made_by_moe_route_only():
    r = fastft.moe_route(torch.tensor([[0, 1], [1, 1]]), 2, block_size=2)
    bad = r.inverse + 10**6  # slots far out of range
    with pytest.raises(TypeError, match="MoERouting is made by fastft.moe_route only"):
        fastft.MoERouting(
            r.counts, r.offsets, r.padded_offsets, r.sorted_pair, bad, r.expert_of_block, 2, 2, 2, 2, 2, 6
        )
    with pytest.raises(TypeError, match="made by fastft.moe_route only"):
        dataclasses.replace(r, inverse=bad)
    r.inverse[0, 0] = 10**6  # in place, after routing
    for op in (
        lambda: fastft.moe_permute(torch.ones(2, 3), r),
        lambda: fastft.moe_unpermute(torch.ones(6, 3), r),
        lambda: fastft.moe_expert_rows(torch.ones(2, 3), r),
    ):
        with pytest.raises(ValueError, match="changed in place after moe_route"):
            op()
    with torch.inference_mode():  # inference tensors have no version counter: routing still works
        r = fastft.moe_route(torch.tensor([[0, 1]]), 2)
        assert fastft.moe_permute(torch.ones(1, 3), r).shape == (2, 3)


ROW_DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bfloat16,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int64,
    torch.bool,
]


@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_row_moves_take_every_dtype_bit_exactly(device, dtype, rng):
    """Permute and expert rows are bit copies on both backends; the combine widens fp8 to fp32 exactly."""
    ids = testing.random_topk_ids(rng, 37, 3, 6).to(device)
    r = fastft.moe_route(ids, 6, block_size=4)
    raw = torch.randint(-(2**62), 2**62, (37, 24), generator=rng, dtype=torch.int64)
    x = raw.view(torch.uint8)[:, : 24 * dtype.itemsize].contiguous().view(dtype) if dtype != torch.bool else raw > 0
    x = x[:, :5].to(device)
    table = x[:6]
    for backend in ("triton", "torch"):
        got = fastft.moe_permute(x, r, backend=backend)
        want = reference.permute(x, r.sorted_pair, r.top_k)
        assert got.dtype == dtype and testing.bits(got).equal(testing.bits(want)), backend
        got = fastft.moe_expert_rows(table, r, backend=backend)
        want = reference.expert_rows(table, r.sorted_pair, r.expert_of_block, r.block_size)
        assert testing.bits(got).equal(testing.bits(want)), backend
    if dtype.is_floating_point:
        ys = (torch.randn(r.capacity, 5, generator=rng) * 4).to(device, dtype)
        w = torch.rand(37, 3, generator=rng).to(device)
        got = fastft.moe_unpermute(ys, r, w, backend="triton")
        want = reference.gather_sum(ys, r.inverse, w)
        assert got.dtype == dtype
        if dtype.itemsize == 1 or dtype == torch.float64:  # fp8: fp32 sums rounded by torch, as the reference
            assert testing.bits(got).equal(testing.bits(want))
        else:  # the kernel's own bf16 rounding: one unit in the last place of the reference's
            torch.testing.assert_close(got, want, atol=0, rtol=2**-7)


def test_expert_map_routes_only_local_experts(device):
    ids = torch.tensor([[0, 3], [2, 1], [3, 3]], device=device)
    emap = torch.tensor([-1, 0, -1, 1], dtype=torch.int32, device=device)  # this rank owns experts 1 and 3
    r = fastft.moe_route(ids, 4, expert_map=emap, num_local_experts=2)
    assert r.counts.tolist() == [1, 3] and r.sorted_pair.tolist() == [3, 1, 4, 5, -1, -1]
    assert r.inverse.tolist() == [[-1, 1], [-1, 0], [2, 3]]


# ---- torch.compile and the op registrations -------------------------------------------------------------


def test_torch_compile_traces_without_graph_breaks(device):
    def moe(ids, x, w):
        r = fastft.moe_route(ids, 5, block_size=4)
        return fastft.moe_unpermute(fastft.moe_permute(x, r) * 3, r, w)

    g = torch.Generator().manual_seed(3)
    ids = testing.random_topk_ids(g, 20, 2, 5).to(device)
    x = torch.randn(20, 8, device=device, requires_grad=True)
    w = torch.rand(20, 2, device=device)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    out = compiled(ids, x, w)
    testing.assert_same(out, moe(ids, x, w), atol=1e-6, rtol=1e-6)
    (dx,) = torch.autograd.grad(out.sum(), x)
    testing.assert_same(dx, torch.autograd.grad(moe(ids, x, w).sum(), x)[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_custom_ops_pass_opcheck(device, backend, rng):
    from fastft import routing

    g = rng
    ids = testing.random_topk_ids(g, 12, 2, 5).to(device)
    r = fastft.moe_route(ids, 5, block_size=2, backend=backend)
    x = torch.randn(12, 6, generator=g).to(device).requires_grad_()
    ys = torch.randn(r.capacity, 6, generator=g).to(device).requires_grad_()
    w = torch.rand(12, 2, generator=g).to(device).requires_grad_()
    table = torch.randn(5, 3, generator=g).to(device).requires_grad_()
    cases = [
        (routing.route_op, (ids, 5, 2, None, 5, backend)),
        (routing.permute_op, (x, r.sorted_pair, r.inverse, backend)),
        (routing.unpermute_op, (ys, r.sorted_pair, r.inverse, w, backend)),
        (routing.unpermute_op, (ys, r.sorted_pair, r.inverse, None, backend)),
        (routing.unpermute_backward_op, (x.detach(), ys.detach(), r.sorted_pair, r.inverse, w.detach(), backend)),
        (routing.expert_rows_op, (table, r.sorted_pair, r.expert_of_block, r.counts, r.padded_offsets, 2, backend)),
        (routing.expert_rows_backward_op, (ys.detach()[:, :3], r.counts, r.padded_offsets, backend)),
    ]
    for fn, args in cases:
        torch.library.opcheck(fn.op, args)
