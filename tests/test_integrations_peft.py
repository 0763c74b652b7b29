"""fastft.integrations.peft: PEFT LoRA layers through fastft.lora.lora_linear, against PEFT's own forward."""

import copy

import pytest
import torch

from fastft import testing
from fastft.integrations import peft as ft_peft
from fastft.lora import lora_linear

GPU = torch.cuda.is_available()

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
def test_use_lora_matches_peft(dtype, monkeypatch, grads_close):
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
        grads_close(grads[key], want_grads[key], **tol, msg=key)


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
