"""fastft.routing on a CUDA GPU: real model shapes, no host sync, CUDA graphs, launches, inductor, 2**31."""

import pytest
import torch

import fastft
from fastft import selfcheck, testing
from fastft.e2e.models import MOE_SHAPES as SHAPES
from fastft.reference import routing as reference
from fastft.testing import no_host_sync, router_ids

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("block_size", [1, 128])
def test_model_shapes_match_reference(name, block_size, rng):
    experts, top_k, hidden = SHAPES[name]
    g = rng
    case = selfcheck.random_routing_case(g, "cuda", 8)
    ids = router_ids(16384, experts, top_k, "cuda", seed=int(torch.randint(0, 2**31, (1,), generator=g)))
    ids[(torch.rand(ids.shape, generator=g) < 0.01).cuda()] = -1  # a few dropped pairs
    case.update(
        topk_ids=ids,
        options={"num_experts": experts, "block_size": block_size},
        x=torch.randn(16384, hidden // 8, generator=g).to("cuda", torch.bfloat16),
        weights=torch.rand(16384, top_k, generator=g).cuda(),
        table=torch.randn(experts, 64, generator=g).to("cuda", torch.bfloat16),
    )
    selfcheck.check_routing_case(case)


def test_random_cases_at_gpu_sizes(rng):
    g = rng
    for _ in range(30):
        selfcheck.check_routing(g, "cuda", 20000)


def test_expert_parallel_map(rng):
    g = rng
    ids = router_ids(8192, 256, 8, "cuda", seed=3)
    emap = torch.full((256,), -1, dtype=torch.int32)
    emap[64:96] = torch.arange(32, dtype=torch.int32)  # this rank owns global experts 64..95
    case = selfcheck.random_routing_case(g, "cuda", 8)
    case.update(
        topk_ids=ids,
        options={"num_experts": 256, "block_size": 64, "expert_map": emap.cuda(), "num_local_experts": 32},
        x=torch.randn(8192, 96, generator=g).cuda(),
        weights=torch.rand(8192, 8, generator=g).cuda(),
        table=torch.randn(32, 16, generator=g).cuda(),
    )
    selfcheck.check_routing_case(case)


def _moe_step(ids, x, w, experts, block_size):
    r = fastft.moe_route(ids, experts, block_size=block_size)
    ys = fastft.moe_permute(x, r) * 2
    y = fastft.moe_unpermute(ys, r, w)
    y.sum().backward()
    return r, y


def test_no_host_sync_forward_and_backward():
    ids = router_ids(4096, 128, 8, "cuda")
    x = torch.randn(4096, 256, device="cuda", requires_grad=True)
    w = torch.rand(4096, 8, device="cuda", requires_grad=True)
    _moe_step(ids, x, w, 128, 128)  # compiles the kernels
    with no_host_sync():
        for backend in ("triton", "torch"):
            r = fastft.moe_route(ids, 128, block_size=128, backend=backend)
            y = fastft.moe_unpermute(fastft.moe_permute(x, r) * 2, r, w)
            y.sum().backward()


def test_route_is_two_launches():
    ids = router_ids(16384, 128, 8, "cuda")
    fastft.moe_route(ids, 128, block_size=128)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fastft.moe_route(ids, 128, block_size=128)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2, [e.name for e in kernels]


@pytest.mark.parametrize("experts", [512, 1024])
def test_large_histogram_takes_larger_blocks_and_matches(experts):
    # 65536 tokens x top-8 over 512/1024 experts: more than 2**17 (block, expert) histogram entries at
    # the tuned block size, so moe_route switches to 2048-pair blocks.
    ids = router_ids(65536, experts, 8, "cuda", seed=5)
    got = fastft.moe_route(ids, experts, block_size=128)
    expected = fastft.moe_route(ids, experts, block_size=128, backend="torch")
    testing.assert_same(selfcheck.routing_fields(got), selfcheck.routing_fields(expected))


def test_cuda_graph_capture_and_replay():
    ids = router_ids(4096, 32, 4, "cuda", seed=1)
    x = torch.randn(4096, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, 4, device="cuda")
    fastft.moe_unpermute(
        fastft.moe_permute(x, fastft.moe_route(ids, 32, block_size=16)), fastft.moe_route(ids, 32, block_size=16), w
    )
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = fastft.moe_route(ids, 32, block_size=16)
        y = fastft.moe_unpermute(fastft.moe_permute(x, r), r, w)
    for seed in (2, 3):
        ids.copy_(router_ids(4096, 32, 4, "cuda", seed=seed))
        graph.replay()
        expected = fastft.moe_route(ids, 32, block_size=16, backend="torch")
        testing.assert_same(selfcheck.routing_fields(r), selfcheck.routing_fields(expected))
        testing.assert_same(y, reference.gather_sum(reference.permute(x, expected.sorted_pair, 4), expected.inverse, w))


def test_inductor_fullgraph():
    def moe(ids, x, w):
        r = fastft.moe_route(ids, 64, block_size=32)
        return fastft.moe_unpermute(torch.relu(fastft.moe_permute(x, r)), r, w)

    ids = router_ids(2048, 64, 4, "cuda")
    x = torch.randn(2048, 128, device="cuda", requires_grad=True)
    w = torch.rand(2048, 4, device="cuda", requires_grad=True)
    compiled = torch.compile(moe, fullgraph=True)
    out = compiled(ids, x, w)
    testing.assert_same(out, moe(ids, x, w), atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(out.sum(), (x, w))
    expected = torch.autograd.grad(moe(ids, x, w).sum(), (x, w))
    testing.assert_same(list(got), list(expected), atol=1e-4, rtol=1e-4)


def test_addresses_past_2_31_elements():
    t, k, hidden = 32768, 8, 8448  # T*K*H = 2.2e9 elements in the permuted tensor
    ids = router_ids(t, 64, k, "cuda")
    r = fastft.moe_route(ids, 64)
    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    xs = fastft.moe_permute(x, r)
    assert xs.numel() > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    slots = torch.cat(
        [
            torch.arange(r.capacity - 64, r.capacity, device="cuda"),
            torch.randint(0, r.capacity, (4096,), device="cuda", generator=g),
        ]
    )
    testing.assert_same(xs[slots], x[r.sorted_pair[slots].long() // k])
    w = torch.rand(t, k, device="cuda")
    y = fastft.moe_unpermute(xs, r, w)
    tokens = torch.cat(
        [torch.arange(t - 64, t, device="cuda"), torch.randint(0, t, (512,), device="cuda", generator=g)]
    )
    expected = (w[tokens, :, None] * x[tokens, None].float()).sum(1).to(torch.bfloat16)
    testing.assert_same(y[tokens], expected, atol=0.05, rtol=0.02)


def test_unaligned_views_after_aligned_calls():
    # fastft's launcher reuses compiled kernels per specialization; a misaligned view must not reuse one
    # compiled for 16-byte aligned pointers.
    ids = router_ids(3000, 64, 6, "cuda", seed=4).int()
    x = torch.randn(3000, 200, device="cuda", dtype=torch.bfloat16)
    r = fastft.moe_route(ids, 64, block_size=8)
    fastft.moe_permute(x, r)
    buf = torch.empty(ids.numel() + 1, dtype=torch.int32, device="cuda")
    buf[1:].copy_(ids.flatten())
    shifted = buf[1:].view(3000, 6)
    assert shifted.data_ptr() % 16 != 0
    xbuf = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
    xbuf[1:].copy_(x.flatten())
    x_shifted = xbuf[1:].view(3000, 200)
    got = fastft.moe_route(shifted, 64, block_size=8)
    testing.assert_same(selfcheck.routing_fields(got), selfcheck.routing_fields(r))
    testing.assert_same(fastft.moe_permute(x_shifted, got), reference.permute(x, r.sorted_pair, 6))
