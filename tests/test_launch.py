"""fastft.kernels._launch: the host helpers and the key under which compiled kernels are reused."""

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastft.kernels._launch import _key, cdiv, next_power_of_2  # noqa: E402


def test_host_helpers_match_triton():
    for n in range(1, 3000):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        for b in (1, 3, 16, 1024):
            assert cdiv(n, b) == triton.cdiv(n, b)
    assert cdiv(0, 7) == 0


def test_key_separates_what_triton_specializes_on():
    buf = torch.empty(64, dtype=torch.int32)
    aligned, shifted = buf[:8], buf[1:9]
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 != 0
    assert _key((aligned,)) != _key((shifted,))
    assert _key((aligned,)) != _key((aligned.float(),))
    assert _key((aligned,)) == _key((buf[4:12],))  # another 16-byte aligned view: same specialization
    # ints: 1, multiples of 16 and the 32/64-bit ranges are specialized on; other values are not.
    assert _key((1,)) != _key((2,)) and _key((16,)) != _key((17,))
    assert _key((48,)) == _key((4800,)) and _key((49,)) == _key((4801,))
    assert _key((2**31 - 16,)) != _key((2**31,)) and _key((2**31,)) != _key((2**63,))
    assert _key((-(2**31),)) != _key((-(2**31) - 16,))
    assert _key((0.5,)) == _key((2.0,))  # floats are not specialized on their value
    assert _key((True,)) != _key((1,)) and _key((None,)) != _key((0,))


@triton.jit
def _fill_kernel(x_ptr, n, value, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, value, mask=i < n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cached_launch_runs_on_the_current_stream_and_calls_launch_hooks():
    from fastft.kernels._launch import _compiled, launch

    n = 1000
    x = torch.zeros(n, dtype=torch.int32, device="cuda")
    for value in (3, 4):  # the first call compiles, the second takes the cached kernel
        launch(_fill_kernel, (cdiv(n, 256),), x, n, value, BLOCK=256)
        assert torch.equal(x, torch.full_like(x, value))
    assert any(key[0] is _fill_kernel for key in _compiled)

    # Captured into a CUDA graph only if it went to the capturing (current) stream.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(_fill_kernel, (cdiv(n, 256),), x, n, 5, BLOCK=256)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 5))

    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        pytest.skip("launch hooks live in triton.knobs (Triton >= 3.4)")
    seen = []
    hook = seen.append
    chain = knobs.runtime.launch_enter_hook  # a HookChain on newer Tritons, else None or a callable
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        launch(_fill_kernel, (cdiv(n, 256),), x, n, 6, BLOCK=256)
    finally:
        if hasattr(chain, "add"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 1 and torch.equal(x, torch.full_like(x, 6))
