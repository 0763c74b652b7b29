"""``fastft.moe_expert_parallel`` against a dense one-process computation: outputs and the gradients of the
tokens, the router weights and every expert, with uneven token counts per rank and unrouted ids; a rank whose
experts fail ends the run with its error instead of leaving the others in the all-to-all. Spawned processes
(``fastft.spawn.run``) on gloo (CPU); ``FASTFT_DIST_BACKEND=nccl FASTFT_DIST_WORLD=N`` runs them on N GPUs."""

import os
import warnings

import pytest
import torch

import fastft

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("needs torch.distributed", allow_module_level=True)

from fastft import spawn  # noqa: E402

BACKEND = os.environ.get("FASTFT_DIST_BACKEND", "gloo")
WORLD = int(os.environ.get("FASTFT_DIST_WORLD", "2"))
TIMEOUT = float(os.environ.get("FASTFT_DIST_TIMEOUT", "300"))
H, K, LOCAL = 8, 3, 3  # hidden width, top-k, experts per rank

pytestmark = pytest.mark.distributed
if BACKEND == "gloo" and not dist.is_gloo_available():
    pytest.skip("needs gloo", allow_module_level=True)
if BACKEND == "nccl" and (not dist.is_nccl_available() or torch.cuda.device_count() < WORLD):
    pytest.skip(f"needs NCCL and {WORLD} GPUs", allow_module_level=True)


def inputs(rank, seed, device="cpu"):
    """Rank ``rank``'s tokens [T, H], ids [T, K] (some -1 and E: unrouted), router weights [T, K], the
    upstream gradient [T, H] and the global expert weights [E, H, H]."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.randn(LOCAL * WORLD, H, H, generator=g)
    g.manual_seed(seed + 1 + rank)
    tokens = (9, 0, 5, 3)[rank % 4]  # uneven per rank; rank 1 sends nothing and only receives
    ids = torch.randint(-1, LOCAL * WORLD + 1, (tokens, K), generator=g)
    tensors = (torch.randn(tokens, H, generator=g), ids, torch.rand(tokens, K, generator=g))
    return (*(t.to(device) for t in tensors), torch.randn(tokens, H, generator=g).to(device), experts.to(device))


def dense(hidden, ids, weights, experts):
    """The specification: ``sum_k w[t, k] * hidden[t] @ experts[ids[t, k]]`` over ids in range."""
    valid = (ids >= 0) & (ids < experts.shape[0])
    rows = torch.einsum("th,tkhf->tkf", hidden, experts[ids.clamp(0, experts.shape[0] - 1)])
    return (rows * (weights * valid)[..., None]).sum(1)


def host_syncs(fn):
    """(``fn()``, where it made the host wait for the GPU; nothing off CUDA)."""
    if BACKEND != "nccl":
        return fn(), []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def worker(rank, out, seed):
    device = torch.device(f"cuda:{rank}") if BACKEND == "nccl" else torch.device("cpu")
    hidden, ids, weights, upstream, experts = inputs(rank, seed, device)
    if WORLD > 1:  # checked before any collective
        with pytest.raises(ValueError, match="divisible"):
            fastft.moe_expert_parallel(hidden, ids, weights, lambda r, i: r, num_experts=LOCAL * WORLD + 1)
        with pytest.raises(TypeError, match="local_experts must return a floating-point"):  # on every rank
            fastft.moe_expert_parallel(hidden, ids, weights, lambda r, i: i.expand(-1, H), num_experts=LOCAL * WORLD)
        first = dist.new_group([0])  # every rank takes part in making it; rank 0 alone is in it
        if rank > 0:
            with pytest.raises(ValueError, match="not a member"):
                fastft.moe_expert_parallel(hidden, ids, weights, lambda r, i: r, num_experts=LOCAL, group=first)
    local = experts[rank * LOCAL : (rank + 1) * LOCAL].clone().requires_grad_()
    hidden.requires_grad_()
    weights.requires_grad_()
    seen = []

    def local_experts(rows, local_ids):
        seen.append(local_ids)
        return torch.einsum("nh,nhf->nf", rows, local[local_ids[:, 0]])

    def forward_pass():
        return fastft.moe_expert_parallel(hidden, ids, weights, local_experts, num_experts=LOCAL * WORLD)

    (forward_pass() * upstream).sum().backward()  # warm-up: NCCL's communicator and the kernels start
    _, idle = host_syncs(lambda: None)  # and the sync debug mode's own first-use warning, if any
    for t in (hidden, weights, local):
        t.grad = None
    seen.clear()
    y, forward = host_syncs(forward_pass)
    _, backward = host_syncs(lambda: (y * upstream).sum().backward())
    if BACKEND == "nccl":  # the design's one sync: the split sizes, in forward; backward reuses them
        assert (len(forward), len(backward)) == (1, 0), (forward, backward, idle)
    assert seen[0].dtype == torch.int64 and seen[0].shape[1:] == (1,)
    assert bool(((seen[0] >= 0) & (seen[0] < LOCAL)).all())
    result = {n: t.detach().cpu() for n, t in dict(y=y, hidden=hidden.grad, weights=weights.grad).items()}
    torch.save({**result, "experts": local.grad.cpu()}, f"{out}.{rank}")


def test_matches_dense(tmp_path, rng):
    seed = int(torch.randint(0, 2**31, (), generator=rng))  # the fixture prints its own seed on failure
    out = str(tmp_path / "out")
    spawn.run(worker, (out, seed), world=WORLD, backend=BACKEND, timeout=TIMEOUT)
    results = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    experts = inputs(0, seed)[-1].requires_grad_()
    for rank, result in enumerate(results):
        hidden, ids, weights, upstream, _ = inputs(rank, seed)
        hidden.requires_grad_()
        weights.requires_grad_()
        y = dense(hidden, ids, weights, experts)
        (y * upstream).sum().backward()  # expert gradients sum over the ranks, as the all-to-all's do
        for name, want in dict(y=y, hidden=hidden.grad, weights=weights.grad).items():
            torch.testing.assert_close(result[name], want.detach(), msg=f"seed {seed}, rank {rank}: {name}")
    got = torch.cat([r["experts"] for r in results])
    torch.testing.assert_close(got, experts.grad, msg=f"seed {seed}: expert gradients")


def test_needs_a_process_group():
    x = torch.randn(4, H)
    ids = torch.zeros(4, K, dtype=torch.long)
    if dist.is_initialized():
        pytest.skip("a process group is set up in this process")
    with pytest.raises(ValueError, match="init_process_group"):
        fastft.moe_expert_parallel(x, ids, torch.ones(4, K), lambda r, i: r, num_experts=4)


def test_argument_types_are_checked_first():
    x, ids, w = torch.randn(4, H), torch.zeros(4, K, dtype=torch.long), torch.ones(4, K)
    with pytest.raises(TypeError, match="hidden must be a .* tensor, got list"):
        fastft.moe_expert_parallel(x.tolist(), ids, w, lambda r, i: r, num_experts=4)
    with pytest.raises(TypeError, match="topk_ids must be a .* tensor, got list"):
        fastft.moe_expert_parallel(x, ids.tolist(), w, lambda r, i: r, num_experts=4)
    with pytest.raises(ValueError, match=r"topk_ids must be \[T=4, K\]"):
        fastft.moe_expert_parallel(x, ids[:3], w, lambda r, i: r, num_experts=4)


def one_rank_fails_worker(rank):
    """The last rank's experts raise after the first all-to-alls; the others go on into the all-to-all back."""
    device = torch.device(f"cuda:{rank}") if BACKEND == "nccl" else torch.device("cpu")
    hidden, ids, weights, _, experts = inputs(rank, 0, device)
    local = experts[rank * LOCAL : (rank + 1) * LOCAL]

    def local_experts(rows, local_ids):
        if rank == WORLD - 1:
            raise RuntimeError("out of memory in this rank's experts")
        return torch.einsum("nh,nhf->nf", rows, local[local_ids[:, 0]])

    y = fastft.moe_expert_parallel(hidden, ids, weights, local_experts, num_experts=LOCAL * WORLD)
    y.sum().item()  # the others wait here for the rank that failed


@pytest.mark.skipif(WORLD < 2, reason="needs 2 ranks")
def test_a_rank_whose_experts_fail_ends_the_run_with_its_error():
    with pytest.raises(RuntimeError, match=f"rank {WORLD - 1} failed:(.|\n)*out of memory in this rank's experts"):
        spawn.run(one_rank_fails_worker, world=WORLD, backend=BACKEND, timeout=TIMEOUT)
