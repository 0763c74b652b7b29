"""fastft._custom_op.custom_op: eager calls that autograd records run a plain autograd.Function holding the op's
setup and backward (the registered formula's gradient, default arguments filled in, once differentiable); calls
autograd need not record run the implementation; dispatch modes and tensor lists take the registered op."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastft._custom_op import custom_op

CALLS = []


@custom_op("fastft_test::scaled")
def scaled(x: torch.Tensor, scale: float = 3.0) -> torch.Tensor:
    CALLS.append(scale)
    return x * scale


@scaled.register_fake
def _(x, scale=3.0):
    return torch.empty_like(x)


@custom_op("fastft_test::scaled_backward")
def scaled_backward(grad: torch.Tensor, scale: float) -> torch.Tensor:
    return grad * scale


def _setup(ctx, inputs, output):
    x, scale = inputs  # the default filled in where the call left it out
    ctx.scale = scale


def _backward(ctx, grad):
    return scaled_backward(grad, ctx.scale), None


scaled.register_autograd(_backward, setup_context=_setup)


@custom_op("fastft_test::summed")
def summed(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(xs).sum(0)


def _summed_setup(ctx, inputs, output):
    ctx.n = len(inputs[0])


summed.register_autograd(lambda ctx, grad: ([grad] * ctx.n,), setup_context=_summed_setup)


class Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_eager_call_autograd_records_runs_the_plain_function():
    x = torch.randn(5, requires_grad=True)
    CALLS.clear()
    y = scaled(x)
    assert CALLS == [3.0]  # the implementation, once
    assert type(y.grad_fn).__name__.startswith("fastft_test_scaled")  # not the op's generated function
    (grad,) = torch.autograd.grad(y, x, torch.ones(5))
    torch.testing.assert_close(grad, torch.full((5,), 3.0))
    (grad,) = torch.autograd.grad(scaled(x, 0.5), x, torch.ones(5))
    torch.testing.assert_close(grad, torch.full((5,), 0.5))


def test_a_call_autograd_need_not_record_runs_the_implementation():
    x = torch.randn(5)
    y = scaled(x)
    assert y.grad_fn is None and not y.requires_grad
    with torch.no_grad():
        assert scaled(x.requires_grad_()).grad_fn is None


def test_the_gradient_is_once_differentiable():
    x = torch.randn(5, requires_grad=True)
    (grad,) = torch.autograd.grad(scaled(x), x, torch.ones(5, requires_grad=True), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


def test_a_dispatch_mode_sees_the_registered_op_and_its_gradient():
    x = torch.randn(5, requires_grad=True)
    with Seen() as seen:
        y = scaled(x)
    assert any("fastft_test.scaled" in op for op in seen.ops), seen.ops
    (grad,) = torch.autograd.grad(y, x, torch.ones(5))
    torch.testing.assert_close(grad, torch.full((5,), 3.0))


def test_tensor_lists_take_the_registered_op():
    xs = [torch.randn(4, requires_grad=True) for _ in range(3)]
    y = summed(xs)
    assert type(y.grad_fn).__name__.startswith("GeneratedBackwardFor_fastft_test_summed")
    grads = torch.autograd.grad(y, xs, torch.ones(4))
    for g in grads:
        torch.testing.assert_close(g, torch.ones(4))
