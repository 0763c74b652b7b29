"""fastft.copy.pack / unpack: the Triton path against the torch reference (interpreter on CPU)."""

import pytest
import torch
from hypothesis import given

from fastft import copy, selfcheck, testing
from fastft.kernels import copy as kernels


@given(testing.seeds_strategy())
def test_pack_unpack_match_reference(device, seed):
    g = torch.Generator().manual_seed(seed)
    selfcheck.check_copy_case(selfcheck.random_copy_case(g, device, 256), backend="triton")


def test_torch_backend_round_trips(rng):
    g = rng
    for _ in range(20):
        selfcheck.check_copy_case(selfcheck.random_copy_case(g, "cpu", 256), backend="torch")


def test_layout_offsets_are_aligned_and_packed():
    tensors = [
        torch.zeros(3, dtype=torch.bool),
        torch.zeros(5, dtype=torch.float64),
        torch.zeros(0),
        torch.zeros(2, dtype=torch.int16),
    ]
    layout = copy.PackLayout.of(tensors)
    assert [e.offset for e in layout.entries] == [0, 16, 64, 64]
    assert layout.nbytes == 68
    assert copy.PackLayout.of([]).nbytes == 0


def test_worked_example(device):
    a = torch.arange(6, dtype=torch.int32, device=device).view(2, 3).t()  # [[0, 3], [1, 4], [2, 5]], strides (1, 3)
    b = torch.tensor([7, 8], dtype=torch.int16, device=device)
    buf, layout = copy.pack([a, b], backend="triton")
    assert buf[:24].view(torch.int32).tolist() == [0, 3, 1, 4, 2, 5]  # row-major, whatever the strides
    assert buf[32:36].view(torch.int16).tolist() == [7, 8]
    a2, b2 = copy.unpack(buf, layout, backend="triton")
    assert a2.stride() == (1, 3) and torch.equal(a2, a) and torch.equal(b2, b)


def test_more_dims_than_the_kernel_takes_still_copy(device):
    base = torch.randn(3, 3, 3, 3, 3, 3, 3, device=device)
    t = base[::2, ::2, ::2, ::2, ::2, ::2, ::2]  # no two dimensions merge: 7 > MAX_DIMS
    assert len(kernels.merged_dims(t.shape, t.stride(), t.contiguous().stride())) > kernels.MAX_DIMS
    selfcheck.check_copy_case([t], backend="triton")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_conjugate_and_negative_views_copy_their_values(device, backend, rng):
    c = torch.randn(5, 3, dtype=torch.complex64, generator=rng).to(device)
    x = torch.randn(4, 2, generator=rng).to(device)
    lazy = [c.conj(), torch._neg_view(x), c.t().conj()]
    buf, layout = copy.pack(lazy, backend=backend)
    for got, want in zip(copy.unpack(buf, layout, backend=backend), lazy):
        assert torch.equal(got, want.resolve_conj().resolve_neg())
    out = [torch.zeros_like(c).conj(), torch._neg_view(torch.zeros_like(x)), torch.zeros_like(c).t().conj()]
    copy.unpack(buf, layout, out=out, backend=backend)  # into views: each reads back the packed values
    for got, want in zip(out, lazy):
        assert torch.equal(got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg())


def test_merged_dims():
    t = torch.empty(4, 5, 6)
    assert kernels.merged_dims(t.shape, t.stride(), t.stride()) == [(120, 1, 1)]
    s = t[:, :, ::2]
    assert kernels.merged_dims(s.shape, s.stride(), (15, 3, 1)) == [(60, 2, 1)]
    p = t.permute(2, 0, 1)
    assert kernels.merged_dims(p.shape, p.stride(), (20, 5, 1)) == [(20, 6, 1), (6, 1, 20)]
    assert kernels.merged_dims((1, 1), (0, 0), (1, 1)) == [(1, 0, 0)]


def test_dense_and_non_overlapping():
    t = torch.empty(4, 5, 6)
    assert copy.dense(t.shape, t.stride()) and copy.dense(t.permute(2, 0, 1).shape, t.permute(2, 0, 1).stride())
    assert not copy.dense(t[:, ::2].shape, t[:, ::2].stride()) and copy.non_overlapping(
        t[:, ::2].shape, t[:, ::2].stride()
    )
    e = t[:1].expand(3, 5, 6)
    assert not copy.non_overlapping(e.shape, e.stride())


def test_bad_input():
    t = torch.zeros(4)
    with pytest.raises(TypeError, match="tensors must be a list"):
        copy.pack(t)
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a tensor"):
        copy.pack([t, 3])
    buf, layout = copy.pack([t])
    with pytest.raises(ValueError, match="out must be a 1-D uint8"):
        copy.pack([t], out=torch.zeros(16))
    with pytest.raises(ValueError, match="hold 16 bytes"):
        copy.pack([t], out=torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="buffer must be a 1-D uint8"):
        copy.unpack(buf.view(torch.int32), layout)
    with pytest.raises(ValueError, match="hold 16 bytes"):
        copy.unpack(buf[:8], layout)
    with pytest.raises(TypeError, match="layout must be a PackLayout"):
        copy.unpack(buf, [t])
    with pytest.raises(ValueError, match=r"out\[0\] must be torch.float32 \[4\]"):
        copy.unpack(buf, layout, out=[torch.zeros(5)])
    with pytest.raises(ValueError, match="overlapping strides"):
        copy.unpack(buf, layout, out=[torch.zeros(1).expand(4)])
    with pytest.raises(ValueError, match="out has 2 tensors"):
        copy.unpack(buf, layout, out=[t, t])


@pytest.mark.gpu
def test_pack_unpack_random_cases_on_gpu(rng):
    g = rng
    for _ in range(200):
        selfcheck.check_copy_case(selfcheck.random_copy_case(g, "cuda", 1 << 16))


@pytest.mark.gpu
def test_pack_past_2_to_31_elements():
    base = torch.randint(-128, 127, (2**16 + 1, 2**15 + 3), dtype=torch.int8, device="cuda")
    view = base[:, 1:-2]  # 2**31 + 2**15 elements, rows with gaps
    buf, layout = copy.pack([view])
    assert layout.nbytes > 2**31
    assert torch.equal(buf.view(torch.int8).view(view.shape), view)
    (out,) = copy.unpack(buf, layout)
    assert out.stride() == view.stride() and torch.equal(out, view)
