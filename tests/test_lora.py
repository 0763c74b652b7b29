"""fastft.lora.lora_linear against its reference (fastft.reference.lora), and the PEFT integration."""

import copy

import pytest
import torch

from fastft import testing
from fastft.integrations import peft as ft_peft
from fastft.lora import lora_linear

GPU = torch.cuda.is_available()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(seed, dtype, rng):
    g = rng
    device = "cuda" if GPU and dtype == torch.bfloat16 else "cpu"
    args = testing.random_lora_case(g, dtype=dtype, device=device, bias=seed % 2 == 0)
    grad = torch.randn(args[0].shape[:-1] + (args[1].shape[0],), generator=g).to(device, dtype)
    testing.check_lora_case(*args, grad)


def test_no_grad_for_frozen_inputs_and_empty_batch():
    g = torch.Generator().manual_seed(7)
    x, weight, b, lora_a, lora_b, scaling = testing.random_lora_case(g, "cpu", torch.float32)
    lora_a.requires_grad_(False)
    y = lora_linear(x, weight, b, lora_a, lora_b, scaling)
    y.sum().backward()
    assert lora_a.grad is None and lora_b.grad is not None and x.grad is not None
    empty = lora_linear(x[:, :0].detach(), weight, b, lora_a, lora_b, scaling)
    assert empty.shape == (2, 0, weight.shape[0])


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
    with pytest.raises(ValueError, match="frozen base layer"):
        lora_linear(x, w.requires_grad_(), None, a, b, 1.0)
    with pytest.raises(TypeError, match="scaling must be a number"):
        lora_linear(x, w.detach(), None, a, b, torch.tensor(1.0))


# ---- PEFT -------------------------------------------------------------------------------------------------

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def tiny_lora(dtype, device, **lora):
    model = testing.tiny_hf_model("llama", dtype, device, intermediate_size=96, use_cache=False)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], **lora)
    )
    with torch.no_grad():  # LoRA B starts at zero: make the adapters matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_use_lora_matches_peft(dtype, monkeypatch):
    device = "cuda" if GPU and dtype == torch.bfloat16 else "cpu"
    model = tiny_lora(dtype, device)
    fast = ft_peft.use_lora(copy.deepcopy(model))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    calls = []
    monkeypatch.setattr(ft_peft, "lora_linear", lambda *a: calls.append(1) or lora_linear(*a))
    loss, grads = loss_and_grads(fast, ids)
    assert len(calls) == 8  # 4 targets x 2 layers
    want, want_grads = loss_and_grads(model, ids)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(loss, want, **tol)
    assert grads.keys() == want_grads.keys() and len(grads) == 16
    for key in grads:
        torch.testing.assert_close(grads[key], want_grads[key], **tol, msg=key)


def test_peft_forward_where_lora_linear_does_not_apply():
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    model = tiny_lora(torch.float32, "cpu", lora_dropout=0.5)
    fast = ft_peft.use_lora(copy.deepcopy(model))
    for m in (model, fast):  # dropout in training: PEFT's forward, same random mask
        torch.manual_seed(3)
        m.train()
    torch.manual_seed(3)
    want = model(input_ids=ids).logits
    torch.manual_seed(3)
    torch.testing.assert_close(fast(input_ids=ids).logits, want)
    with fast.disable_adapter(), model.disable_adapter():
        torch.testing.assert_close(fast(input_ids=ids).logits, model(input_ids=ids).logits)
    layer = next(m for m in fast.modules() if isinstance(m, peft.tuners.lora.layer.Linear))
    x = torch.randn(3, layer.in_features)
    assert ft_peft._plain_adapter(layer, x, (), {}) is None  # dropout
    layer.lora_dropout["default"].eval()
    assert ft_peft._plain_adapter(layer, x, (), {}) == "default"
    assert ft_peft._plain_adapter(layer, x, (), {"adapter_names": ["default"] * 3}) is None
    layer.merge()
    assert ft_peft._plain_adapter(layer, x, (), {}) is None


def test_use_lora_needs_lora_layers_and_apply_uses_it():
    from fastft.integrations import transformers as ft_hf

    with pytest.raises(ValueError, match="no PEFT LoRA Linear layers"):
        ft_peft.use_lora(torch.nn.Linear(2, 2))
    model = ft_hf.apply(tiny_lora(torch.float32, "cpu"), offload_checkpointing=False)
    layers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear)]
    assert layers and all("forward" in vars(m) for m in layers)
    assert not ft_peft.has_lora(torch.nn.Linear(2, 2))
