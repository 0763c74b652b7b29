"""fastft.selective_checkpoint: which ops selective checkpointing saves, and a checkpoint with its context
computes what the layer without checkpoint does, running the saved ops once."""

import collections

import pytest
import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

import fastft.selective_checkpoint as sc


def test_saved_ops():
    mm, addmm_, add_ = torch.ops.aten.mm.default, torch.ops.aten.addmm_.default, torch.ops.aten.add_.Tensor
    x, w, thin = torch.empty(10, 64), torch.empty(64, 32), torch.empty(10, 4)
    assert sc.saved_by_selective(mm, (x, w))
    assert not sc.saved_by_selective(mm, (thin, torch.empty(4, 64)))  # LoRA's up projection: 4 < 64 / 8
    assert sc.saved_by_selective(mm, (thin, torch.empty(4, 32)))
    assert sc.saved_by_selective(addmm_, (torch.empty(10, 32), x, w))  # an in-place GEMM
    assert not sc.saved_by_selective(add_, (x, x))  # any other in-place op
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.empty(1, 2, 8, 16)
    assert sc.saved_by_selective(flash, (q, q, q))
    assert not sc.saved_by_selective(flash, (q, q, q, 0.1))  # dropout: recomputed with its random numbers
    assert not sc.saved_by_selective(flash, (q, q, q), {"dropout_p": 0.1})


def layer(x, w1, w2):
    return (torch.relu(x @ w1) @ w2).sin()  # both GEMMs' results are needed in backward


def test_selective_checkpoint_equals_no_checkpoint(rng):
    x, w1, w2 = (torch.randn(*shape, generator=rng, requires_grad=True) for shape in ((6, 32), (32, 64), (64, 32)))
    want = layer(x, w1, w2)
    want_grads = torch.autograd.grad(want.square().sum(), (x, w1, w2))
    mms = {}
    for name, context in (("full", None), ("selective", sc.selective_context)):
        extra = {} if context is None else {"context_fn": context}
        got = torch.utils.checkpoint.checkpoint(layer, x, w1, w2, use_reentrant=False, **extra)
        with CountMatmuls() as counter:
            grads = torch.autograd.grad(got.square().sum(), (x, w1, w2))
        mms[name] = counter.count
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert mms["selective"] == mms["full"] - 2  # the forward's two GEMMs are not run again


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = self.addmm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.mm.default
        self.addmm += func is torch.ops.aten.addmm_.default
        return func(*args, **(kwargs or {}))


def test_saved_result_written_into_later_is_an_error(rng):
    def writes_into_its_gemm(x, w):
        y = x @ w
        y.mul_(2)  # the saved result of the GEMM, changed after it was saved
        return y.sin()

    x, w = torch.randn(4, 16, generator=rng), torch.randn(16, 16, generator=rng, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(
        writes_into_its_gemm, x, w, use_reentrant=False, context_fn=sc.selective_context
    )
    with pytest.raises(RuntimeError, match="modified in place after it was saved"):
        out.sum().backward()
    # named in skip, it is recomputed instead: the gradient of the layer without checkpoint
    skip = frozenset({(torch.ops.aten.mm.default, 0)})
    out = torch.utils.checkpoint.checkpoint(
        writes_into_its_gemm, x, w, use_reentrant=False, context_fn=lambda: sc.selective_context(skip)
    )
    (got,) = torch.autograd.grad(out.sum(), (w,))
    (want,) = torch.autograd.grad(writes_into_its_gemm(x, w).sum(), (w,))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_last_op_result_written_into_after_the_checkpoint_is_an_error(rng):
    """The saved op is the region's last (attention, whose backward reads its output): its result, the
    checkpoint's output, written into afterwards."""
    q, k, v = (torch.randn(1, 2, 4, 8, generator=rng, requires_grad=True) for _ in range(3))
    attention = torch.nn.functional.scaled_dot_product_attention
    out = torch.utils.checkpoint.checkpoint(attention, q, k, v, use_reentrant=False, context_fn=sc.selective_context)
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place after it was saved"):
        out.sum().backward()


def test_in_place_gemm_is_saved_and_exact(rng):
    def layer(x, w, b):
        y = b.expand(x.shape[0], -1).clone()
        y.addmm_(x, w)  # an in-place GEMM: its result is written back into y in the recomputation
        return y.sin()

    x = torch.randn(4, 16, generator=rng)
    w, b = torch.randn(16, 16, generator=rng, requires_grad=True), torch.randn(16, generator=rng, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(layer, x, w, b, use_reentrant=False, context_fn=sc.selective_context)
    with CountMatmuls() as counter:
        got = torch.autograd.grad(out.sum(), (w, b))
    want = torch.autograd.grad(layer(x, w, b).sum(), (w, b))
    for g, v in zip(got, want):
        torch.testing.assert_close(g, v, rtol=0, atol=0)
    assert counter.addmm == 0  # not run again in the recomputation


@pytest.mark.parametrize("bias", [False, True])
def test_lora_linear_forward_saved_whole(bias, rng):
    """``lora_linear``'s forward is one saved op: the recomputation runs no product of it (neither the base
    GEMM nor the low-rank ones), and the gradients are those of the layer without checkpoint."""
    from fastft.lora import lora_linear

    x = torch.randn(6, 32, generator=rng, requires_grad=True)
    w = torch.randn(48, 32, generator=rng)
    bias_t = torch.randn(48, generator=rng) if bias else None
    a = torch.randn(4, 32, generator=rng, requires_grad=True)
    b = torch.randn(48, 4, generator=rng, requires_grad=True)

    def layer(x, a, b):
        return lora_linear(x, w, bias_t, a, b, 0.5).sin()

    want = torch.autograd.grad(layer(x, a, b).square().sum(), (x, a, b))
    out = torch.utils.checkpoint.checkpoint(layer, x, a, b, use_reentrant=False, context_fn=sc.selective_context)
    with CountOps() as counter:
        got = torch.autograd.grad(out.square().sum(), (x, a, b))
    for g, v in zip(got, want):
        torch.testing.assert_close(g, v, rtol=0, atol=0)
    assert counter.seen["fastft::lora_linear_forward"] == 0  # returned from the store, not run
    # the backward's products alone: dyb, dx's two, da and db
    assert counter.seen["aten::mm"] + counter.seen["aten::addmm"] + counter.seen["aten::addmm_"] == 5


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func._schema.name] += 1
        return func(*args, **(kwargs or {}))
