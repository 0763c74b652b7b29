"""fastft.lora.lora_linear against its reference (fastft.reference.lora); the PEFT integration is in
tests/test_integrations_peft.py."""

import pytest
import torch

from fastft import lora, selfcheck
from fastft.lora import lora_linear

GPU = torch.cuda.is_available()


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(case, dtype, rng):
    g = rng
    device = "cuda" if GPU and dtype == torch.bfloat16 else "cpu"
    args = selfcheck.random_lora_case(g, dtype=dtype, device=device, bias=case % 2 == 0)  # both GEMM orders
    grad = torch.randn(args[0].shape[:-1] + (args[1].shape[0],), generator=g).to(device, dtype)
    selfcheck.check_lora_case(*args, grad)


def test_no_grad_for_frozen_inputs_and_empty_batch():
    g = torch.Generator().manual_seed(7)
    x, weight, b, lora_a, lora_b, scaling = selfcheck.random_lora_case(g, "cpu", torch.float32)
    lora_a.requires_grad_(False)
    y = lora_linear(x, weight, b, lora_a, lora_b, scaling)
    y.sum().backward()
    assert lora_a.grad is None and lora_b.grad is not None and x.grad is not None
    empty = lora_linear(x[:, :0].detach(), weight, b, lora_a, lora_b, scaling)
    assert empty.shape == (2, 0, weight.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_as_a_function_is_materialised_in_forward_and_backward_only(dtype, rng):
    """A quantized base given as a function of no arguments: the same results as the tensor it returns, bit for
    bit, and the function runs once in forward and once in backward (the weight is not kept between them)."""
    device = "cuda" if GPU and dtype == torch.bfloat16 else "cpu"
    x, weight, b, lora_a, lora_b, scaling = selfcheck.random_lora_case(rng, dtype=dtype, device=device, bias=True)
    grad = torch.randn(x.shape[:-1] + (weight.shape[0],), generator=rng).to(device, dtype)
    calls = []

    def dequantize():
        calls.append(1)
        return weight.clone()  # a fresh tensor each call, as a dequantization makes

    results = []
    for w in (weight, dequantize):
        for t in (x, lora_a, lora_b):
            t.grad = None
        y = lora_linear(x, w, b, lora_a, lora_b, scaling)
        y.backward(grad)
        results.append((y.detach(), x.grad, lora_a.grad, lora_b.grad))
    assert len(calls) == 2
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)
    calls.clear()
    with torch.no_grad():
        lora_linear(x, dequantize, b, lora_a, lora_b, scaling)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="must match weight's in features"):
        lora_linear(x, lambda: torch.cat([weight, weight], 1), b, lora_a, lora_b, scaling)  # checked like a tensor


def test_errors():
    x, w, a, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(2, 8), torch.randn(5, 2)
    with pytest.raises(TypeError, match="x must be a tensor"):
        lora_linear([1.0], w, None, a, b, 1.0)
    with pytest.raises(TypeError, match="weight must be floating point"):
        lora_linear(x, w.long(), None, a, b, 1.0)
    with pytest.raises(ValueError, match="in features"):
        lora_linear(torch.randn(3, 7), w, None, a, b, 1.0)
    with pytest.raises(ValueError, match="lora_b must be"):
        lora_linear(x, w, None, a, torch.randn(5, 3), 1.0)
    with pytest.raises(ValueError, match="bias must be"):
        lora_linear(x, w, torch.randn(4), a, b, 1.0)
    with pytest.raises(TypeError, match="x's dtype"):
        lora_linear(x, w.double(), None, a, b, 1.0)
    with pytest.raises(
        TypeError, match="weight must be a tensor or a function of no arguments returning one, got Linear"
    ):
        lora_linear(x, torch.nn.Linear(8, 5), None, a, b, 1.0)
    with pytest.raises(ValueError, match="frozen base layer"):
        lora_linear(x, w.requires_grad_(), None, a, b, 1.0)
    with pytest.raises(TypeError, match="scaling must be a number"):
        lora_linear(x, w.detach(), None, a, b, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"weight must be \[out, in\] with out, in >= 1, got \(5, 0\)"):
        lora_linear(x[:, :0], w[:, :0].detach(), None, a[:, :0], b, 1.0)
    with pytest.raises(ValueError, match=r"out, in >= 1, got \(0, 8\)"):
        lora_linear(x, w[:0].detach(), None, a, b[:0], 1.0)


@pytest.mark.parametrize("bias", [False, True])
def test_forward_op_opcheck(bias, rng):
    x, w, a, b = (torch.randn(*s, generator=rng) for s in ((7, 16), (12, 16), (4, 16), (12, 4)))
    args = (x, w, torch.randn(12, generator=rng) if bias else None, a, b, 0.5)
    torch.library.opcheck(lora.forward_op.op, args)
    out, xa = lora.forward_op.op(*args)
    torch.testing.assert_close(xa, x @ a.T)
    torch.testing.assert_close(out, x @ w.T + (args[2] if bias else 0) + 0.5 * (x @ a.T) @ b.T)
