"""fastft.offloader: round trips of any strides through pinned host memory, reuse of copies and buffers,
the order of what was offloaded (``HostCopy.previous``), the pinned pool. GPU only, but for the errors."""

import pytest
import torch

from fastft.offloader import Offloader, PinnedPool

gpu = pytest.mark.gpu


def test_bad_input():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Offloader("cpu")
    with pytest.raises(TypeError, match="num_buffers must be an int, got bool"):
        Offloader("cuda", num_buffers=True)
    with pytest.raises(ValueError, match="num_buffers must be an int >= 1"):
        Offloader("cuda", num_buffers=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a torch without CUDA")
def test_offloader_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="this torch sees none"):
        Offloader("cuda")


@gpu
def test_previous_is_the_copy_offloaded_before():
    off = Offloader("cuda")
    first = off.offload(torch.randn(10, device="cuda"))
    second = off.offload(torch.randn(10, device="cuda"))
    assert first.previous() is None or first.previous() is not second
    assert second.previous() is first
    del first
    assert second.previous() is None  # weak: a copy nobody holds is no one's previous


@gpu
def test_offloader_round_trip_and_prefetch():
    off = Offloader("cuda", num_buffers=2)
    a = torch.randn(1000, 33, device="cuda")
    b = torch.randn(64, 100, device="cuda").t()  # dense, permuted: strides kept
    c = torch.randn(50, 80, device="cuda")[:, ::3]  # gapped: packed, strides kept
    saved = [off.offload(t) for t in (a, b, c)]
    first = off.reload(saved[2]).wait()  # the newest is still on the GPU: handed out once, no copy
    assert first is not c and first.data_ptr() == c.data_ptr() and off.stats["kept_on_device"] == 1
    for t, s in zip((a, b, c), saved):
        r = off.reload(s)
        assert off.reload(s) is r  # already issued, not overwritten: no second copy
        out = r.wait()
        assert torch.equal(out, t) and out.stride() == t.stride() and out.data_ptr() != t.data_ptr()
        del out
    assert off.stats["reloads"] == 3 and off.stats["fresh_buffers"] == 0
    held = off.reload(saved[0]).wait()  # keep a reloaded tensor alive: its buffer must not be refilled
    off.reload(saved[1])
    off.reload(saved[2])
    assert off.stats["fresh_buffers"] == 1
    assert torch.equal(held, a)


@gpu
def test_pinned_pool_exact_sizes_and_reuse():
    pool = PinnedPool(torch.cuda.current_stream())
    a = pool.take(3 * 2**20 + 5)  # not a power of two: held exactly
    assert a.is_pinned() and a.numel() == 3 * 2**20 + 5 and pool.held_bytes == a.numel()
    pool.give(a)
    b = pool.take(2**20)  # the free buffer serves a smaller request
    assert b.data_ptr() == a.data_ptr() and pool.held_bytes == a.numel()
    pool.give(b)
    c = pool.take(2**23)  # a miss: the free buffer (too small) is released, not kept beside the new one
    assert c.is_pinned() and pool.held_bytes == 2**23
    gpu = torch.randn(2**21, device="cuda")
    c.view(torch.float32).copy_(gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(c.view(torch.float32), gpu.cpu())


@gpu
def test_pinned_pool_falls_back_to_pageable_memory_with_one_warning(monkeypatch):
    class FailingCudart:
        def cudaHostRegister(self, ptr, size, flags):
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FailingCudart())
    off = Offloader("cuda")
    x, y = torch.randn(1000, 100, device="cuda"), torch.randn(10, 10, device="cuda")
    with pytest.warns(RuntimeWarning, match="page-locking .* failed") as record:
        saved_x = off.offload(x)
        off.offload(y)  # a second buffer: no second warning
    assert len(record) == 1 and not off.pool.pinned and not saved_x.host.is_pinned()
    assert torch.equal(off.reload(saved_x).wait(), x)  # x comes back from pageable host memory
